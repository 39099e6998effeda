"""Test-only: write what each TP rank's LoRA memory pool holds, so a test can check each rank's slice.

With ``SGLANG_CPU_DEVSUPPORT_POOL_SNAPSHOT=<directory>`` set, SGLang's plugin loading registers an
AFTER hook on ``LoRAMemoryPool.prepare_lora_batch`` (it runs once the batch's adapters are in their
slots, after every hook on the per-slot load, the pool patch included). Whenever the slots' tenants
changed, the rank writes ``<directory>/rank<tp rank>.safetensors`` (replacing the previous one)
holding, for every resident adapter, its slot of every buffer, keyed by the adapter directory's name:

- ``<adapter>/<module>/<layer>/A`` and ``.../B`` for the per-layer modules (``qkv_proj``,
  ``gate_up_proj``, ``o_proj``, ``down_proj``): the slot as stored, ``(slices * max_lora_rank,
  in features of this rank)`` and ``(out features of this rank, max_lora_rank)``;
- ``<adapter>/embed_tokens/A|B`` and ``<adapter>/lm_head/A|B`` for the embedding and lm_head buffers.

Unset, nothing is registered.
"""

from __future__ import annotations

import os
from pathlib import Path

SNAPSHOT_ENV = "SGLANG_CPU_DEVSUPPORT_POOL_SNAPSHOT"
TARGET = "sglang.srt.lora.mem_pool.LoRAMemoryPool.prepare_lora_batch"


def slot_tensors(pool, name: str, buffer_id: int) -> dict:
    """Slot ``buffer_id`` of every buffer of ``pool`` (SGLang's ``LoRAMemoryPool``), keyed as in the
    module docstring under ``name``; contiguous CPU copies."""
    tensors = {}
    for kind, buffers in (("A", pool.A_buffer), ("B", pool.B_buffer)):
        for module, per_layer in buffers.items():
            for layer, buffer in enumerate(per_layer):
                tensors[f"{name}/{module}/{layer}/{kind}"] = buffer[buffer_id]
    # SGLang fills each of these dicts for both modules; only embed_tokens' embedding buffers and
    # lm_head's lm_head buffers are used.
    for module, kind, buffers in (
        ("embed_tokens", "A", pool.embedding_A_buffer), ("embed_tokens", "B", pool.embedding_B_buffer),
        ("lm_head", "A", pool.lm_head_A_buffer), ("lm_head", "B", pool.lm_head_B_buffer),
    ):
        if module in buffers:
            tensors[f"{name}/{module}/{kind}"] = buffers[module][buffer_id]
    return {key: tensor.detach().to("cpu").contiguous().clone() for key, tensor in tensors.items()}


def register_from_env() -> None:
    """``sglang.srt.plugins`` entry point: register the hook when the environment asks for it."""
    directory = os.environ.get(SNAPSHOT_ENV)
    if not directory:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def after_prepare(result, pool, cur_uids, lora_adapters, *args, **kwargs):
        from safetensors.torch import save_file
        from sglang.srt.runtime_context import get_parallel

        tenants = {
            buffer_id: Path(lora_adapters[uid].config.path).name
            for buffer_id, uid in enumerate(pool.buffer_id_to_uid)
            if isinstance(uid, str) and uid in lora_adapters
        }
        if tenants == getattr(pool, "_devsupport_snapshot_tenants", None):
            return None
        tensors = {}
        for buffer_id, name in tenants.items():
            tensors.update(slot_tensors(pool, name, buffer_id))
        path = Path(directory) / f"rank{get_parallel().tp_rank}.safetensors"
        save_file(tensors, str(path.with_suffix(".tmp")))
        path.with_suffix(".tmp").replace(path)
        pool._devsupport_snapshot_tenants = tenants
        return None

    HookRegistry.register(TARGET, after_prepare, HookType.AFTER)
