"""``sglang.lora_backends`` entry point of sglang-xpu-lora: declares the ``intel_xpu`` backend.

Imports nothing heavy: the backend class (torch, SGLang) is imported by the factory, only when
SGLang resolves ``--lora-backend intel_xpu``.
"""

from __future__ import annotations

from sglang_xpu_lora.providers import KERNELS_ENV, runs_on_device, select_ops
from sglang_xpu_lora.registry import LoRABackendSpec, hookimpl


def _intel_xpu_backend_class() -> type:
    from sglang_xpu_lora.backend.xpu import IntelXpuLoRABackend

    return IntelXpuLoRABackend


INTEL_XPU = LoRABackendSpec(
    name="intel_xpu",
    factory=_intel_xpu_backend_class,
    device="xpu",
    runs_on_other_devices=runs_on_device,
    other_devices_hint=f"set {KERNELS_ENV}=torch to run the portable PyTorch LoRA kernels on it",
    preflight=select_ops,
    needs_max_rank_spaced_layout=True,
)


@hookimpl
def sglang_lora_backends() -> list[LoRABackendSpec]:
    """The backends of this distribution: ``intel_xpu``."""
    return [INTEL_XPU]
