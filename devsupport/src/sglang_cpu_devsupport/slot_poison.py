"""Test-only: put NaN into the LoRA memory-pool slot of one adapter, in every SGLang process.

sglang-xpu-lora refuses adapters with non-finite tensors at load, so an adapter file can no longer
carry NaN into the pool. The isolation tests still need a slot that holds NaN (what a lower-precision
overflow or a corrupted copy would leave there) to show that no other request reads it. With
``SGLANG_CPU_DEVSUPPORT_NAN_ADAPTER=<adapter directory>`` set, SGLang's plugin loading registers a
BEFORE hook on ``LoRAMemoryPool.load_lora_weight_to_buffer``: when the adapter loaded into a slot
comes from that directory, its layer-0 ``q_proj`` LoRA-B (SGLang's stacked ``qkv_proj`` B) is set
to NaN in host memory just before SGLang copies it into the slot, after every load-time check.
With ``SGLANG_CPU_DEVSUPPORT_NAN_RANK=<r>`` also set, only TP rank ``r`` poisons its slot (its slice
of the tensor), so under tensor parallelism the NaN starts on one rank and reaches the others only
through the collectives. Unset, nothing is registered.
"""

from __future__ import annotations

import os
from pathlib import Path

NAN_ADAPTER_ENV = "SGLANG_CPU_DEVSUPPORT_NAN_ADAPTER"
NAN_RANK_ENV = "SGLANG_CPU_DEVSUPPORT_NAN_RANK"
TARGET = "sglang.srt.lora.mem_pool.LoRAMemoryPool.load_lora_weight_to_buffer"


def poison_layer0_q_lora_b(lora_adapter) -> int:
    """Fill the layer-0 q_proj (or stacked qkv_proj) LoRA-B tensors of ``lora_adapter`` (SGLang's
    ``LoRAAdapter``) with NaN, in place. Returns how many tensors were filled."""
    filled = 0
    for name, tensor in lora_adapter.layers[0].weights.items():
        if "lora_B" in name and ("q_proj" in name or "qkv_proj" in name):
            tensor.fill_(float("nan"))
            filled += 1
    return filled


def register_from_env() -> None:
    """``sglang.srt.plugins`` entry point: register the hook when the environment asks for it."""
    target_dir = os.environ.get(NAN_ADAPTER_ENV)
    if not target_dir:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    target = Path(target_dir).resolve()
    only_rank = os.environ.get(NAN_RANK_ENV)

    def on_poisoned_rank() -> bool:
        if only_rank is None:
            return True
        from sglang.srt.runtime_context import get_parallel

        return get_parallel().tp_rank == int(only_rank)

    def before_load(pool, uid, buffer_id, lora_adapter, *args, **kwargs):
        path = getattr(getattr(lora_adapter, "config", None), "path", None)
        if path is not None and Path(path).resolve() == target and on_poisoned_rank():
            if not poison_layer0_q_lora_b(lora_adapter):
                raise RuntimeError(f"{NAN_ADAPTER_ENV}: no layer-0 q_proj LoRA-B in the adapter at {path}")
        return None

    HookRegistry.register(TARGET, before_load, HookType.BEFORE)
