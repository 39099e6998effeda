"""Portable ops against an independent float64 reference: a plain loop over segments.

Every op test runs twice, once per routing strategy (:func:`torch_ops.routes_on_host`), forced here
on CPU tensors: routed on the host, and routed on the device (sync-free, graph-capturable).

Tolerances (relative to the reference's max magnitude): fp32 1e-5; fp16 2e-3 and bf16 1.6e-2, i.e.
a few units of the format's epsilon (2^-10, 2^-7), since inputs are rounded once and products are
accumulated in fp32.
"""

from __future__ import annotations

import random

import pytest
import torch

from sglang_xpu_lora.providers import torch_ops

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = list(TOLERANCE)
SEEDS = range(12)


pytestmark = pytest.mark.usefixtures("routing")  # tests/unit/conftest.py: host and device routing


# --- an independent float64 reference ------------------------------------------------------------


def segments(seg_indptr, weight_indices, permutation, num_rows):
    """(slot, physical rows) per segment."""
    perm = list(range(num_rows)) if permutation is None else permutation.tolist()
    bounds = seg_indptr.tolist()
    return [(int(weight_indices[s]), perm[bounds[s] : bounds[s + 1]]) for s in range(len(bounds) - 1)]


def ref_shrink(x, weights, seg_indptr, weight_indices, permutation=None):
    out = torch.zeros(x.shape[0], weights.shape[1], dtype=torch.float64)
    for slot, rows in segments(seg_indptr, weight_indices, permutation, x.shape[0]):
        for row in rows:
            out[row] = x[row].double() @ weights[slot].double().T
    return out


def ref_expand(x, weights, offsets, scalings, seg_indptr, weight_indices, permutation=None, base=None):
    num_rows, max_rank = x.shape[0], weights.shape[2]
    out = torch.zeros(num_rows, weights.shape[1], dtype=torch.float64)
    if base is not None:
        out += base.double()
    for slot, rows in segments(seg_indptr, weight_indices, permutation, num_rows):
        for row in rows:
            for p in range(len(offsets) - 1):
                lo, hi = offsets[p], offsets[p + 1]
                xs = x[row, p * max_rank : (p + 1) * max_rank].double()
                out[row, lo:hi] += float(scalings[slot]) * (weights[slot, lo:hi].double() @ xs)
    return out


def ref_embedding(ids, weights, vocab, seg_indptr, weight_indices, ranks, extra=None):
    out = torch.zeros(ids.shape[0], weights.shape[1], dtype=torch.float64)
    for slot, rows in segments(seg_indptr, weight_indices, None, ids.shape[0]):
        rank = int(ranks[slot])
        for row in rows:
            tok = int(ids[row])
            if 0 <= tok < vocab:
                out[row, :rank] = weights[slot, :rank, tok].double()
            elif extra is not None and vocab <= tok < vocab + extra.shape[1]:
                out[row, :rank] = extra[slot, tok - vocab, :rank].double()
    return out


# --- random problems ----------------------------------------------------------------------------


def random_batch(rng: random.Random, num_slots: int, permuted: bool):
    """Segments with empty ones, a tail of rows in no segment (contiguous case), and ranks with 0 and max."""
    num_segments = rng.randint(1, 6)
    lens = [rng.choice([0, 0, 1, 2, 5, 9]) for _ in range(num_segments)]
    total = sum(lens)
    num_rows = total if permuted else total + rng.randint(0, 3)
    seg_indptr = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)
    weight_indices = torch.tensor([rng.randrange(num_slots) for _ in range(num_segments)], dtype=torch.int32)
    permutation = None
    if permuted:
        order = list(range(num_rows))
        rng.shuffle(order)
        permutation = torch.tensor(order, dtype=torch.int32)
    return num_rows, seg_indptr, weight_indices, permutation


def random_ranks(rng, num_slots, max_rank):
    ranks = [rng.choice([0, max_rank, rng.randint(1, max_rank)]) for _ in range(num_slots)]
    ranks[0], ranks[-1] = 0, max_rank
    return torch.tensor(ranks, dtype=torch.int64)


