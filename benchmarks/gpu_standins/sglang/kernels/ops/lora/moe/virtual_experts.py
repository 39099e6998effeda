"""Stand-in for ``sglang.kernels.ops.lora.moe.virtual_experts``: the name the dense route builder
(``sglang.kernels.ops.lora.common.routing``) imports, for its large routes. SGLang's JIT alignment
kernel behind it is not carried: ``triton_v2`` prefill of 2048 tokens or more reached it on the
H200 (2026-12-03), so those points fail with this error in the layer benchmark."""


def _align_block_size_jit(*args, **kwargs):
    raise NotImplementedError(
        "MoE LoRA routes (SGLang's JIT alignment kernel) are not part of the benchmarks"
    )
