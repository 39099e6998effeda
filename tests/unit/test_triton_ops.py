"""The Triton provider: SGLang's own Triton LoRA kernels, run by Triton's interpreter on CPU tensors
(``TRITON_INTERPRET=1``, tests/conftest.py), against the float64 per-segment reference of
test_torch_ops.py, on both pool layouts the backend can have:

* max-rank spaced (the plugin's pool: slice ``p`` at row ``p * R``, zero rank tails), ranks padded
  to ``R`` for every active slot (:func:`triton_ops.pad_lora_ranks`);
* packed (SGLang's pool: slice ``p`` at row ``p * r``, stale tails), the real ranks.

Each test calls the ops as ``IntelXpuLoRABackend`` routes a layer: a contiguous batch (extend,
TARGET_VERIFY) through ``sgemm_lora_a_fwd`` and the B op of the layer (one slice, q/k/v, equal
gate/up, or the chunked expand for 2 unequal and 4 slices), a permuted batch (decode) through the
chunked shrink and expand. Batches have empty segments, slots of rank 0, below and at ``R``, and
(contiguous) rows in no segment. Tolerances as test_torch_ops.py (relative to the reference's
largest magnitude; the kernels accumulate in fp32 and round the shrink's output once).

fp32 and fp16 only: Triton's interpreter does not support bfloat16 arithmetic (it multiplies the raw
bit patterns in ``tl.dot``: triton-lang/triton#11584, and the interpreter's documentation), so the
bf16 path is compared on a GPU by ``benchmarks/ops.py`` (``intel_xpu`` against ``triton``).
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from test_torch_ops import assert_close, random_batch, ref_embedding, ref_expand, ref_shrink

from sglang_xpu_lora.providers import triton_ops

MAX_RANK, HIDDEN, NUM_SLOTS = 8, 24, 3
DTYPES = [torch.float32, torch.float16]  # no bfloat16 in Triton's interpreter (module docstring)
LAYOUTS = ("spaced", "packed")
#: (B op the backend calls, band widths), per batch kind.
CONTIGUOUS_PATHS = [
    ("sgemm_lora_b_fwd", (20,)),
    ("qkv_lora_b_fwd", (16, 8, 8)),
    ("gate_up_lora_b_fwd", (12, 12)),
    ("chunked_sgmv_lora_expand_fwd", (12, 6)),  # DeepSeek MLA fused_qkv_a: 2 unequal bands
    ("chunked_sgmv_lora_expand_fwd", (4, 4, 6, 2)),  # GDN in_proj_qkvz: 4 bands
]
PERMUTED_BANDS = [(20,), (12, 12), (16, 8, 8), (4, 4, 6, 2)]


@pytest.fixture(autouse=True)
def interpreter():
    import triton

    assert triton.knobs.runtime.interpret, "TRITON_INTERPRET=1 must be set before SGLang's kernels are imported"


def kernel_batch_info(seg_indptr, weight_indices, kernel_ranks, scalings, permutation):
    """The batch info SGLang's Triton backend builds (``bs`` segments, ``max_len`` the longest)."""
    from sglang.srt.lora.utils import LoRABatchInfo

    seg_lens = seg_indptr[1:] - seg_indptr[:-1]
    return LoRABatchInfo(
        use_cuda_graph=False, bs=len(weight_indices), num_segments=len(weight_indices), seg_indptr=seg_indptr,
        weight_indices=weight_indices, lora_ranks=kernel_ranks, scalings=scalings,
        max_len=max(1, int(seg_lens.max())), seg_lens=seg_lens, permutation=permutation,
    )


def pool_weights(rng, ranks, bands, layout, dtype):
    """Stacked ``A (L, n * R, K)`` and ``B (L, N, R)`` in ``layout``, and the spaced equivalent the
    reference reads (zero tails). Packed tails hold stale values, as a reused SGLang slot does."""
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    n, total = len(bands), sum(bands)
    a_spaced = torch.zeros(NUM_SLOTS, n * MAX_RANK, HIDDEN)
    b_spaced = torch.zeros(NUM_SLOTS, total, MAX_RANK)
    a = torch.randn(NUM_SLOTS, n * MAX_RANK, HIDDEN, generator=gen) if layout == "packed" else a_spaced.clone()
    b = torch.randn(NUM_SLOTS, total, MAX_RANK, generator=gen) if layout == "packed" else b_spaced.clone()
    for slot, rank in enumerate(ranks):
        for p in range(n):
            slice_a = torch.randn(rank, HIDDEN, generator=gen)
            a_spaced[slot, p * MAX_RANK : p * MAX_RANK + rank] = slice_a
            start = p * (rank if layout == "packed" else MAX_RANK)
            a[slot, start : start + rank] = slice_a
        b_spaced[slot, :, :rank] = b[slot, :, :rank] = torch.randn(total, rank, generator=gen)
    return a.to(dtype), b.to(dtype), a_spaced.to(dtype), b_spaced.to(dtype)


