"""Stand-in for ``sglang.srt.utils``: what the Triton LoRA ops import."""

import torch


def get_device_name(device_id: int = 0) -> str:
    return torch.cuda.get_device_name(device_id)


def cached_triton_kernel(key_fn=None):
    """No extra launch cache: Triton's own caching applies."""
    return lambda fn: fn
