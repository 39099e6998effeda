"""Stand-in for ``sglang.kernels.ops.lora.moe.virtual_experts``: the name the dense route builder
(``sglang.kernels.ops.lora.common.routing``) imports, for its large routes. SGLang's JIT alignment
kernel behind it is not carried: the layer benchmark builds ``triton_v2``'s routes of more than 512
tokens with SGLang's pure-Triton builder instead (``benchmarks.layer.route_large_batches_in_triton``),
so nothing measured reaches this."""


def _align_block_size_jit(*args, **kwargs):
    raise NotImplementedError(
        "MoE LoRA routes (SGLang's JIT alignment kernel) are not part of the benchmarks"
    )
