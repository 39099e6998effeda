"""``sglang.srt.plugins`` entry point: discover LoRA backends and patch SGLang, whole or not at all.

SGLang calls :func:`load` in every process (launcher, ``Engine``, each scheduler/TP worker,
detokenizer) from ``sglang.srt.plugins.load_plugins()``, then applies the queued hooks. Each
process logs one line saying what the plugin registered once SGLang has configured logging
(:mod:`sglang_xpu_lora.patches.log_lines`). It imports no XPU kernel and registers nothing when the
host fails the compatibility check. When a patch fails half-way, everything already applied is
rolled back (:func:`sglang_xpu_lora.patches.apply_all`), so no backend is ever selectable without
its hooks. Either way the reasons are kept in :data:`host_problems` for ``sglang-xpu-lora doctor``,
and ``--lora-backend intel_xpu`` still parses and fails with them when SGLang resolves the server
arguments (:func:`sglang_xpu_lora.patches.apply_refusal`); where even that cannot be installed (no
``HookRegistry``, no ``--lora-backend`` choices), each reason is printed to stderr (SGLang has not
configured logging yet when plugins run, so log records would be lost). It runs once per process:
further calls are no-ops, also after a failure (SGLang applies queued hooks once, after all plugins
ran, so hooks queued by a retry would never be applied).
"""

from __future__ import annotations

import sys

from sglang_xpu_lora.registry import get_registry

_attempted = False
#: Why :func:`load` registered nothing (empty when it registered everything).
host_problems: list[str] = []


def load() -> None:
    """Register every ``sglang.lora_backends`` backend with SGLang and queue the patches, whole or
    not at all (see the module docstring)."""
    global _attempted
    if _attempted:
        return
    _attempted = True
    from sglang_xpu_lora import patches
    from sglang_xpu_lora.patches.backend_registry import sglang_backend_names
    from sglang_xpu_lora.upstream import compat

    host_problems[:] = compat.check_host()
    if not host_problems:
        registry = get_registry()
        registry.load_entrypoints(reserved=sglang_backend_names())
        try:
            patches.apply_all(registry)
        except patches.PartialApplicationError as exc:
            host_problems.append(f"could not patch SGLang: {exc}")
    if host_problems:
        _refuse(host_problems)


def _refuse(problems: list[str]) -> None:
    """Have ``--lora-backend NAME`` fail with ``problems`` for each backend that is not registered
    (every declared one, else this distribution's own); print them where even that fails."""
    from sglang_xpu_lora import patches
    from sglang_xpu_lora.backend.registration import sglang_lora_backends

    names = sorted(get_registry().specs()) or [spec.name for spec in sglang_lora_backends()]
    try:
        patches.apply_refusal(names, problems)
    except Exception:  # noqa: BLE001 - a host this broken gets today's message, never an error
        for problem in problems:
            print(f"[sglang-xpu-lora] not registering LoRA backends: {problem}", file=sys.stderr)
