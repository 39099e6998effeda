"""The Triton provider: SGLang's own Triton LoRA kernels, run by Triton's interpreter on CPU tensors
(``TRITON_INTERPRET=1``, tests/conftest.py), against the float64 per-segment reference of
test_torch_ops.py, on SGLang's packed pool (slice ``p`` at row ``p * r``) with the real ranks, its
tails either zeroed (the plugin's pool patch) or stale (SGLang's own reused slot): the kernels read
neither.

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
import types
import random

import pytest
import torch
from test_torch_ops import assert_close, random_batch, ref_embedding, ref_expand, ref_shrink

from sglang_xpu_lora.providers import triton_ops

MAX_RANK, HIDDEN, NUM_SLOTS = 8, 24, 3
DTYPES = [torch.float32, torch.float16]  # no bfloat16 in Triton's interpreter (module docstring)
TAILS = ("zeroed", "stale")
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


def sglang_batch_info(seg_indptr, weight_indices, lora_ranks, scalings, permutation):
    """The batch info SGLang's Triton backend builds (``bs`` segments, ``max_len`` the longest)."""
    from sglang.srt.lora.utils import LoRABatchInfo

    seg_lens = seg_indptr[1:] - seg_indptr[:-1]
    return LoRABatchInfo(
        use_cuda_graph=False, bs=len(weight_indices), num_segments=len(weight_indices), seg_indptr=seg_indptr,
        weight_indices=weight_indices, lora_ranks=lora_ranks, scalings=scalings,
        max_len=max(1, int(seg_lens.max())), seg_lens=seg_lens, permutation=permutation,
    )


def pool_weights(rng, ranks, bands, tails, dtype):
    """Stacked ``A (L, n * R, K)`` and ``B (L, N, R)`` in SGLang's packed layout (slice ``p`` of a
    rank-``r`` slot at rows ``p * r``), their tails ``"zeroed"`` or ``"stale"`` (random, as a reused
    SGLang slot holds), and for the reference the same adapters with each slice in its own
    ``R``-row block, zero tails."""
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    n, total = len(bands), sum(bands)
    stale = tails == "stale"
    a = torch.randn(NUM_SLOTS, n * MAX_RANK, HIDDEN, generator=gen) if stale else torch.zeros(NUM_SLOTS, n * MAX_RANK, HIDDEN)
    b = torch.randn(NUM_SLOTS, total, MAX_RANK, generator=gen) if stale else torch.zeros(NUM_SLOTS, total, MAX_RANK)
    a_blocks, b_reference = torch.zeros(NUM_SLOTS, n * MAX_RANK, HIDDEN), torch.zeros(NUM_SLOTS, total, MAX_RANK)
    for slot, rank in enumerate(ranks):
        for p in range(n):
            a[slot, p * rank : (p + 1) * rank] = a_blocks[slot, p * MAX_RANK : p * MAX_RANK + rank] = torch.randn(
                rank, HIDDEN, generator=gen
            )
        b_reference[slot, :, :rank] = b[slot, :, :rank] = torch.randn(total, rank, generator=gen)
    return a.to(dtype), b.to(dtype), a_blocks.to(dtype), b_reference.to(dtype)


