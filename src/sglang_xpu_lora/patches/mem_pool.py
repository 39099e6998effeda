"""Targets: sglang.srt.lora.lora_manager.LoRAManager.init_memory_pool (AROUND) and
    sglang.srt.lora.mem_pool.LoRAMemoryPool.load_lora_weight_to_buffer (AROUND)
Why: SGLang writes an adapter into a reused slot over what the previous tenant left: dense LoRA-A
    rows from ``c * r`` on and LoRA-B columns from ``r`` on keep the old values (only MoE buffers
    are zeroed). SGLang's Triton kernels never read them (they contract over each slot's rank);
    the sgl-kernel-xpu ops and the portable ops contract over the full ``max_lora_rank``, so
    without zeroed slots an adapter below ``--max-lora-rank`` gives wrong numbers and a reused slot
    leaks its previous tenant into them.
How: ``init_memory_pool`` marks the pool of a manager whose backend needs zeroed slots
    (:func:`needs_zeroed_slots`: the backend instance's ``needs_zeroed_slots``, else its spec's;
    per manager: speculative decoding may build a second manager with another backend). For a
    marked pool, loading an adapter into a slot first zeroes the whole slot (SGLang's
    ``_clear_buffer_slot_for_base``: A, B, embedding, lm_head), then lets SGLang write it in its
    own packed layout (stacked A slice ``p`` at row ``p * r``), which every provider reads
    (:mod:`sglang_xpu_lora.providers.slice_layout`). Unmarked pools are untouched. Runs on the
    loader's stream, so it also holds with ``--enable-lora-overlap-loading``. No op keeps a copy of
    pool weights (every provider reads the pool's buffers in place), so a slot emptied by SGLang
    (``remove_lora`` / ``_clear_buffer_slot_for_base``) is empty everywhere. The pool is then
    handed to a backend that asks for it (:data:`BACKEND_POOL_ATTR`), which checks
    :func:`has_zeroed_slots` before serving: if either hook did not run (``HookRegistry`` only logs
    a hook it could not apply), the backend refuses instead of computing on stale tails.
Checked against: SGLang 0.5.23 (``load_lora_weight_to_buffer`` writes
    ``target_buffer[buffer_id, : lora_rank * c, :]``, packed; the compat guard checks that anchor).
    The pool is made in ``ModelRunner.initialize`` (``maybe_init_lora_manager``), before the
    scheduler's ``alloc_memory_pool`` sizes the KV cache from the free device memory
    (``KVCacheConfigurator._profile_available_bytes``).
Remove when: SGLang zeroes a dense slot before loading an adapter into it (today only under
    ``_SGLANG_EXPERIMENTAL_LORA_OPTI``, and for B only).
"""

from __future__ import annotations

from sglang_xpu_lora.patches.undo import UndoStack, queue_hook
from sglang_xpu_lora.registry import LoRABackendRegistry
from sglang_xpu_lora.upstream import targets

#: Attribute set on a ``LoRAMemoryPool`` instance whose backend needs zeroed slots.
ZEROED_SLOTS_ATTR = "zeroes_lora_slots_on_load"
#: Stamped on a pool by the load hook, so a pool marked for zeroing whose loads bypass it is not trusted.
_LOAD_HOOK_ATTR = "_sglang_xpu_lora_load_hook_ran"
#: Attribute through which a backend asks for its manager's pool (``IntelXpuLoRABackend`` declares it).
BACKEND_POOL_ATTR = "lora_memory_pool"


def needs_zeroed_slots(registry: LoRABackendRegistry, backend: object) -> bool:
    """Whether ``backend`` needs pool slots zeroed before each load: its own ``needs_zeroed_slots``
    (``intel_xpu`` sets it from the ops it selected), else its spec's ``needs_zeroed_lora_slots``;
    False for backends that are not the registry's."""
    spec = registry.spec_for_backend(backend)
    if spec is None:
        return False
    return bool(getattr(backend, "needs_zeroed_slots", spec.needs_zeroed_lora_slots))


def has_zeroed_slots(pool) -> bool:
    """Whether ``pool`` (a ``LoRAMemoryPool``) zeroes each slot before a load: it was marked by the
    ``init_memory_pool`` hook and its loads pass through the load hook (which stamps the pool at its
    first load: the base slot's, inside ``init_memory_pool``)."""
    return bool(getattr(pool, ZEROED_SLOTS_ATTR, False) and getattr(pool, _LOAD_HOOK_ATTR, False))


def _hand_pool_to_backend(manager) -> None:
    """Give the backend its manager's pool when it asks for it (declares :data:`BACKEND_POOL_ATTR`),
    so it can refuse a pool without zeroed slots (see ``IntelXpuLoRABackend``)."""
    if hasattr(manager.lora_backend, BACKEND_POOL_ATTR):
        setattr(manager.lora_backend, BACKEND_POOL_ATTR, manager.memory_pool)


def apply(registry: LoRABackendRegistry, undo: UndoStack) -> None:
    def around_init_memory_pool(original, manager, *args, **kwargs):
        result = original(manager, *args, **kwargs)
        setattr(manager.memory_pool, ZEROED_SLOTS_ATTR, needs_zeroed_slots(registry, manager.lora_backend))
        _hand_pool_to_backend(manager)
        return result

    def around_load_lora_weight_to_buffer(original, pool, uid, buffer_id, lora_adapter, *args, **kwargs):
        setattr(pool, _LOAD_HOOK_ATTR, True)
        if uid is not None and getattr(pool, ZEROED_SLOTS_ATTR, False):
            pool._clear_buffer_slot_for_base(buffer_id)
        return original(pool, uid, buffer_id, lora_adapter, *args, **kwargs)

    queue_hook(targets.LORA_MANAGER_INIT_MEMORY_POOL, around_init_memory_pool, "AROUND", undo)
    queue_hook(targets.POOL_LOAD_WEIGHTS, around_load_lora_weight_to_buffer, "AROUND", undo)
