"""``sglang.srt.plugins`` entry point: make pinned host memory a no-op without an accelerator.

SGLang's LoRA code calls ``torch.tensor(..., pin_memory=True)`` and ``Tensor.pin_memory()``
unconditionally (``sglang/srt/lora/layers.py``, ``lora.py``, ``torch_backend.py`` in 0.5.23). On a
machine without CUDA/XPU, torch raises ("Found no NVIDIA driver" or "pin_memory=True requires a CUDA
or other accelerator backend"). Pinning only speeds up host-to-device copies, so dropping it on a
CPU-only machine changes no numbers.
"""

from __future__ import annotations

import functools

_PATCHED_CONSTRUCTORS = ("tensor", "empty", "zeros", "arange")


def _has_accelerator() -> bool:
    import torch

    if torch.cuda.is_available():
        return True
    xpu = getattr(torch, "xpu", None)
    return bool(xpu is not None and xpu.is_available())


def _drop_pin_memory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    wrapper._cpu_devsupport_wrapped = True
    return wrapper


def register() -> None:
    """Install the shim once per process; a no-op when an accelerator is present."""
    import torch
    import torch.utils._device

    if getattr(torch.Tensor.pin_memory, "_cpu_devsupport_wrapped", False) or _has_accelerator():
        return
    # torch caches the set of factory functions that ``with torch.device(...)`` intercepts. Build
    # that cache from the originals first, or ``torch.device("meta")`` contexts (used by HF
    # ``from_pretrained``) stop intercepting the wrapped factories and produce garbage buffers.
    torch.utils._device._device_constructors()
    for name in _PATCHED_CONSTRUCTORS:
        setattr(torch, name, _drop_pin_memory(getattr(torch, name)))

    def pin_memory(self, *args, **kwargs):
        return self

    pin_memory._cpu_devsupport_wrapped = True
    torch.Tensor.pin_memory = pin_memory
