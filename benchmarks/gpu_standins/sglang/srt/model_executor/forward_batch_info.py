"""Stand-in for ``sglang.srt.model_executor.forward_batch_info``: the two names SGLang's LoRA
backend modules import (a forward batch is a namespace the benchmark builds; the modes with the
predicates LoRA batch preparation asks)."""

from __future__ import annotations

import enum


class ForwardBatch:
    """Type annotations only."""


class ForwardMode(enum.IntEnum):
    EXTEND = enum.auto()
    DECODE = enum.auto()
    IDLE = enum.auto()
    TARGET_VERIFY = enum.auto()

    def is_extend(self, include_draft_extend_v2: bool = False):
        return self in (ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY)

    def is_decode(self):
        return self == ForwardMode.DECODE

    def is_idle(self):
        return self == ForwardMode.IDLE

    def is_target_verify(self):
        return self == ForwardMode.TARGET_VERIFY

    def is_draft_extend_v2(self):
        return False

    def is_cuda_graph(self):
        return self in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.IDLE)

    def is_extend_without_speculative(self):
        return self.is_extend() and not self.is_target_verify()
