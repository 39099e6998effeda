"""``sglang.lora_backends`` entry point of sglang-xpu-lora: declares the ``intel_xpu`` backend.

Imports neither torch nor SGLang (``tests/unit/test_import_layers.py`` proves it with both blocked):
the backend class and the op selection are imported by the callables of the spec, only when SGLang
validates or resolves ``--lora-backend intel_xpu``.
"""

from __future__ import annotations

from typing import Optional

from sglang_xpu_lora.registry import LoRABackendSpec, hookimpl
from sglang_xpu_lora.upstream.devices import TRY_ON_CPU


def _intel_xpu_backend_class() -> type:
    from sglang_xpu_lora.backend.xpu import IntelXpuLoRABackend

    return IntelXpuLoRABackend


def _runs_on_device(device: Optional[str]) -> bool:
    """:func:`sglang_xpu_lora.providers.selection.runs_on_device`, imported when first asked."""
    from sglang_xpu_lora.providers import runs_on_device

    return runs_on_device(device)


def _select_ops(device: Optional[str]) -> object:
    """:func:`sglang_xpu_lora.providers.selection.select_ops`, imported when first asked."""
    from sglang_xpu_lora.providers import select_ops

    return select_ops(device)


def _needs_zeroed_slots(backend) -> bool:
    """The instance's own answer: :attr:`~sglang_xpu_lora.backend.xpu.IntelXpuLoRABackend.needs_zeroed_slots`."""
    return backend.needs_zeroed_slots


def _receive_memory_pool(backend, pool) -> None:
    """:meth:`~sglang_xpu_lora.backend.xpu.IntelXpuLoRABackend.use_memory_pool`."""
    backend.use_memory_pool(pool)


INTEL_XPU = LoRABackendSpec(
    name="intel_xpu",
    factory=_intel_xpu_backend_class,
    device="xpu",
    runs_on_other_devices=_runs_on_device,
    other_devices_hint=f"its LoRA kernels are Intel GPU kernels (sgl-kernel-xpu, Triton on XPU); {TRY_ON_CPU}",
    preflight=_select_ops,
    needs_zeroed_lora_slots=_needs_zeroed_slots,
    receives_memory_pool=_receive_memory_pool,
)


@hookimpl
def sglang_lora_backends() -> list[LoRABackendSpec]:
    """The backends of this distribution: ``intel_xpu``."""
    return [INTEL_XPU]
