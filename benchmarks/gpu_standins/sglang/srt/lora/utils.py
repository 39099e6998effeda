"""Stand-in for ``sglang.srt.lora.utils``: only the batch-info record the Triton LoRA ops read."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch


@dataclasses.dataclass
class LoRABatchInfo:
    use_cuda_graph: bool
    bs: int
    num_segments: int
    seg_indptr: torch.Tensor
    weight_indices: torch.Tensor
    lora_ranks: torch.Tensor
    scalings: torch.Tensor
    max_len: Optional[int]
    seg_lens: Optional[torch.Tensor] = None
    permutation: Optional[torch.Tensor] = None
