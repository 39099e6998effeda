"""The patch ledger: every change sglang-xpu-lora makes to SGLang, applied in this order.

=====================  ==========================================================================
module                 SGLang symbol, why, and when to remove (details in each module's header)
=====================  ==========================================================================
backend_registry       ``lora_registry.LORA_SUPPORTED_BACKENDS`` via ``register_lora_backend``:
                       make plugin backends resolvable. SGLang's API; permanent.
cli_choices            ``ServerArgs`` ``lora_backend`` ``Arg.choices``: let argparse accept plugin
                       backends. Remove when SGLang derives choices from the registry.
validation             ``arg_groups.lora_hook.check_lora_server_args`` (AFTER): device check
                       naming ``--lora-backend`` and ``--device``. Remove when backends can
                       validate their own arguments.
mem_pool               ``LoRAManager.init_memory_pool`` and
                       ``LoRAMemoryPool.load_lora_weight_to_buffer`` (AROUND): max-rank-spaced,
                       zeroed slots for backends that declare it. Remove when SGLang offers the
                       layout.
adapter_checks         ``check_lora_server_args`` (AFTER), ``LoRAManager.validate_new_adapter`` and
                       ``_load_lora_adapter[_from_tensors]`` (AROUND),
                       ``LoRAAdapter._normalize_weights`` (BEFORE): every ``adapter_config.json`` field honoured
                       (rsLoRA, alpha/rank patterns, regex targets, partial q/k/v) or refused at
                       load, tensors finite and shaped for the model, nothing left after a failed
                       load; for plugin backends (all with ``SGLANG_XPU_LORA_ADAPTER_CHECKS=all``).
                       Remove when SGLang honours every ``LoraConfig`` field itself.
=====================  ==========================================================================

Not patched, on purpose: graph batch-info sizing. SGLang 0.5.23's ``PrefillCudaGraphRunner`` already
passes ``max_num_requests=`` to ``init_prefill_cuda_graph_batch_info``, which the backend inherits
from ``TritonLoRABackend``; the compat guard checks that call site, so a host without it is
reported instead of silently mis-sized.

Hooks go through ``sglang.srt.plugins.hook_registry.HookRegistry``; ``load_plugins()`` applies them
after every general plugin ran.
"""

from __future__ import annotations

from sglang_xpu_lora.patches import adapter_checks, backend_registry, cli_choices, mem_pool, validation
from sglang_xpu_lora.registry import LoRABackendRegistry

PATCHES = (backend_registry, cli_choices, validation, mem_pool, adapter_checks)


def apply_all(registry: LoRABackendRegistry) -> None:
    """Register every plugin backend with SGLang and queue the hooks (see the ledger above)."""
    for patch in PATCHES:
        patch.apply(registry)