def zero_tails(a, b, ranks, num_slices):
    """SGLang's packed layout with zeroed slots (the pool patch's job): a rank-r slot's A rows from
    ``num_slices * r`` on and B columns from ``r`` on are zero."""
    for slot, rank in enumerate(ranks.tolist()):
        a[slot, num_slices * rank :] = 0
        b[slot, :, rank:] = 0


def assert_close(actual, expected, dtype):
    assert actual.dtype == dtype
    assert actual.shape == expected.shape
    if expected.numel() == 0:
        return
    scale = max(expected.abs().max().item(), 1.0)
    error = (actual.double() - expected).abs().max().item()
    assert error <= TOLERANCE[dtype] * scale, f"max error {error:.3e} > {TOLERANCE[dtype]:.1e} * {scale:.2f}"


def problem(seed, dtype, num_slices, permuted):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_slots, max_rank, hidden = rng.randint(1, 4), rng.choice([1, 4, 8]), rng.choice([8, 24])
    num_rows, seg_indptr, weight_indices, permutation = random_batch(rng, num_slots, permuted)
    widths = [rng.choice([3, 8, 16]) for _ in range(num_slices)]
    offsets = [0] + torch.tensor(widths).cumsum(0).tolist()
    ranks = random_ranks(rng, num_slots, max_rank)
    a = torch.randn(num_slots, num_slices * max_rank, hidden).to(dtype)
    b = torch.randn(num_slots, offsets[-1], max_rank).to(dtype)
    zero_tails(a, b, ranks, num_slices)
    x = torch.randn(num_rows, hidden).to(dtype)
    mid = torch.randn(num_rows, num_slices * max_rank).to(dtype)
    base = torch.randn(num_rows, offsets[-1]).to(dtype)
    scalings = torch.rand(num_slots) * 2
    return dict(
        x=x, a=a, b=b, mid=mid, base=base, offsets=offsets, scalings=scalings, ranks=ranks,
        seg_indptr=seg_indptr, weight_indices=weight_indices, permutation=permutation,
    )


