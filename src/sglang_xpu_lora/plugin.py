"""``sglang.srt.plugins`` entry point: discover LoRA backends and patch SGLang.

SGLang calls :func:`load` in every process (launcher, ``Engine``, each scheduler/TP worker,
detokenizer) from ``sglang.srt.plugins.load_plugins()``, then applies the queued hooks. It is
idempotent, imports no XPU kernel, and registers nothing when the host fails the compatibility
check: it prints each reason to stderr instead (SGLang has not configured logging yet when plugins
run, so log records would be lost).
"""

from __future__ import annotations

import sys

from sglang_xpu_lora.registry import get_registry

_loaded = False
#: Why the last :func:`load` registered nothing (empty when it registered).
host_problems: list[str] = []


def load() -> None:
    """Register every ``sglang.lora_backends`` backend with SGLang and queue the patches."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    from sglang_xpu_lora import compat, patches

    host_problems[:] = compat.check_host()
    if host_problems:
        for problem in host_problems:
            print(f"[sglang-xpu-lora] not registering LoRA backends: {problem}", file=sys.stderr)
        return
    registry = get_registry()
    registry.load_entrypoints()
    patches.apply_all(registry)
