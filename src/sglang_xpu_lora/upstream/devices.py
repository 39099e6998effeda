"""Which device SGLang 0.5.23 serves on when ``--device`` is not given, why, and what its CPU engine
needs beyond SGLang itself: the facts behind the device errors at argument validation and
``sglang-xpu-lora doctor``'s verdict.

SGLang picks the device in ``sglang.srt.utils.common.get_device``: the CPU when
``SGLANG_USE_CPU_ENGINE=1``, else CUDA, else XPU, then other accelerators and platform plugins;
with none it raises ``RuntimeError``. Its CPU engine (``srt/platforms``) is selected by the same
variable; without it SGLang takes its generic platform, whose RoPE imports ``vllm._custom_ops``
(``No module named 'vllm'`` in the scheduler). On the CPU engine SGLang imports ``sgl_kernel``'s
``*_cpu`` ops at start-up (``kernels/ops/kvcache/cache_move.py``), and its LoRA layers pin host
memory (``torch.tensor(..., pin_memory=True)``, ``srt/lora/layers.py``), which a torch without an
accelerator refuses.

Imports torch and SGLang only inside the functions that need them (this package is a leaf).
"""

from __future__ import annotations

import importlib
import os
from typing import Optional

from sglang_xpu_lora.settings import KERNELS_ENV
from sglang_xpu_lora.upstream import targets
from sglang_xpu_lora.upstream.compat import resolve

#: The variable that selects SGLang's CPU engine (read by SGLang's ``get_device`` and platforms).
CPU_ENGINE_ENV = "SGLANG_USE_CPU_ENGINE"

#: How to try ``intel_xpu`` on a CPU (its portable kernels; for testing, not for speed).
TRY_ON_CPU = (
    f"to try it on CPU (portable PyTorch kernels, for testing): set {KERNELS_ENV}=torch and "
    f"{CPU_ENGINE_ENV}=1 and pass --device cpu, then run `sglang-xpu-lora doctor --device cpu` to "
    "check what else SGLang's CPU engine needs"
)


def cpu_engine_selected() -> bool:
    """Whether ``SGLANG_USE_CPU_ENGINE=1``, as SGLang reads it."""
    return os.environ.get(CPU_ENGINE_ENV, "0") == "1"


def device_seen(device: str) -> str:
    """What torch sees of ``device`` (``"xpu"``, ``"cuda"``...), as a clause: ``"torch sees 1 xpu
    device"`` or why it sees none (an XPU-less torch build, or a build that finds no device)."""
    import torch

    module = getattr(torch, device, None)
    if module is not None and getattr(module, "is_available", lambda: False)():
        count = module.device_count() if hasattr(module, "device_count") else 1
        return f"torch sees {count} {device} device{'s' if count != 1 else ''}"
    if device == "xpu" and getattr(torch.version, "xpu", None) is None:
        return f"torch sees no XPU: this torch ({torch.__version__}) is not an XPU build"
    if device == "xpu":
        return (
            f"torch sees no XPU (torch {torch.__version__}, an XPU build, finds no device: check the "
            "GPU driver and compute runtime, ZE_AFFINITY_MASK, and access to /dev/dri)"
        )
    return f"torch sees no {device} device"


def device_available(device: str) -> bool:
    """Whether torch has a usable ``device`` (always True for ``"cpu"``)."""
    import torch

    if device == "cpu":
        return True
    module = getattr(torch, device, None)
    return bool(module is not None and getattr(module, "is_available", lambda: False)())


def why_picked(device: Optional[str]) -> str:
    """Why SGLang's ``get_device`` picks ``device`` (None: it found none) when ``--device`` is not
    given, as a clause naming the switch or what torch sees."""
    if device == "cpu" and cpu_engine_selected():
        return f"{CPU_ENGINE_ENV}=1 makes SGLang serve on the CPU; {device_seen('xpu')}"
    if device == "cuda":
        return f"{device_seen('cuda')}, which SGLang picks before an XPU"
    if device == "xpu":
        return device_seen("xpu")
    seen = device_seen("xpu")
    if device is None:
        return f"{seen}, no other accelerator either, and {CPU_ENGINE_ENV} is not 1"
    return f"{seen}; SGLang found {device}"


def picked_device() -> tuple[Optional[str], str]:
    """``(device, why)``: the device SGLang serves on when ``--device`` is not given (SGLang's own
    ``get_device``; None when it finds none) and :func:`why_picked`."""
    try:
        device: Optional[str] = resolve(targets.GET_DEVICE)().split(":")[0]
    except RuntimeError:
        device = None
    return device, why_picked(device)


def cpu_engine_problems() -> list[str]:
    """What SGLang's CPU engine needs that this process lacks, one actionable sentence each: the
    engine switch, an importable ``sgl_kernel``, and pinned host memory (run it after SGLang's
    ``load_plugins()``, which installs any shim a plugin provides). Empty when all are there."""
    import torch

    problems = []
    if not cpu_engine_selected():
        problems.append(
            f"SGLang serves on the CPU only with {CPU_ENGINE_ENV}=1; without it SGLang takes its "
            "generic platform and its scheduler fails at start-up (No module named 'vllm')"
        )
    try:
        importlib.import_module("sgl_kernel")
    except Exception as exc:  # noqa: BLE001 - SGLang's import fails the same way
        problems.append(
            f"SGLang's CPU engine imports sgl_kernel at start-up, which fails here ({type(exc).__name__}: "
            f"{exc}); install an sgl_kernel with the *_cpu ops (for development on a CPU-only machine: "
            "the stub in devsupport/, see devsupport/README.md)"
        )
    try:
        torch.tensor([0], pin_memory=True)
        torch.zeros(1).pin_memory()
    except RuntimeError as exc:
        problems.append(
            "SGLang's LoRA layers pin host memory (torch.tensor(..., pin_memory=True)), which this torch "
            f"refuses without an accelerator ({str(exc).splitlines()[0]}); on a CPU-only machine a plugin "
            "must make pinning a no-op (for development: devsupport's cpu_pin_memory_shim)"
        )
    return problems
