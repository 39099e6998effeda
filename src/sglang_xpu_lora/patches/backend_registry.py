"""Target: sglang.srt.lora.backend.lora_registry.LORA_SUPPORTED_BACKENDS (via register_lora_backend)
Why: make every backend declared through ``sglang.lora_backends`` resolvable by
    ``get_backend_from_name(name)``, which ``LoRAManager.__init__`` calls.
How: SGLang's own ``register_lora_backend(name)`` decorator, with a lazy factory. No function is
    replaced: ``lora_manager`` binds ``get_backend_from_name`` by name, so patching it would miss.
Checked against: SGLang 0.5.23.
Remove when: never (this is SGLang's registration API).
"""

from __future__ import annotations

from sglang_xpu_lora.patches.cli_choices import lora_backend_choices
from sglang_xpu_lora.patches.undo import UndoStack
from sglang_xpu_lora.registry import LoRABackendRegistry
from sglang_xpu_lora.upstream import targets
from sglang_xpu_lora.upstream.compat import resolve


def sglang_backend_names() -> set[str]:
    """Every ``--lora-backend`` name the host already has before this plugin registers anything:
    SGLang's backend registry (``triton``, ``csgmv``, ``torch_native``, ``ascend``, ...: whatever
    this SGLang version ships, plus names other plugins registered directly) and its CLI choices."""
    return set(resolve(targets.LORA_BACKEND_REGISTRY)) | set(lora_backend_choices())


def apply(registry: LoRABackendRegistry, undo: UndoStack) -> None:
    register_lora_backend = resolve(targets.REGISTER_LORA_BACKEND)
    backends = resolve(targets.LORA_BACKEND_REGISTRY)
    for name in registry.specs():
        if name in backends:  # the registry refused plugins declaring such names; this catches later ones
            raise ValueError(f"SGLang already has a LoRA backend named {name!r}; not replacing it")
        factory = register_lora_backend(name)(lambda name=name: registry.resolve_class(name))
        undo.push(f"LoRA backend {name!r}", lambda name=name, factory=factory: _unregister(backends, name, factory))


def _unregister(backends: dict, name: str, factory) -> None:
    if backends.get(name) is factory:
        del backends[name]
