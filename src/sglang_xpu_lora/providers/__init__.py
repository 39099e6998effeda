"""Op providers and their selection, per op and per mode (eager / inside graphs).

Providers, one module each, all with the seven ops of :mod:`.base` and a ``PROVIDER`` that
describes the provider to the selection (:class:`.base.Provider`):

* :mod:`.native`: the sgl-kernel-xpu ops through ``torch.ops.sgl_kernel``, detected per op;
* :mod:`.triton_ops`: SGLang's own Triton LoRA kernels (``sglang.kernels.ops.lora.dense``);
* :mod:`.torch_ops`: portable PyTorch ops, on any device.

All of them read SGLang's packed pool at each slot's real rank; :mod:`.slice_layout` moves a
shrink's slices to where the native and portable multi-slice expands read them.

:mod:`.selection` walks them in order of preference (:data:`.selection.PROVIDERS`) and chooses one
per op, outside and inside graphs, from ``SGLANG_XPU_LORA_KERNELS`` (``auto``, ``native``,
``triton``, ``torch``), the installed kernel build and the serving device; ``sglang-xpu-lora
doctor`` shows the result with the reason for each choice.

Scope: the selection covers the dense LoRA ops of ``IntelXpuLoRABackend``. LoRA on MoE experts and
the absorbed-MLA ``kv_b_proj`` correction are computed by SGLang's own Triton kernels whatever this
variable says (:mod:`sglang_xpu_lora.backend.outside_lora_math`).
"""

from __future__ import annotations

from sglang_xpu_lora.providers.selection import (
    KERNEL_CHOICES,
    KERNELS_ENV,
    PROVIDERS,
    OpChoice,
    OpSelection,
    SelectionLog,
    choose,
    kernels_choice,
    logger,
    portable_kernels_selected,
    runs_on_device,
    select_ops,
)
from sglang_xpu_lora.providers.native import kernel_build
from sglang_xpu_lora.providers.triton_ops import triton_support

__all__ = [
    "KERNEL_CHOICES",
    "KERNELS_ENV",
    "PROVIDERS",
    "OpChoice",
    "OpSelection",
    "SelectionLog",
    "choose",
    "kernel_build",
    "kernels_choice",
    "logger",
    "portable_kernels_selected",
    "runs_on_device",
    "select_ops",
    "triton_support",
]
