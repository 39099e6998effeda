"""Targets: sglang.srt.lora.lora_manager.LoRAManager.init_memory_pool (AROUND) and
    sglang.srt.lora.mem_pool.LoRAMemoryPool.load_lora_weight_to_buffer (AROUND)
Why: SGLang writes stacked dense LoRA-A (qkv, gate_up, ...) packed at stride ``r`` and leaves rank
    tails of reused slots stale (only MoE buffers are max-rank spaced and zeroed). Kernels that
    contract over the full ``max_lora_rank`` (sgl-kernel-xpu, the portable ops) need slice ``p`` at
    row ``p * max_lora_rank`` and zero tails, or an adapter below ``--max-lora-rank`` gives wrong
    numbers and a reused slot leaks its previous tenant.
How: ``init_memory_pool`` marks the pool of a manager whose backend's spec declares
    ``needs_max_rank_spaced_layout`` (per manager: speculative decoding may build a second manager
    with another backend). For a marked pool, loading an adapter into a slot first zeroes the whole
    slot (SGLang's ``_clear_buffer_slot_for_base``: A, B, embedding, lm_head), lets SGLang write it,
    then moves stacked A slices from row ``p * r`` to ``p * max_lora_rank``. Unmarked pools are
    untouched. Runs on the loader's stream, so it also holds with ``--enable-lora-overlap-loading``.
    No op keeps a copy of pool weights (the portable ops read the pool's buffers in place), so a
    slot emptied by SGLang (``remove_lora`` / ``_clear_buffer_slot_for_base``) is empty everywhere.
Checked against: SGLang 0.5.23 (``load_lora_weight_to_buffer`` writes
    ``target_buffer[buffer_id, : lora_rank * c, :]``; the compat guard checks that anchor). The pool
    is made in ``ModelRunner.initialize`` (``maybe_init_lora_manager``, model_runner.py l.733),
    before the scheduler's ``alloc_memory_pool`` sizes the KV cache from the free device memory
    (``KVCacheConfigurator._profile_available_bytes``, kv_cache_configurator.py l.2990), so device
    memory allocated in the ``init_memory_pool`` hook is accounted for by that sizing.
Remove when: SGLang's pool has a max-rank-spaced layout option for dense modules.
"""

from __future__ import annotations

import torch

from sglang_xpu_lora.compat import resolve
from sglang_xpu_lora.patches import targets
from sglang_xpu_lora.registry import LoRABackendRegistry

#: Attribute set on a ``LoRAMemoryPool`` instance whose backend needs the spaced layout.
SPACED_LAYOUT_ATTR = "uses_max_rank_spaced_lora_layout"


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


def apply(registry: LoRABackendRegistry) -> None:
    hook_registry, hook_type = resolve(targets.HOOK_REGISTRY), resolve(targets.HOOK_TYPE)

    def around_init_memory_pool(original, manager, *args, **kwargs):
        result = original(manager, *args, **kwargs)
        spec = registry.spec_for_backend(manager.lora_backend)
        spaced = bool(spec and spec.needs_max_rank_spaced_layout)
        setattr(manager.memory_pool, SPACED_LAYOUT_ATTR, spaced)
        return result

    def around_load_lora_weight_to_buffer(original, pool, uid, buffer_id, lora_adapter, *args, **kwargs):
        if uid is None or not getattr(pool, SPACED_LAYOUT_ATTR, False):
            return original(pool, uid, buffer_id, lora_adapter, *args, **kwargs)
        pool._clear_buffer_slot_for_base(buffer_id)
        result = original(pool, uid, buffer_id, lora_adapter, *args, **kwargs)
        respace_stacked_lora_a(pool, buffer_id, lora_adapter.config.r)
        return result

    hook_registry.register(targets.LORA_MANAGER_INIT_MEMORY_POOL, around_init_memory_pool, hook_type.AROUND)
    hook_registry.register(targets.POOL_LOAD_WEIGHTS, around_load_lora_weight_to_buffer, hook_type.AROUND)
