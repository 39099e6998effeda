"""Stand-in for ``sglang.kernels.ops.lora.moe.virtual_experts``: the name the dense route builder
(``sglang.kernels.ops.lora.common.routing``) imports. It is used only for routes of 8192 buckets or
more (MoE LoRA), which a dense layer with a handful of adapter slots never builds."""


def _align_block_size_jit(*args, **kwargs):
    raise NotImplementedError(
        "MoE LoRA routes (SGLang's JIT alignment kernel) are not part of the benchmarks"
    )
