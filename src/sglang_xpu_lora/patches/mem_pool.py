"""Targets: sglang.srt.lora.lora_manager.LoRAManager.init_memory_pool (AROUND) and
    sglang.srt.lora.mem_pool.LoRAMemoryPool.load_lora_weight_to_buffer (AROUND)
Why: SGLang writes stacked dense LoRA-A (qkv, gate_up, ...) packed at stride ``r`` and leaves rank
    tails of reused slots stale (only MoE buffers are max-rank spaced and zeroed). Kernels that
    contract over the full ``max_lora_rank`` (sgl-kernel-xpu, the portable ops) need slice ``p`` at
    row ``p * max_lora_rank`` and zero tails, or an adapter below ``--max-lora-rank`` gives wrong
    numbers and a reused slot leaks its previous tenant.
How: ``init_memory_pool`` marks the pool of a manager whose backend needs the spaced layout
    (:func:`needs_spaced_layout`: the backend instance's ``needs_max_rank_spaced_layout``, else its
    spec's; per manager: speculative decoding may build a second manager with another backend).
    For a marked pool, loading an adapter into a slot first zeroes the whole slot (SGLang's
    ``_clear_buffer_slot_for_base``: A, B, embedding, lm_head), lets SGLang write it, then moves
    stacked A slices from row ``p * r`` to ``p * max_lora_rank``. Unmarked pools are untouched.
    Runs on the loader's stream, so it also holds with ``--enable-lora-overlap-loading``. No op
    keeps a copy of pool weights (every provider reads the pool's buffers in place), so a slot
    emptied by SGLang (``remove_lora`` / ``_clear_buffer_slot_for_base``) is empty everywhere. The
    pool is then handed to a backend that asks for it (:data:`BACKEND_POOL_ATTR`), which checks
    :func:`has_spaced_layout` before serving: if either hook did not run (``HookRegistry`` only logs
    a hook it could not apply), the backend refuses instead of computing on the packed layout.
Checked against: SGLang 0.5.23 (``load_lora_weight_to_buffer`` writes
    ``target_buffer[buffer_id, : lora_rank * c, :]``; the compat guard checks that anchor). The pool
    is made in ``ModelRunner.initialize`` (``maybe_init_lora_manager``), before the scheduler's
    ``alloc_memory_pool`` sizes the KV cache from the free device memory
    (``KVCacheConfigurator._profile_available_bytes``), so device
    memory allocated in the ``init_memory_pool`` hook is accounted for by that sizing.
Remove when: SGLang's pool has a max-rank-spaced layout option for dense modules.
"""

from __future__ import annotations

import torch

from sglang_xpu_lora.patches.undo import UndoStack, queue_hook
from sglang_xpu_lora.registry import LoRABackendRegistry
from sglang_xpu_lora.upstream import targets
from sglang_xpu_lora.upstream.compat import resolve

#: Attribute set on a ``LoRAMemoryPool`` instance whose backend needs the spaced layout.
SPACED_LAYOUT_ATTR = "uses_max_rank_spaced_lora_layout"
#: Stamped on a pool by the load hook, so a pool marked spaced whose loads bypass it is not trusted.
_RESPACING_ATTR = "_sglang_xpu_lora_loads_respaced"
#: Attribute through which a backend asks for its manager's pool (``IntelXpuLoRABackend`` declares it).
BACKEND_POOL_ATTR = "lora_memory_pool"


@torch.no_grad()
def respace_stacked_lora_a(pool, buffer_id: int, rank: int) -> None:
    """Move each stacked dense LoRA-A slice of slot ``buffer_id`` from row ``p * rank`` to
    ``p * pool.max_lora_rank``, zeroing the rows in between. A no-op at ``rank == max_lora_rank``.
    """
    max_rank = pool.max_lora_rank
    if rank >= max_rank:
        return
    get_stacked_multiply = resolve(targets.GET_STACKED_MULTIPLY)
    for name, per_layer in pool.A_buffer.items():
        if pool.is_moe_module(name):  # MoE A is already written max-rank spaced
            continue
        num_slices = get_stacked_multiply(name, pool.base_model)
        if num_slices == 1:
            continue
        for buffer in per_layer:
            slot = buffer[buffer_id]
            packed = slot[: num_slices * rank].clone()
            slot[: num_slices * rank].zero_()
            for p in range(num_slices):
                slot[p * max_rank : p * max_rank + rank].copy_(packed[p * rank : (p + 1) * rank])


def needs_spaced_layout(registry: LoRABackendRegistry, backend: object) -> bool:
    """Whether ``backend`` needs the max-rank-spaced pool: its own ``needs_max_rank_spaced_layout``
    (``intel_xpu`` sets it from the ops it selected), else its spec's; False for backends that are
    not the registry's."""
    spec = registry.spec_for_backend(backend)
    if spec is None:
        return False
    return bool(getattr(backend, "needs_max_rank_spaced_layout", spec.needs_max_rank_spaced_layout))


def has_spaced_layout(pool) -> bool:
    """Whether ``pool`` (a ``LoRAMemoryPool``) has the max-rank-spaced, zero-tailed layout: it was
    marked by the ``init_memory_pool`` hook and its loads pass through the re-spacing hook (which
    stamps the pool at its first load: the base slot's, inside ``init_memory_pool``)."""
    return bool(getattr(pool, SPACED_LAYOUT_ATTR, False) and getattr(pool, _RESPACING_ATTR, False))


def _hand_pool_to_backend(manager) -> None:
    """Give the backend its manager's pool when it asks for it (declares :data:`BACKEND_POOL_ATTR`),
    so it can refuse a pool without the layout it needs (see ``IntelXpuLoRABackend``)."""
    if hasattr(manager.lora_backend, BACKEND_POOL_ATTR):
        setattr(manager.lora_backend, BACKEND_POOL_ATTR, manager.memory_pool)


def apply(registry: LoRABackendRegistry, undo: UndoStack) -> None:
    def around_init_memory_pool(original, manager, *args, **kwargs):
        result = original(manager, *args, **kwargs)
        spaced = needs_spaced_layout(registry, manager.lora_backend)
        setattr(manager.memory_pool, SPACED_LAYOUT_ATTR, spaced)
        _hand_pool_to_backend(manager)
        return result

    def around_load_lora_weight_to_buffer(original, pool, uid, buffer_id, lora_adapter, *args, **kwargs):
        setattr(pool, _RESPACING_ATTR, True)
        if uid is None or not getattr(pool, SPACED_LAYOUT_ATTR, False):
            return original(pool, uid, buffer_id, lora_adapter, *args, **kwargs)
        pool._clear_buffer_slot_for_base(buffer_id)
        result = original(pool, uid, buffer_id, lora_adapter, *args, **kwargs)
        respace_stacked_lora_a(pool, buffer_id, lora_adapter.config.r)
        return result

    queue_hook(targets.LORA_MANAGER_INIT_MEMORY_POOL, around_init_memory_pool, "AROUND", undo)
    queue_hook(targets.POOL_LOAD_WEIGHTS, around_load_lora_weight_to_buffer, "AROUND", undo)
