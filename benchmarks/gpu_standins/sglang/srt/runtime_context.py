"""Stand-in for ``sglang.srt.runtime_context``: the LoRA batch layout and the per-forward flags the
LoRA backends read (one DP-local section, no DP attention), and ``get_lora`` (16-token chunks)."""

import enum
import types


class LoRABatchLayout(enum.Enum):
    DP_LOCAL = enum.auto()
    TP_GLOBAL = enum.auto()


_FORWARD = types.SimpleNamespace(lora_batch_layout=LoRABatchLayout.DP_LOCAL)
_PARALLEL = types.SimpleNamespace(enable_dp_lm_head=False)
_LORA = types.SimpleNamespace(max_lora_chunk_size=16)


def get_forward():
    return _FORWARD


def get_parallel():
    return _PARALLEL


def get_lora():
    return _LORA
