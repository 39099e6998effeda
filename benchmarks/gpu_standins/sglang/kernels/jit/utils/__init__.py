"""Stand-in for ``sglang.kernels.jit.utils``: the name SGLang's large route builder imports
(``sglang.kernels.ops.lora.common.routing._build_large_route``), answering as the real
``arch.is_arch_support_pdl`` does on a CUDA machine (programmatic dependent launch from sm90 on)."""

import functools

import torch


@functools.cache
def is_arch_support_pdl() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