# --- the ops ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_slices", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", SEEDS)
def test_sgemm_lora_a(seed, num_slices, dtype):
    p = problem(seed, dtype, num_slices, permuted=False)
    out = torch_ops.sgemm_lora_a_fwd(
        input_x=p["x"], weights=p["a"], num_slices=num_slices, seg_indptr=p["seg_indptr"],
        weight_indices=p["weight_indices"], lora_ranks=p["ranks"],
    )
    assert out.shape == (p["x"].shape[0], p["a"].shape[1])
    assert_close(out, ref_shrink(p["x"], p["a"], p["seg_indptr"], p["weight_indices"]), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("with_base", [True, False])
def test_sgemm_lora_b(seed, dtype, with_base):
    p = problem(seed, dtype, 1, permuted=False)
    base = p["base"] if with_base else None
    out = torch_ops.sgemm_lora_b_fwd(
        input_x=p["mid"], weights=p["b"], seg_indptr=p["seg_indptr"], weight_indices=p["weight_indices"],
        lora_ranks=p["ranks"], scalings=p["scalings"], base_output=None if base is None else base.clone(),
    )
    expected = ref_expand(p["mid"], p["b"], p["offsets"], p["scalings"], p["seg_indptr"], p["weight_indices"], base=base)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed", SEEDS)
def test_qkv_lora_b(seed, dtype):
    p = problem(seed, dtype, 3, permuted=False)
    out = torch_ops.qkv_lora_b_fwd(
        input_x=p["mid"], qkv_lora_b=p["b"], output_offset=torch.tensor(p["offsets"], dtype=torch.int32),
        max_qkv_out_dim=max(hi - lo for lo, hi in zip(p["offsets"], p["offsets"][1:])),
        seg_indptr=p["seg_indptr"], weight_indices=p["weight_indices"], lora_ranks=p["ranks"],
        scalings=p["scalings"], base_output=p["base"].clone(),
    )
    expected = ref_expand(p["mid"], p["b"], p["offsets"], p["scalings"], p["seg_indptr"], p["weight_indices"], base=p["base"])
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed", SEEDS)
def test_gate_up_lora_b(seed, dtype):
    p = problem(seed, dtype, 2, permuted=False)
    half = p["b"].shape[1] // 2
    b = p["b"][:, : 2 * half].contiguous()
    offsets = [0, half, 2 * half]
    out = torch_ops.gate_up_lora_b_fwd(
        input_x=p["mid"], gate_up_lora_b=b, output_dim=half, seg_indptr=p["seg_indptr"],
        weight_indices=p["weight_indices"], lora_ranks=p["ranks"], scalings=p["scalings"],
        base_output=p["base"][:, : 2 * half].clone(),
    )
    expected = ref_expand(
        p["mid"], b, offsets, p["scalings"], p["seg_indptr"], p["weight_indices"], base=p["base"][:, : 2 * half]
    )
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_slices", [1, 2, 3, 4])
@pytest.mark.parametrize("permuted", [True, False], ids=["permutation", "no-permutation"])
@pytest.mark.parametrize("seed", SEEDS)
def test_chunked_sgmv_shrink(seed, permuted, num_slices, dtype):
    p = problem(seed, dtype, num_slices, permuted)
    out = torch_ops.chunked_sgmv_lora_shrink_fwd(
        input_x=p["x"], weights=p["a"], num_slices=num_slices, num_segments=p["weight_indices"].numel(),
        seg_indptr=p["seg_indptr"], weight_indices=p["weight_indices"], lora_ranks=p["ranks"],
        permutation=p["permutation"],
    )
    expected = ref_shrink(p["x"], p["a"], p["seg_indptr"], p["weight_indices"], p["permutation"])
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_slices", [1, 2, 3, 4])
@pytest.mark.parametrize("permuted", [True, False], ids=["permutation", "no-permutation"])
@pytest.mark.parametrize("seed", SEEDS)
def test_chunked_sgmv_expand(seed, permuted, num_slices, dtype):
    p = problem(seed, dtype, num_slices, permuted)
    out = torch_ops.chunked_sgmv_lora_expand_fwd(
        input_x=p["mid"], weights=p["b"], slice_offsets=torch.tensor(p["offsets"], dtype=torch.int32),
        max_slice_size=max(hi - lo for lo, hi in zip(p["offsets"], p["offsets"][1:])), num_slices=num_slices,
        num_segments=p["weight_indices"].numel(), seg_indptr=p["seg_indptr"], weight_indices=p["weight_indices"],
        lora_ranks=p["ranks"], scalings=p["scalings"], permutation=p["permutation"], base_output=p["base"].clone(),
    )
    expected = ref_expand(
        p["mid"], p["b"], p["offsets"], p["scalings"], p["seg_indptr"], p["weight_indices"], p["permutation"], p["base"]
    )
    assert_close(out, expected, dtype)


def b_op_calls(p, num_slices):
    """Each B op's call on problem ``p`` (``num_slices`` slices), as a function of ``base_output``."""
    offsets, common = p["offsets"], dict(seg_indptr=p["seg_indptr"], weight_indices=p["weight_indices"], lora_ranks=p["ranks"], scalings=p["scalings"])
    widest = max(hi - lo for lo, hi in zip(offsets, offsets[1:]))
    slice_offsets = torch.tensor(offsets, dtype=torch.int32)
    calls = {
        "chunked_sgmv_lora_expand_fwd": lambda base: torch_ops.chunked_sgmv_lora_expand_fwd(
            p["mid"], p["b"], slice_offsets, widest, num_slices, p["weight_indices"].numel(),
            permutation=p["permutation"], base_output=base, **common,
        ),
    }
    if p["permutation"] is None and num_slices == 1:
        calls["sgemm_lora_b_fwd"] = lambda base: torch_ops.sgemm_lora_b_fwd(p["mid"], p["b"], base_output=base, **common)
    if p["permutation"] is None and num_slices == 3:
        calls["qkv_lora_b_fwd"] = lambda base: torch_ops.qkv_lora_b_fwd(p["mid"], p["b"], slice_offsets, widest, base_output=base, **common)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_slices", [1, 3])
@pytest.mark.parametrize("permuted", [True, False], ids=["permutation", "no-permutation"])
@pytest.mark.parametrize("seed", range(4))
def test_b_ops_add_into_base_output_in_place(seed, permuted, num_slices, dtype):
    """Given ``base_output``, a B op returns that tensor with the LoRA term added (as SGLang's
    kernels and its torch_native backend do, so no second (T, N) tensor is made per layer); rows in
    no segment and rank-0 rows keep the base. A base in another dtype is left alone."""
    p = problem(seed, dtype, num_slices, permuted)
    expected = ref_expand(
        p["mid"], p["b"], p["offsets"], p["scalings"], p["seg_indptr"], p["weight_indices"], p["permutation"], p["base"]
    )
    for op, call in b_op_calls(p, num_slices).items():
        base = p["base"].clone()
        out = call(base)
        assert out is base, op
        assert_close(out, expected, dtype)
        other = p["base"].double()
        assert_close(call(other), expected, dtype)
        assert torch.equal(other, p["base"].double()), op


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_extra", [True, False])
@pytest.mark.parametrize("seed", SEEDS)
def test_embedding_lora_a(seed, with_extra, dtype):
    p = problem(seed, dtype, 1, permuted=False)
    num_slots, max_rank, vocab = p["a"].shape[0], p["a"].shape[1], 11
    weights = torch.randn(num_slots, max_rank, vocab).to(dtype)  # rank tails deliberately NOT zeroed
    extra = torch.randn(num_slots, 3, max_rank).to(dtype) if with_extra else None
    ids = torch.randint(-2, vocab + 5, (p["x"].shape[0],))
    out = torch_ops.embedding_lora_a_fwd(
        input_ids=ids, weights=weights, vocab_size=vocab, seg_indptr=p["seg_indptr"],
        weight_indices=p["weight_indices"], lora_ranks=p["ranks"], extra_embeddings=extra,
    )
    expected = ref_embedding(ids, weights, vocab, p["seg_indptr"], p["weight_indices"], p["ranks"], extra)
    assert_close(out, expected, dtype)


def test_gemm_ops_rely_on_zero_rank_tails(routing):
    """The pool, not the op, zeroes rank tails: the device routing contracts over the full max_rank
    (as the XPU kernels do) and uses an unzeroed tail; the host routing contracts over the slot's
    rank and never reads it. With zero tails (the pool's contract) both give the same numbers."""
    x = torch.ones(2, 4)
    a = torch.ones(1, 8, 4)  # max_rank 8, rank 2 claimed, tail rows nonzero
    seg = torch.tensor([0, 2], dtype=torch.int32)
    out = torch_ops.sgemm_lora_a_fwd(x, a, 1, seg, torch.tensor([0], dtype=torch.int32), torch.tensor([2]))
    expected = torch.full((2, 8), 4.0)
    if routing == "host":
        expected[:, 2:] = 0
    assert torch.equal(out, expected)


def test_shape_errors_are_clear():
    seg, wi, ranks = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32), torch.tensor([4])
    with pytest.raises(ValueError, match="num_slices \\(3\\) \\* max_rank \\(4\\)"):
        torch_ops.qkv_lora_b_fwd(torch.zeros(1, 8), torch.zeros(1, 6, 4), torch.tensor([0, 2, 4, 6]), 2, seg, wi, ranks, torch.ones(1))
    with pytest.raises(ValueError, match="output_offset must have 4 elements"):
        torch_ops.qkv_lora_b_fwd(torch.zeros(1, 12), torch.zeros(1, 6, 4), torch.tensor([0, 6]), 6, seg, wi, ranks, torch.ones(1))
    with pytest.raises(ValueError, match="slice_offsets must have num_slices \\+ 1 = 3"):
        torch_ops.chunked_sgmv_lora_expand_fwd(torch.zeros(1, 8), torch.zeros(1, 6, 4), torch.tensor([0, 6]), 6, 2, 1, seg, wi, ranks, torch.ones(1))
