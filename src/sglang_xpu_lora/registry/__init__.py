"""The ``sglang.lora_backends`` registry: specs, pluggy hook specs and the loader."""

from __future__ import annotations

import functools

from sglang_xpu_lora.registry.hookspecs import ENTRY_POINT_GROUP, hookimpl
from sglang_xpu_lora.registry.manager import (
    DuplicateBackendError,
    LoRABackendRegistry,
    ReservedBackendNameError,
)
from sglang_xpu_lora.registry.spec import LoRABackendSpec


@functools.lru_cache(maxsize=None)
def get_registry() -> LoRABackendRegistry:
    """The process-wide registry (entry points are loaded by :func:`sglang_xpu_lora.plugin.load`)."""
    return LoRABackendRegistry()


__all__ = [
    "ENTRY_POINT_GROUP",
    "DuplicateBackendError",
    "LoRABackendRegistry",
    "LoRABackendSpec",
    "ReservedBackendNameError",
    "get_registry",
    "hookimpl",
]