def setup(seed, dtype, bands, tails, permuted):
    rng = random.Random(seed)
    ranks = [0, rng.randint(1, MAX_RANK - 1), MAX_RANK]
    rng.shuffle(ranks)
    num_rows, seg_indptr, weight_indices, permutation = random_batch(rng, NUM_SLOTS, permuted)
    real = torch.tensor(ranks, dtype=torch.int32)
    scalings = torch.tensor([rng.uniform(0.25, 2.0) for _ in range(NUM_SLOTS)])
    a, b, a_blocks, b_reference = pool_weights(rng, ranks, bands, tails, dtype)
    x = torch.randn(num_rows, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(dtype)
    base = torch.randn(num_rows, sum(bands), generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    meta = dict(seg_indptr=seg_indptr, weight_indices=weight_indices, lora_ranks=real)
    info = sglang_batch_info(seg_indptr, weight_indices, real, scalings, permutation)
    offsets = torch.tensor([0, *itertools.accumulate(bands)], dtype=torch.int32)
    expected = ref_expand(
        ref_shrink(x, a_blocks, seg_indptr, weight_indices, permutation), b_reference, offsets.tolist(), scalings,
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
@pytest.mark.parametrize("tails", TAILS)
@pytest.mark.parametrize("op, bands", CONTIGUOUS_PATHS, ids=lambda v: str(len(v)) if isinstance(v, tuple) else v)
def test_contiguous_batch(op, bands, tails, dtype):
    p = setup(2 * CONTIGUOUS_PATHS.index((op, bands)) + TAILS.index(tails), dtype, bands, tails, permuted=False)
    mid = triton_ops.sgemm_lora_a_fwd(input_x=p["x"], weights=p["a"], num_slices=len(bands), batch_info=p["info"], **p["meta"])
    assert_close(expand(op, p, mid, bands), p["expected"], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tails", TAILS)
@pytest.mark.parametrize("bands", PERMUTED_BANDS, ids=len)
def test_permuted_batch(bands, tails, dtype):
    p = setup(len(bands) + 10 * TAILS.index(tails), dtype, bands, tails, permuted=True)
    mid = triton_ops.chunked_sgmv_lora_shrink_fwd(
        input_x=p["x"], weights=p["a"], num_slices=len(bands), num_segments=len(p["meta"]["weight_indices"]),
        permutation=p["permutation"], batch_info=p["info"], **p["meta"],
    )
    assert_close(expand("chunked_sgmv_lora_expand_fwd", p, mid, bands), p["expected"], dtype)


def test_padded_ranks_on_the_packed_pool_are_wrong():
    """Why the kernels get the real ranks: a slot below max_lora_rank given ``max_lora_rank`` reads
    its slices at ``p * max_lora_rank`` of the packed pool and gets wrong numbers."""
    p = setup(3, torch.float32, (16, 8, 8), "zeroed", permuted=False)
    real = p["meta"]["lora_ranks"]
    p["info"].lora_ranks = torch.where(real > 0, MAX_RANK, 0).to(torch.int32)
    mid = triton_ops.sgemm_lora_a_fwd(input_x=p["x"], weights=p["a"], num_slices=3, batch_info=p["info"], **p["meta"])
    error = (expand("qkv_lora_b_fwd", p, mid, (16, 8, 8)).double() - p["expected"]).abs().max()
    assert error > 0.1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tails", TAILS)
def test_embedding_lora_a(tails, dtype):
    rng = random.Random(7)
    vocab, ranks = 11, [0, 3, MAX_RANK]
    num_rows, seg_indptr, weight_indices, _ = random_batch(rng, NUM_SLOTS, permuted=False)
    real = torch.tensor(ranks, dtype=torch.int32)
    weights = torch.randn(NUM_SLOTS, MAX_RANK, vocab).to(dtype)
    reference_weights = weights.clone()
    for slot, rank in enumerate(ranks):
        reference_weights[slot, rank:] = 0
    if tails == "zeroed":
        weights = reference_weights  # the pool patch zeroes the slot before a load
    ids = torch.tensor([rng.randrange(vocab) for _ in range(num_rows)])
    info = sglang_batch_info(seg_indptr, weight_indices, real, torch.ones(NUM_SLOTS), None)
    out = triton_ops.embedding_lora_a_fwd(
        input_ids=ids, weights=weights, vocab_size=vocab, seg_indptr=seg_indptr, weight_indices=weight_indices,
        lora_ranks=real, batch_info=info,
    )
    assert_close(out, ref_embedding(ids, reference_weights, vocab, seg_indptr, weight_indices, real), dtype)


# --- the bound ops: launches from compiled handles (providers/triton_launch.py) -----------------

#: Bound op (or chunked-expand form), band widths, permuted batch, and the kernel it launches
#: (``triton_launch._kernels()``'s names): every form the backend's routes bind.
BOUND_FORMS = [
    ("sgemm_lora_b_fwd", (20,), False, "expand_one"),
    ("gate_up_lora_b_fwd", (12, 12), False, "expand_two"),
    ("qkv_lora_b_fwd", (16, 8, 8), False, "expand_bands"),
    ("chunked_sgmv_lora_expand_fwd", (12, 6), False, "expand_bands"),
    ("chunked_expand_one_band", (20,), True, "expand_one"),
    ("chunked_expand_two_bands", (12, 12), True, "expand_two"),
    ("chunked_sgmv_lora_expand_fwd", (20,), True, "expand_one"),
    ("chunked_sgmv_lora_expand_fwd", (12, 12), True, "expand_two"),
    ("chunked_sgmv_lora_expand_fwd", (16, 8, 8), True, "expand_bands"),
]


def bound_arguments(op, p, mid, bands, base):
    """The per-call arguments of ``op`` (``batch_binding.BOUND_PARAMETERS``, or a uniform-band
    form's: those of the B op of its band count), positionally."""
    if op in ("sgemm_lora_b_fwd", "chunked_expand_one_band"):
        return (mid, p["b"], base)
    if op in ("gate_up_lora_b_fwd", "chunked_expand_two_bands"):
        return (mid, p["b"], bands[0], base)
    if op == "qkv_lora_b_fwd":
        return (mid, p["b"], p["offsets"], max(bands), base)
    return (mid, p["b"], p["offsets"], max(bands), len(bands), base)


def sglang_wrappers_output(p, bands):
    """The layer as SGLang's ``TritonLoRABackend`` computes it: its wrappers, the B one chosen by
    the bands as its layers choose it."""
    from sglang_xpu_lora.upstream import targets
    from sglang_xpu_lora.upstream.compat import resolve

    sgemm_lora_a_fwd, sgemm_lora_b_fwd = resolve(targets.TRITON_SGEMM_LORA_A), resolve(targets.TRITON_SGEMM_LORA_B)
    qkv_lora_b_fwd, gate_up_lora_b_fwd = resolve(targets.TRITON_QKV_LORA_B), resolve(targets.TRITON_GATE_UP_LORA_B)
    info, base = p["info"], p["base"].clone()
    mid = sgemm_lora_a_fwd(p["x"], p["a"], info, stack_num=len(bands))
    if len(bands) == 1:
        return sgemm_lora_b_fwd(mid, p["b"], info, base)
    if len(bands) == 2 and bands[0] == bands[1]:
        return gate_up_lora_b_fwd(mid, p["b"], info, bands[0], base)
    return qkv_lora_b_fwd(mid, p["b"], info, p["offsets"], max(bands), base, n_slices=len(bands))


def shrink_of(permuted: bool) -> str:
    """The shrink a batch's route binds: the permuted one for a decode batch."""
    return "chunked_sgmv_lora_shrink_fwd" if permuted else "sgemm_lora_a_fwd"


@pytest.mark.parametrize("op, bands, permuted, kernel", BOUND_FORMS, ids=lambda v: str(len(v)) if isinstance(v, tuple) else str(v))
def test_bound_ops_equal_sglang_wrappers_bit_for_bit(op, bands, permuted, kernel):
    """Each bound form, its shrink bound too (the permuted one for a decode batch), in fp32 on a
    batch with a rank-0 slot, empty segments and stale rank tails: the output equals SGLang's
    wrappers' bit for bit (the same kernels, grids and arguments)."""
    from sglang_xpu_lora.providers.triton_launch import TritonLaunches

    p = setup(len(bands) + 7 * permuted, torch.float32, bands, "stale", permuted=permuted)
    bound = triton_ops.bind((shrink_of(permuted), op), p["info"], TritonLaunches())
    mid = bound[shrink_of(permuted)](p["x"], p["a"], len(bands))
    out = bound[op](*bound_arguments(op, p, mid, bands, p["base"].clone()))
    assert torch.equal(out, sglang_wrappers_output(p, bands))
    assert_close(out, p["expected"], torch.float32)


def stand_in_launches():
    """A ``TritonLaunches`` of stand-in kernels (test_triton_launch.py) and those kernels by name."""
    from test_triton_launch import StandInKernel

    from sglang_xpu_lora.providers.triton_launch import CompiledLaunches, TritonLaunches

    kernels = {name: StandInKernel() for name in ("shrink", "expand_one", "expand_bands", "expand_two")}
    launches = TritonLaunches(
        kernels=types.SimpleNamespace(**kernels),
        launches=lambda kernel: CompiledLaunches(kernel, current_device=lambda: 0, current_stream=lambda device: 0),
    )
    return launches, kernels


def test_bound_ops_launch_from_compiled_handles():
    """The bound ops launch through the ``CompiledLaunches`` of the launch cache they are bound
    with (stand-in kernels, test_triton_launch.py): each form's kernel is compiled at its first
    launch and later launched from its compiled handle, across batches of the same
    specialization; the ops of one binding are methods of one ``BatchLaunches``; a B op given no
    base output adds into new zeros, as SGLang's wrappers do."""
    for op, bands, permuted, kernel in BOUND_FORMS:
        launches, kernels = stand_in_launches()
        p = setup(len(bands), torch.float32, bands, "zeroed", permuted=permuted)
        for _ in range(2):  # two batches of the same specialization
            bound = triton_ops.bind((shrink_of(permuted), op), p["info"], launches)
            assert bound[shrink_of(permuted)].__self__ is bound[op].__self__
            mid = bound[shrink_of(permuted)](p["x"], p["a"], len(bands))
            out = bound[op](*bound_arguments(op, p, mid, bands, None))
        assert out.shape == p["base"].shape and not out.any()  # stand-ins add nothing to the zeros
        launched = {name: (len(k.compiles), len(k.launches)) for name, k in kernels.items() if k.compiles}
        assert launched == {"shrink": (1, 1), kernel: (1, 1)}, op


def test_a_keyword_call_launches_through_the_launch_cache_it_is_given():
    """The keyword ops take the caller's launch cache (``launches``): of two calls, the first
    compiles and the second launches from the compiled handle."""
    launches, kernels = stand_in_launches()
    p = setup(1, torch.float32, (20,), "zeroed", permuted=False)
    for _ in range(2):
        triton_ops.sgemm_lora_a_fwd(
            input_x=p["x"], weights=p["a"], num_slices=1, batch_info=p["info"], launches=launches, **p["meta"]
        )
    assert (len(kernels["shrink"].compiles), len(kernels["shrink"].launches)) == (1, 1)


def test_an_op_that_is_not_bound_is_refused():
    with pytest.raises(KeyError, match="embedding_lora_a_fwd is not bound"):
        triton_ops.bind(("sgemm_lora_a_fwd", "embedding_lora_a_fwd"), None, None)
