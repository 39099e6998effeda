"""Targets: sglang.srt.lora.lora_manager.LoRAManager.init_memory_pool (AROUND) and
    sglang.srt.lora.mem_pool.LoRAMemoryPool.load_lora_weight_to_buffer (AROUND)
Why: SGLang writes an adapter into a reused slot over what the previous tenant left: dense LoRA-A
    rows from ``c * r`` on and LoRA-B columns from ``r`` on keep the old values (only MoE buffers
    are zeroed). SGLang's Triton kernels never read them (they contract over each slot's rank);
    the sgl-kernel-xpu ops and the portable ops contract over the full ``max_lora_rank``, so
    without zeroed slots an adapter below ``--max-lora-rank`` gives wrong numbers and a reused slot
    leaks its previous tenant into them.
How: ``init_memory_pool`` marks the pool of a manager whose backend needs zeroed slots (its
    spec's ``needs_zeroed_lora_slots``, :meth:`LoRABackendSpec.zeroed_slots_needed`, asked of the
    backend instance; per manager: speculative decoding may build a second manager with another
    backend). For a marked pool, loading an adapter into a slot first zeroes the whole slot (SGLang's
    ``_clear_buffer_slot_for_base``: A, B, embedding, lm_head), then lets SGLang write it in its
    own packed layout (stacked A slice ``p`` at row ``p * r``), which every provider reads
    (:mod:`sglang_xpu_lora.providers.slice_layout`). Unmarked pools are untouched. Runs on the
    loader's stream, so it also holds with ``--enable-lora-overlap-loading``. No op keeps a copy of
    pool weights (every provider reads the pool's buffers in place), so a slot emptied by SGLang
    (``remove_lora`` / ``_clear_buffer_slot_for_base``) is empty everywhere. The pool is then
    handed to a backend whose spec asks for it (``receives_memory_pool``), which calls
    :func:`require_zeroed_slots` before serving: if either hook did not run (``HookRegistry`` only
    logs a hook it could not apply), the backend refuses instead of computing on stale tails. The
    patch's whole state on a pool is one :class:`SlotZeroing` record (:data:`RECORD_ATTR`).
Checked against: SGLang 0.5.23 (``load_lora_weight_to_buffer`` writes
    ``target_buffer[buffer_id, : lora_rank * c, :]``, packed; the compat guard checks that anchor).
    The pool is made in ``ModelRunner.initialize`` (``maybe_init_lora_manager``), before the
    scheduler's ``alloc_memory_pool`` sizes the KV cache from the free device memory
    (``KVCacheConfigurator._profile_available_bytes``).
Remove when: SGLang zeroes a dense slot before loading an adapter into it (today only under
    ``_SGLANG_EXPERIMENTAL_LORA_OPTI``, and for B only).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from sglang_xpu_lora.patches.undo import UndoStack, queue_hook
from sglang_xpu_lora.registry import LoRABackendRegistry
from sglang_xpu_lora.upstream import targets

#: The one attribute the patch sets on a ``LoRAMemoryPool``: its :class:`SlotZeroing` record.
RECORD_ATTR = "_sglang_xpu_lora_slot_zeroing"


@dataclasses.dataclass
class SlotZeroing:
    """The pool patch's record on one ``LoRAMemoryPool``.

    ``requested``: set by the ``init_memory_pool`` hook, whether the pool's backend needs each slot
    zeroed before a load; ``load_hook_ran``: set by the load hook at the pool's first load (the
    base slot's, inside ``init_memory_pool``), so a pool whose loads bypass the hook is not trusted.
    """

    requested: bool = False
    load_hook_ran: bool = False

    @classmethod
    def of(cls, pool) -> "SlotZeroing":
        """``pool``'s record, made (empty) at the first ask."""
        record: Optional[SlotZeroing] = getattr(pool, RECORD_ATTR, None)
        if record is None:
            record = cls()
            setattr(pool, RECORD_ATTR, record)
        return record


def has_zeroed_slots(pool) -> bool:
    """Whether ``pool`` (a ``LoRAMemoryPool``, or None) zeroes each slot before a load: it was
    marked by the ``init_memory_pool`` hook and its loads pass through the load hook."""
    record = getattr(pool, RECORD_ATTR, None)
    return record is not None and record.requested and record.load_hook_ran


def require_zeroed_slots(pool, backend_name: str) -> None:
    """Refuse to serve ``--lora-backend backend_name``, whose ops contract over the full
    ``max_lora_rank``, on ``pool`` (its manager's ``LoRAMemoryPool``, None when the pool hook did
    not hand it over) unless the pool zeroes each slot before a load (:func:`has_zeroed_slots`):
    proof from both hooks, since SGLang's ``HookRegistry`` logs a hook it cannot apply and
    carries on, and nothing else stands between a missing hook and wrong numbers.

    Raises:
        RuntimeError: naming what is missing and how to find out why.
    """
    if has_zeroed_slots(pool):
        return
    if pool is None:
        why = "the plugin's hook on LoRAManager.init_memory_pool did not run, so the pool is unknown"
    else:
        why = "the pool's loads are not zeroing its slots (the plugin's pool hooks did not both run)"
    raise RuntimeError(
        f"--lora-backend {backend_name} refuses to serve: its LoRA ops contract over --max-lora-rank "
        "and need every memory-pool slot zeroed before an adapter is loaded into it (zero rank "
        f"tails, nothing left of a previous tenant), but {why}. Run `sglang-xpu-lora doctor`, "
        "and look in the server log for "
        "'Failed to apply hooks' or '[sglang-xpu-lora]' lines."
    )


def apply(registry: LoRABackendRegistry, undo: UndoStack) -> None:
    def around_init_memory_pool(original, manager, *args, **kwargs):
        result = original(manager, *args, **kwargs)
        backend, pool = manager.lora_backend, manager.memory_pool
        spec = registry.spec_for_backend(backend)  # None for SGLang's own backends
        SlotZeroing.of(pool).requested = spec is not None and spec.zeroed_slots_needed(backend)
        if spec is not None and spec.receives_memory_pool is not None:
            spec.receives_memory_pool(backend, pool)
        return result

    def around_load_lora_weight_to_buffer(original, pool, uid, buffer_id, lora_adapter, *args, **kwargs):
        record = SlotZeroing.of(pool)
        record.load_hook_ran = True
        if uid is not None and record.requested:
            pool._clear_buffer_slot_for_base(buffer_id)
        return original(pool, uid, buffer_id, lora_adapter, *args, **kwargs)

    queue_hook(targets.LORA_MANAGER_INIT_MEMORY_POOL, around_init_memory_pool, "AROUND", undo)
    queue_hook(targets.POOL_LOAD_WEIGHTS, around_load_lora_weight_to_buffer, "AROUND", undo)
