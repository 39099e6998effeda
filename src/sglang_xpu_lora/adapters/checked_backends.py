"""Which adapters the checks and fixes apply to.

By default only adapters served by a backend registered through ``sglang.lora_backends``
(``intel_xpu`` and any other plugin backend), so SGLang's own backends behave exactly as upstream.
``SGLANG_XPU_LORA_ADAPTER_CHECKS=all`` opts SGLang's own backends (``csgmv``, ``triton``,
``torch_native``, ...) in; ``sglang-xpu-lora doctor`` reports the setting.
"""

from __future__ import annotations

from sglang_xpu_lora.registry import get_registry
from sglang_xpu_lora.settings import ADAPTER_CHECKS_ENV, env_choice
#: Accepted values: "plugin" (the default: plugin backends only) and "all".
CHOICES = ("plugin", "all")


def setting() -> str:
    """The ``SGLANG_XPU_LORA_ADAPTER_CHECKS`` value in effect ("plugin" when unset).

    Raises:
        ValueError: for any other value, naming the variable and the accepted values.
    """
    return env_choice(ADAPTER_CHECKS_ENV, CHOICES)


def applies_to(backend_name: str) -> bool:
    """Whether adapters served by ``--lora-backend backend_name`` are checked and fixed at load.

    Raises:
        ValueError: for an invalid ``SGLANG_XPU_LORA_ADAPTER_CHECKS`` (see :func:`setting`).
    """
    return setting() == "all" or backend_name in get_registry().specs()


def describe() -> str:
    """One line for ``doctor``: which backends' adapters are checked, and how to change it."""
    try:
        value = setting()
    except ValueError as exc:
        return f"invalid: {exc}"
    if value == "all":
        return f"every LoRA backend, SGLang's own included ({ADAPTER_CHECKS_ENV}=all)"
    backends = ", ".join(sorted(get_registry().specs())) or "none registered"
    return f"plugin backends only ({backends}); set {ADAPTER_CHECKS_ENV}=all to check SGLang's own backends too"
