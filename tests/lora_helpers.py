"""Shared test helpers: LoRA weights in the pool's layout and an independent float64 reference."""

from __future__ import annotations

import itertools
from typing import Optional, Sequence

import torch


def pool_weights(ranks: Sequence[int], num_slices: int, out_dims: Sequence[int], max_rank: int, hidden: int, seed: int = 0):
    """Random ``A (L, num_slices * max_rank, hidden)`` and ``B (L, sum(out_dims), max_rank)`` as the
    pool holds them: SGLang's packed layout (slice ``p`` of a rank-``r`` slot at rows ``p * r``),
    zeroed from row ``num_slices * r`` (A) and column ``r`` (B) on, as the pool patch leaves a slot."""
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(len(ranks), num_slices * max_rank, hidden, generator=generator)
    b = torch.randn(len(ranks), sum(out_dims), max_rank, generator=generator)
    for slot, rank in enumerate(ranks):
        a[slot, num_slices * rank :] = 0
        b[slot, :, rank:] = 0
    return a, b


def lora_reference(x, a, b, out_dims, slot_of_row, scalings, ranks, base: Optional[torch.Tensor] = None):
    """float64 per-row loop over the packed pool: ``base + scaling * B_p (A_p x)`` for each slice
    ``p``, with ``A_p`` the rows ``[p * r, (p + 1) * r)`` of a rank-``r`` slot and ``B_p`` its first
    ``r`` columns of band ``p``."""
    bounds = [0, *itertools.accumulate(out_dims)]
    out = torch.zeros(x.shape[0], bounds[-1], dtype=torch.float64) if base is None else base.double().clone()
    for row, slot in enumerate(slot_of_row):
        rank = ranks[slot]
        for p in range(len(out_dims)):
            shrink = a[slot, p * rank : (p + 1) * rank].double() @ x[row].double()
            band = b[slot, bounds[p] : bounds[p + 1], :rank].double()
            out[row, bounds[p] : bounds[p + 1]] += scalings[slot] * (band @ shrink)
    return out


def forward_batch(mode: str, batch_size: int, lens: Optional[Sequence[int]] = None, draft: Optional[int] = None):
    """The fields of SGLang's ``ForwardBatch`` that LoRA batch preparation reads, for ``mode``
    (a ``ForwardMode`` name); ``lens`` are extend lengths, ``draft`` the TARGET_VERIFY width."""
    import types

    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    fb = types.SimpleNamespace(
        forward_mode=getattr(ForwardMode, mode), batch_size=batch_size, return_logprob=False,
        spec_info=types.SimpleNamespace(draft_token_num=draft) if draft else None,
        extend_seq_lens_cpu=None, extend_seq_lens=None, extend_num_tokens=None,
    )
    if lens is not None:
        fb.extend_seq_lens_cpu, fb.extend_num_tokens = list(lens), sum(lens)
        fb.extend_seq_lens = torch.tensor(lens, dtype=torch.int32)
    return fb