def setup(seed, dtype, bands, layout, permuted):
    rng = random.Random(seed)
    ranks = [0, rng.randint(1, MAX_RANK - 1), MAX_RANK]
    rng.shuffle(ranks)
    num_rows, seg_indptr, weight_indices, permutation = random_batch(rng, NUM_SLOTS, permuted)
    real = torch.tensor(ranks, dtype=torch.int32)
    kernel_ranks = triton_ops.pad_lora_ranks(real, MAX_RANK) if layout == "spaced" else real
    scalings = torch.tensor([rng.uniform(0.25, 2.0) for _ in range(NUM_SLOTS)])
    a, b, a_spaced, b_spaced = pool_weights(rng, ranks, bands, layout, dtype)
    x = torch.randn(num_rows, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(dtype)
    base = torch.randn(num_rows, sum(bands), generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    meta = dict(seg_indptr=seg_indptr, weight_indices=weight_indices, lora_ranks=real)
    info = kernel_batch_info(seg_indptr, weight_indices, kernel_ranks, scalings, permutation)
    offsets = torch.tensor([0, *itertools.accumulate(bands)], dtype=torch.int32)
    expected = ref_expand(
        ref_shrink(x, a_spaced, seg_indptr, weight_indices, permutation), b_spaced, offsets.tolist(), scalings,
        seg_indptr, weight_indices, permutation, base=base,
    )
    return dict(x=x, a=a, b=b, base=base, meta=meta, info=info, offsets=offsets, scalings=scalings,
                permutation=permutation, expected=expected)


def expand(op, p, mid, bands):
    common = dict(scalings=p["scalings"], base_output=p["base"].clone(), batch_info=p["info"], **p["meta"])
    if op == "sgemm_lora_b_fwd":
        return triton_ops.sgemm_lora_b_fwd(input_x=mid, weights=p["b"], **common)
    if op == "qkv_lora_b_fwd":
        return triton_ops.qkv_lora_b_fwd(
            input_x=mid, qkv_lora_b=p["b"], output_offset=p["offsets"], max_qkv_out_dim=max(bands), **common
        )
    if op == "gate_up_lora_b_fwd":
        return triton_ops.gate_up_lora_b_fwd(input_x=mid, gate_up_lora_b=p["b"], output_dim=bands[0], **common)
    return triton_ops.chunked_sgmv_lora_expand_fwd(
        input_x=mid, weights=p["b"], slice_offsets=p["offsets"], max_slice_size=max(bands), num_slices=len(bands),
        num_segments=len(p["meta"]["weight_indices"]), permutation=p["permutation"], **common,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("op, bands", CONTIGUOUS_PATHS, ids=lambda v: str(len(v)) if isinstance(v, tuple) else v)
def test_contiguous_batch(op, bands, layout, dtype):
    p = setup(2 * CONTIGUOUS_PATHS.index((op, bands)) + LAYOUTS.index(layout), dtype, bands, layout, permuted=False)
    mid = triton_ops.sgemm_lora_a_fwd(input_x=p["x"], weights=p["a"], stack_num=len(bands), batch_info=p["info"], **p["meta"])
    assert_close(expand(op, p, mid, bands), p["expected"], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bands", PERMUTED_BANDS, ids=len)
def test_permuted_batch(bands, layout, dtype):
    p = setup(len(bands) + 10 * LAYOUTS.index(layout), dtype, bands, layout, permuted=True)
    mid = triton_ops.chunked_sgmv_lora_shrink_fwd(
        input_x=p["x"], weights=p["a"], stack_num=len(bands), num_segments=len(p["meta"]["weight_indices"]),
        permutation=p["permutation"], batch_info=p["info"], **p["meta"],
    )
    assert_close(expand("chunked_sgmv_lora_expand_fwd", p, mid, bands), p["expected"], dtype)


def test_spaced_pool_with_real_ranks_is_wrong():
    """The protection, and what removing it does: without padding, a slot below max_lora_rank reads
    its slices at the packed offsets ``p * r`` of the spaced pool and gets wrong numbers."""
    p = setup(3, torch.float32, (16, 8, 8), "spaced", permuted=False)
    p["info"].lora_ranks = p["meta"]["lora_ranks"]  # real ranks on the spaced pool
    mid = triton_ops.sgemm_lora_a_fwd(input_x=p["x"], weights=p["a"], stack_num=3, batch_info=p["info"], **p["meta"])
    error = (expand("qkv_lora_b_fwd", p, mid, (16, 8, 8)).double() - p["expected"]).abs().max()
    assert error > 0.1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_embedding_lora_a(layout, dtype):
    rng = random.Random(7)
    vocab, ranks = 11, [0, 3, MAX_RANK]
    num_rows, seg_indptr, weight_indices, _ = random_batch(rng, NUM_SLOTS, permuted=False)
    real = torch.tensor(ranks, dtype=torch.int32)
    weights = torch.randn(NUM_SLOTS, MAX_RANK, vocab).to(dtype)
    reference_weights = weights.clone()
    for slot, rank in enumerate(ranks):
        reference_weights[slot, rank:] = 0
    if layout == "spaced":
        weights = reference_weights  # the pool zeroes the slot before a load
    kernel_ranks = triton_ops.pad_lora_ranks(real, MAX_RANK) if layout == "spaced" else real
    ids = torch.tensor([rng.randrange(vocab) for _ in range(num_rows)])
    info = kernel_batch_info(seg_indptr, weight_indices, kernel_ranks, torch.ones(NUM_SLOTS), None)
    out = triton_ops.embedding_lora_a_fwd(
        input_ids=ids, weights=weights, vocab_size=vocab, seg_indptr=seg_indptr, weight_indices=weight_indices,
        lora_ranks=real, batch_info=info,
    )
    assert_close(out, ref_embedding(ids, reference_weights, vocab, seg_indptr, weight_indices, real), dtype)


def test_pad_lora_ranks_keeps_zero_and_fills_in_place():
    out = torch.full((4,), -1, dtype=torch.int32)
    result = triton_ops.pad_lora_ranks(torch.tensor([0, 3, 16, 0]), 16, out=out)
    assert result is out and out.tolist() == [0, 16, 16, 0]
