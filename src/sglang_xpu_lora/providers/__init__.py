"""Op providers and the ``SGLANG_XPU_LORA_KERNELS`` selector.

``SGLANG_XPU_LORA_KERNELS`` (default ``auto``):

* ``torch``: the portable PyTorch provider (:mod:`.torch_ops`) on any device; this is also what
  lets ``--lora-backend intel_xpu`` run with a device other than ``xpu``.
* ``native``: the sgl-kernel-xpu ops. Not available in this release: selecting it is an error at
  start-up.
* ``auto``: native where available; in this release always the portable provider, with a one-time
  warning.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType

KERNELS_ENV = "SGLANG_XPU_LORA_KERNELS"
KERNEL_CHOICES = ("auto", "native", "torch")

logger = logging.getLogger(__name__)
_warned_auto = False


def kernels_choice() -> str:
    """The validated value of ``SGLANG_XPU_LORA_KERNELS``.

    Raises:
        ValueError: if the variable holds anything but ``auto``, ``native`` or ``torch``.
    """
    value = os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"
    if value not in KERNEL_CHOICES:
        raise ValueError(
            f"{KERNELS_ENV}={os.environ.get(KERNELS_ENV)!r} is not one of "
            f"{', '.join(KERNEL_CHOICES)}; unset it or set {KERNELS_ENV}=torch for the portable kernels"
        )
    return value


def portable_kernels_selected() -> bool:
    """True when the portable PyTorch kernels were chosen explicitly (``SGLANG_XPU_LORA_KERNELS=torch``)."""
    return kernels_choice() == "torch"


def load_provider() -> ModuleType:
    """Return the op provider selected by ``SGLANG_XPU_LORA_KERNELS``.

    Returns:
        A module exporting the seven ops of :class:`.base.LoRAOpsProvider` and a ``name``.
    Raises:
        ValueError: for an invalid selector value.
        RuntimeError: for ``native``, which this release does not provide yet.
    """
    global _warned_auto
    choice = kernels_choice()
    if choice == "native":
        raise RuntimeError(
            f"{KERNELS_ENV}=native: the native sgl-kernel-xpu provider is not part of this release "
            f"of sglang-xpu-lora; use {KERNELS_ENV}=torch (portable PyTorch kernels) or auto"
        )
    from sglang_xpu_lora.providers import torch_ops

    if choice == "auto" and not _warned_auto:
        _warned_auto = True
        logger.warning(
            "sglang-xpu-lora: %s=auto uses the portable PyTorch LoRA kernels (the native "
            "sgl-kernel-xpu provider is not part of this release); set %s=torch to silence this",
            KERNELS_ENV,
            KERNELS_ENV,
        )
    return torch_ops
