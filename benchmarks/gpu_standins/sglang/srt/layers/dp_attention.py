"""Stand-in for ``sglang.srt.layers.dp_attention``: the names ``triton_backend`` imports, for DP
attention only, which the benchmarks never run."""

import enum


class DpPaddingMode(enum.IntEnum):
    SUM_LEN = enum.auto()


def dp_gather_replicate(*args, **kwargs):
    raise NotImplementedError("DP attention is not part of the benchmarks")


dp_slot_in = dp_gather_replicate
