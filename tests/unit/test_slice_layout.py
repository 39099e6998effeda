"""The gather between a shrink over SGLang's packed pool and the multi-slice expands that read slice
``p`` at ``p * max_rank`` (:mod:`sglang_xpu_lora.providers.slice_layout`), against a plain loop."""

from __future__ import annotations

import random

import pytest
import torch
from test_torch_ops import random_batch, segments
from test_torch_ops_routing import HostSyncDetector

from sglang_xpu_lora.providers import slice_layout


def spaced_reference(packed, ranks, slot_of_row, num_slices, max_rank):
    """Row by row: slice ``p`` of a rank-``r`` row from packed column ``p * r`` to ``p * max_rank``."""
    out = torch.zeros_like(packed)
    for row, slot in enumerate(slot_of_row):
        if slot is None:
            continue
        rank = ranks[slot]
        for p in range(num_slices):
            out[row, p * max_rank : p * max_rank + rank] = packed[row, p * rank : (p + 1) * rank]
    return out


@pytest.mark.parametrize("num_slices", [2, 3, 4])
@pytest.mark.parametrize("permuted", [False, True], ids=["contiguous", "permuted"])
@pytest.mark.parametrize("seed", range(6))
def test_slices_move_to_max_rank_with_zero_tails(seed, permuted, num_slices):
    """Ranks 0, below and at max_rank; empty segments; rows in no segment (contiguous batches). The
    packed input is what a shrink over a zeroed packed slot gives: zero from ``S * r`` on."""
    rng = random.Random(seed)
    num_slots, max_rank = 4, 8
    ranks = [0, max_rank, rng.randint(1, max_rank - 1), rng.randint(1, max_rank - 1)]
    num_rows, seg_indptr, weight_indices, permutation = random_batch(rng, num_slots, permuted)
    slot_of_row = [None] * num_rows
    for slot, rows in segments(seg_indptr, weight_indices, permutation, num_rows):
        for row in rows:
            slot_of_row[row] = slot
    packed = torch.randn(num_rows, num_slices * max_rank, dtype=torch.float64)
    for row, slot in enumerate(slot_of_row):
        packed[row, 0 if slot is None else num_slices * ranks[slot] :] = 0
    index = slice_layout.spacing_index(
        seg_indptr, weight_indices, torch.tensor(ranks, dtype=torch.int32), num_rows, num_slices, max_rank, permutation
    )
    out = slice_layout.spaced_slices(packed, index)
    assert index.dtype == torch.int64 and out.shape == packed.shape
    assert torch.equal(out, spaced_reference(packed, ranks, slot_of_row, num_slices, max_rank))


def test_a_full_rank_batch_is_unchanged():
    """At rank = max_rank both layouts coincide: the gather is the identity."""
    packed = torch.randn(5, 3 * 4)
    index = slice_layout.spacing_index(
        torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([1, 0], dtype=torch.int32),
        torch.tensor([4, 4], dtype=torch.int32), 5, 3, 4,
    )
    assert torch.equal(slice_layout.spaced_slices(packed, index), packed)


def test_index_is_free_of_host_syncs_and_data_dependent_shapes():
    """On "meta" tensors (an accelerator stand-in without data), any host read would fail or show:
    the index and the gather can be captured in a CUDA/XPU graph."""
    meta = dict(
        seg_indptr=torch.zeros(3, dtype=torch.int32, device="meta"),
        weight_indices=torch.zeros(2, dtype=torch.int32, device="meta"),
        lora_ranks=torch.zeros(4, dtype=torch.int32, device="meta"),
    )
    permutation = torch.zeros(64, dtype=torch.int32, device="meta")
    with HostSyncDetector() as detector:
        index = slice_layout.spacing_index(**meta, num_rows=64, num_slices=3, max_rank=16, permutation=permutation)
        out = slice_layout.spaced_slices(torch.empty(64, 48, device="meta"), index)
    assert detector.offenders == [] and out.shape == (64, 48)
