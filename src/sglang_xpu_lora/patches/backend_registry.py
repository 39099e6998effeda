"""Target: sglang.srt.lora.backend.lora_registry.LORA_SUPPORTED_BACKENDS (via register_lora_backend)
Why: make every backend declared through ``sglang.lora_backends`` resolvable by
    ``get_backend_from_name(name)``, which ``LoRAManager.__init__`` calls.
How: SGLang's own ``register_lora_backend(name)`` decorator, with a lazy factory. No function is
    replaced: ``lora_manager`` binds ``get_backend_from_name`` by name, so patching it would miss.
Checked against: SGLang 0.5.23.
Remove when: never (this is SGLang's registration API).
"""

from __future__ import annotations

from sglang_xpu_lora.compat import resolve
from sglang_xpu_lora.patches import targets
from sglang_xpu_lora.registry import LoRABackendRegistry


def apply(registry: LoRABackendRegistry) -> None:
    register_lora_backend = resolve(targets.REGISTER_LORA_BACKEND)
    for name in registry.specs():
        register_lora_backend(name)(lambda name=name: registry.resolve_class(name))
