"""Odd inputs for the fused LoRA kernel (:mod:`sglang_xpu_lora.dense.fused`), its plan spec
(:func:`sglang_xpu_lora.dense.plans.plan_from_spec`) and its dispatch
(:meth:`sglang_xpu_lora.dense.runner.DeviceDenseRunner.apply`).

Every case runs the per-row form with both overlaps (``none``, ``ab_delta``) through the runner,
against a float64 loop of SGLang's packed-pool semantics (slice ``p`` of a rank-``r`` slot: A rows
``[p r, (p + 1) r)``, B's first ``r`` columns; the shrink rounded to ``x``'s dtype, as the kernel
and PEFT do; rows of slot -1 or rank 0 untouched). Tolerances relative to the reference's largest
magnitude: fp32 1e-5, fp16 2e-3. Stale rank tails hold NaN (nothing may read them). Triton's
interpreter (``TRITON_INTERPRET=1``, tests/conftest.py) runs the kernel.

The tests at the end check the dispatch and the plan spec refuse what a fused plan cannot do, with
the documented error (each failed before its fix: a reviewer's findings).
"""

from __future__ import annotations

import json

import pytest
import torch

FP32, FP16 = torch.float32, torch.float16
TOLERANCE = {FP32: 1e-5, FP16: 2e-3}
T16 = {"BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 16, "num_warps": 4, "num_stages": 1}


def fused_specs(tiles=T16):
    return {f"per_row/{overlap}": dict(fused="per_row", tiles=tiles, overlap=overlap) for overlap in ("none", "ab_delta")}


PLANS = list(fused_specs())


@pytest.fixture(autouse=True)
def interpreter():
    import triton

    assert triton.knobs.runtime.interpret, "TRITON_INTERPRET=1 must be set before SGLang's kernels are imported"


def pool(slices, max_rank, k, ranks, dtype, seed=0, nan_slot=None):
    """A ``(slots, slices * max_rank, K)`` and B ``(slots, N, max_rank)``, packed at each slot's
    real rank; every stale tail NaN; ``nan_slot`` NaN everywhere."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(len(ranks), len(slices) * max_rank, k, generator=gen) * 0.5
    b = torch.randn(len(ranks), sum(slices), max_rank, generator=gen) * 0.5
    for slot, rank in enumerate(ranks):
        a[slot, len(slices) * rank :], b[slot, :, rank:] = float("nan"), float("nan")
    if nan_slot is not None:
        a[nan_slot], b[nan_slot] = float("nan"), float("nan")
    offsets = [0]
    for width in slices:
        offsets.append(offsets[-1] + width)
    return a.to(dtype), b.to(dtype), tuple(offsets)


def reference(x, base, a, b, offsets, slots, ranks, scalings):
    out = base.double().clone()
    for row, slot in enumerate(slots):
        if slot < 0 or ranks[slot] == 0:
            continue
        rank = ranks[slot]
        for p in range(len(offsets) - 1):
            shrink = (a[slot, p * rank : (p + 1) * rank].double() @ x[row].double()).to(x.dtype).double()
            band = b[slot, offsets[p] : offsets[p + 1], :rank].double()
            out[row, offsets[p] : offsets[p + 1]] += float(scalings[slot]) * (band @ shrink)
    return out


def make_runner(spec, slots, ranks, scalings, *, ranks_dtype=torch.int32, max_loras=None):
    from sglang.srt.lora.utils import Phase

    from sglang_xpu_lora.dense.plans import PlanRow, PlanTable
    from sglang_xpu_lora.dense.runner import DeviceDenseRunner
    from sglang_xpu_lora.dense.workspace import DeviceLoraWorkspace

    runner = DeviceDenseRunner(DeviceLoraWorkspace(), max_loras=max_loras or len(ranks), device=torch.device("cpu"))
    runner.plans = PlanTable(torch.device("cpu"), "default", rows=[PlanRow({"name": "fused", "spec": spec})])
    runner.begin_batch(
        token_slots=torch.tensor(slots, dtype=torch.int32), lora_ranks=torch.tensor(ranks, dtype=ranks_dtype),
        scalings=torch.tensor(scalings, dtype=torch.float32), num_tokens=len(slots), phase=Phase.DECODE, graph_mode=False,
    )
    return runner


def run_fused(spec, x, base_fn, a, b, offsets, slots, ranks, scalings, **runner_options):
    from sglang.srt.lora.dense.plan import DenseLoraKind

    runner = make_runner(spec, slots, ranks, scalings, **runner_options)
    plan = runner.plan_for(DenseLoraKind.LINEAR, b.shape[2], a.shape[2], offsets[-1], num_tokens=x.shape[0])
    return runner.apply(x, base_fn, plan, a=a, b=b, offsets=offsets)


def assert_close(out, ref, rows, dtype):
    if not rows:
        return
    out, ref = out[rows].double(), ref[rows]
    assert torch.isfinite(out).all(), "non-finite output on a row it must not reach"
    scale = ref.abs().max().clamp_min(1e-30)
    error = float((out - ref).abs().max() / scale)
    assert error <= TOLERANCE[dtype], f"relative error {error:.3g}"


# name: (slices, max_rank, K, ranks, token slots, dtype, extra)
CASES = {
    "max_rank_12_not_pow2": ((20, 4), 12, 24, [12, 5, 0, 1], [0, 1, 1, 2, 3, -1, 0], FP32, {}),
    "max_rank_20_K_40": ((20,), 20, 40, [20, 7, 13], [0, 1, 2, 2, 0], FP32, {}),
    "rank_1_pool_1_K_5": ((8, 40, 4), 1, 5, [1, 1, 0], [1, 0, 0, 2, -1], FP32, {}),
    "K_3_below_every_block": ((3,), 4, 3, [4, 2], [1, 0], FP32, {}),
    "block_n_64_wider_than_every_slice": ((20, 8, 8), 4, 24, [4, 2, 0], [0, 1, 1, 2, -1], FP32, {"tiles": {**T16, "BLOCK_SIZE_N": 64}}),
    "block_k_128_wider_than_K": ((20,), 4, 24, [4, 2, 0], [0, 1, 1, 2, -1], FP32, {"tiles": {**T16, "BLOCK_SIZE_K": 128}}),
    "slices_1_100_3": ((1, 100, 3), 4, 16, [4, 3], [0, 1, 1, 0], FP32, {}),
    "unsorted_duplicate_slots": ((8, 16), 8, 20, [8, 3, 5, 7, 1, 0], [5, 1, 3, 1, 3, 2, 0, 5, 4, 2, 1, -1, 3], FP32, {}),
    "40_slots": ((16,), 4, 16, [(i % 4) + 1 for i in range(40)], [39, 0, 17, 17, 5, 38, -1, 20], FP32, {}),
    "single_token": ((20,), 4, 24, [4, 2, 0], [1], FP32, {}),
    "no_row_has_an_adapter": ((20,), 4, 24, [4, 2, 0], [-1, -1, 2, 2], FP32, {}),
    "scalings_zero": ((20,), 4, 24, [4, 2, 0], [0, 1, 1, 2, -1], FP32, {"scalings": [0.0, 0.0, 0.0]}),
    "negative_scaling": ((20,), 4, 24, [4, 2, 0], [0, 1, 1, 2, -1], FP32, {"scalings": [-1.5, 2.0, 1.0]}),
    "lora_ranks_int64": ((20,), 4, 24, [4, 2, 0], [0, 1, 1, 2, -1], FP32, {"ranks_dtype": torch.int64}),
    "x_strided_columns": ((20,), 4, 24, [4, 2, 0], [0, 1, 1, 2, -1], FP32, {"x": lambda x: torch.cat([x, x], 1)[:, ::2]}),
    "x_column_major": ((12, 12), 4, 24, [4, 2, 0], [0, 1, 1, 2, -1], FP32, {"x": lambda x: x.t().contiguous().t()}),
    "x_every_other_row": ((20,), 4, 24, [4, 2, 0], [0, 1, 1, 2, -1], FP32, {"x": lambda x: torch.cat([x, x], 1).view(-1, 24)[::2]}),
    "base_wider_than_offsets": ((12, 12), 4, 24, [4, 2, 0], [0, 1, 1, 2, -1], FP32, {"wide": 10}),
    "base_a_column_slice": ((12, 12), 4, 24, [4, 2, 0], [0, 1, 1, 2, -1], FP32, {"wide": 10, "base": lambda y: y[:, 5:]}),
    "base_column_major": ((12, 12), 4, 24, [4, 2, 0], [0, 1, 1, 2, -1], FP32, {"base": lambda y: y.t().contiguous().t()}),
    "nan_slot": ((20, 4), 12, 24, [12, 5, 7, 1], [0, 1, 2, 3, 3, 1, -1], FP32, {"nan_slot": 1}),
    "fp16_max_rank_12": ((20, 4), 12, 24, [12, 5, 7, 1], [0, 1, 2, 3, 3, 1], FP16, {}),
    "fp16_nan_slot": ((16, 8, 8), 8, 32, [8, 3, 0, 8], [3, 0, 1, 1, 3, -1, 0], FP16, {"nan_slot": 3}),
}


@pytest.mark.parametrize("plan_name", PLANS)
@pytest.mark.parametrize("case", list(CASES))
def test_fused_equals_the_float64_loop_on_odd_inputs(case, plan_name):
    slices, max_rank, k, ranks, slots, dtype, extra = CASES[case]
    spec = fused_specs(extra.get("tiles", T16))[plan_name]
    nan_slot = extra.get("nan_slot")
    a, b, offsets = pool(slices, max_rank, k, ranks, dtype, nan_slot=nan_slot)
    gen = torch.Generator().manual_seed(3)
    x = extra.get("x", lambda t: t)(torch.randn(len(slots), k, generator=gen).to(dtype))
    weight = (torch.randn(offsets[-1] + extra.get("wide", 0), k, generator=gen) * 0.3).to(dtype)
    scalings = extra.get("scalings", [0.5 + i for i in range(len(ranks))])

    def base_fn():
        return extra.get("base", lambda y: y)(x @ weight.t())

    out = run_fused(spec, x, base_fn, a, b, offsets, slots, ranks, scalings, ranks_dtype=extra.get("ranks_dtype", torch.int32))
    ref = reference(x, base_fn(), a, b, offsets, slots, ranks, scalings)
    assert out.shape == ref.shape
    assert_close(out, ref, [i for i, s in enumerate(slots) if s != nan_slot], dtype)
    if nan_slot is not None and nan_slot in slots:
        assert torch.isnan(out[[i for i, s in enumerate(slots) if s == nan_slot]]).any()


@pytest.mark.parametrize("plan_name", PLANS)
def test_zero_tokens(plan_name):
    a, b, offsets = pool((20,), 4, 24, [4, 2, 0], FP32)
    x = torch.zeros(0, 24)
    out = run_fused(fused_specs()[plan_name], x, lambda: torch.zeros(0, 20), a, b, offsets, [], [4, 2, 0], [1.0, 2.0, 3.0])
    assert out.shape == (0, 20)


@pytest.mark.parametrize("plan_name", PLANS)
def test_fp16_overflowing_slot_stays_in_its_rows(plan_name):
    """A slot whose LoRA overflows fp16 (inf) reaches only its own rows."""
    ranks, slots = [4, 4, 2], [0, 1, 1, 2, 0, -1]
    a, b, offsets = pool((16, 16), 4, 16, ranks, FP16)
    b[1] = 6e4
    x = torch.randn(len(slots), 16, generator=torch.Generator().manual_seed(1)).to(FP16)
    weight = (torch.randn(32, 16, generator=torch.Generator().manual_seed(2)) * 0.3).to(FP16)
    scalings = [1.0, 4.0, 0.5]
    out = run_fused(fused_specs()[plan_name], x, lambda: x @ weight.t(), a, b, offsets, slots, ranks, scalings)
    ref = reference(x, x @ weight.t(), a, b, offsets, slots, ranks, scalings)
    assert_close(out, ref, [i for i, s in enumerate(slots) if s != 1], FP16)
    assert not torch.isfinite(out[[1, 2]]).all()


@pytest.mark.parametrize("plan_name", PLANS)
def test_graph_padding_rows_are_untouched(plan_name):
    """Graph mode: x holds padding rows past the live tokens (slot -1 in the persistent map)."""
    import types

    from sglang.srt.lora.dense.plan import DenseLoraKind
    from sglang.srt.lora.utils import Phase

    ranks, scalings, requests = [4, 2, 0, 3], [1.0, 2.0, 3.0, 0.5], [(1, 2), (3, 1), (0, 2)]
    a, b, offsets = pool((12, 12), 4, 24, ranks, FP32)
    runner = make_runner(fused_specs()[plan_name], [0], ranks, scalings)
    runner.allocate_graph_token_slots(8, prefill=False)
    lens = torch.tensor([t for _, t in requests], dtype=torch.int32)
    seg = torch.zeros(len(requests) + 1, dtype=torch.int32)
    seg[1:] = lens.cumsum(0)
    info = types.SimpleNamespace(
        seg_indptr=seg, weight_indices=torch.tensor([s for s, _ in requests], dtype=torch.int32),
        lora_ranks=torch.tensor(ranks, dtype=torch.int32), scalings=torch.tensor(scalings), max_len=2,
    )
    runner.begin_lora_batch(info, requests=3, num_tokens=5, phase=Phase.DECODE, graph=True)
    x = torch.randn(8, 24, generator=torch.Generator().manual_seed(1))
    weight = torch.randn(24, 24, generator=torch.Generator().manual_seed(2))
    plan = runner.plan_for(DenseLoraKind.LINEAR, 4, 24, 24, num_tokens=8)
    out = runner.apply(x, lambda: x @ weight.t(), plan, a=a, b=b, offsets=offsets)
    ref = reference(x, x @ weight.t(), a, b, offsets, [1, 1, 3, 0, 0, -1, -1, -1], ranks, scalings)
    assert_close(out, ref, list(range(8)), FP32)


@pytest.mark.parametrize("dtype", [FP32, FP16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("plan_name", PLANS)
def test_row_parallel_shards_sum_to_the_full_linear(plan_name, dtype):
    """TP 2 row-parallel: each rank's base + LoRA over its K shard (B replicated) sums to the whole."""
    ranks, scalings, slots = [4, 2, 0, 3], [1.0, 2.0, 3.0, 0.5], [1, 3, 3, 0, -1, 2, 1]
    a, b, offsets = pool((20,), 4, 24, ranks, dtype)
    x = torch.randn(len(slots), 24, generator=torch.Generator().manual_seed(1)).to(dtype)
    weight = (torch.randn(20, 24, generator=torch.Generator().manual_seed(2)) * 0.3).to(dtype)
    full = reference(x, x.double() @ weight.double().t(), a, b, offsets, slots, ranks, scalings)
    total = 0
    for shard in (slice(0, 12), slice(12, 24)):
        xs, ws, as_ = x[:, shard].contiguous(), weight[:, shard], a[:, :, shard].contiguous()
        total = total + run_fused(fused_specs()[plan_name], xs, lambda: xs @ ws.t(), as_, b, offsets, slots, ranks, scalings).double()
    assert_close(total, full, list(range(len(slots))), dtype)


@pytest.mark.parametrize("overlap", ["none", "ab_delta"])
def test_bf16_per_row(overlap):
    """bf16 (the interpreter converts fp32 to bf16 by truncation, not round-to-nearest, for every
    kernel alike): within the plan sweep's bf16 tolerance, 2e-2, of float64."""
    ranks, slots, scalings = [12, 5, 0, 1, 7], [3, 1, 0, 2, 1, 0, -1, 4, 4, 0], [0.5, 1.0, 2.0, 1.5, 1.25]
    a, b, offsets = pool((20, 12), 12, 40, ranks, torch.bfloat16)
    x = torch.randn(len(slots), 40, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    weight = (torch.randn(32, 40, generator=torch.Generator().manual_seed(2)) * 0.3).to(torch.bfloat16)
    spec = fused_specs()[f"per_row/{overlap}"]
    out = run_fused(spec, x, lambda: x @ weight.t(), a, b, offsets, slots, ranks, scalings)
    ref = reference(x, x @ weight.t(), a, b, offsets, slots, ranks, scalings)
    assert torch.isfinite(out).all()
    assert float((out.double() - ref).abs().max() / ref.abs().max()) <= 2e-2


# --- plan specs --------------------------------------------------------------------------------


def test_every_sweep_candidate_round_trips_through_json():
    from benchmarks.plan_sweep import candidates, spec_of

    from sglang_xpu_lora.dense.fused import FusedPlan
    from sglang_xpu_lora.dense.plans import plan_from_spec

    specs = candidates("decode", families="fused") + candidates("decode", quick=True, families="fused")
    assert {s["fused"] for s in specs} == {"per_row"}
    for spec in specs:
        plan = plan_from_spec(json.loads(json.dumps(spec)))
        assert isinstance(plan, FusedPlan)
        assert plan.spec() == spec == spec_of(plan)
        assert plan_from_spec(json.loads(json.dumps(plan.spec()))) == plan


@pytest.mark.parametrize(
    "spec",
    [
        {"fused": "per_row", "tiles": {**T16, "num_stages": 0}},
        {"fused": "per_row", "tiles": {**T16, "num_warps": True}},
        {"fused": "per_row", "tiles": {**T16, "BLOCK_SIZE_N": 16.0}},
        {"fused": "per_row", "tiles": {**T16, "BLOCK_SIZE_N": -16}},
        {"fused": "grouped", "tiles": T16, "block_size": 16},  # the retired form
        {"fused": "per_row", "tiles": T16, "block_size": None},
        {"fused": "per_row", "tiles": T16, "overlap": None},
        {"fused": None, "tiles": T16},
        {"fused": ["per_row"], "tiles": T16},
        {"fused": "per_row", "tiles": [["BLOCK_SIZE_N", 16]]},
        {"fused": "per_row", "tiles": {**T16, "GROUP_SIZE_M": 8}},
        {"fused": {"BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 16, "num_warps": 4, "num_stages": 1}},  # the old schema
    ],
)
def test_bad_fused_specs_are_refused(spec):
    from sglang_xpu_lora.dense.plans import plan_from_spec

    with pytest.raises(ValueError):
        plan_from_spec(spec)


def test_good_fused_specs_are_taken():
    from sglang_xpu_lora.dense.plans import plan_from_spec

    tiny = {"BLOCK_SIZE_N": 1, "BLOCK_SIZE_K": 1, "num_warps": 1, "num_stages": 1}
    assert plan_from_spec({"fused": "per_row", "tiles": tiny}).tiles == tiny


@pytest.mark.parametrize("overlap", ["none", "ab_delta"])
def test_per_row_one_column_one_k_tile(overlap):
    """The per-row form takes any power of two, 1 included (BLOCK_SIZE_K is raised to 16)."""
    tiles = {"BLOCK_SIZE_N": 1, "BLOCK_SIZE_K": 1, "num_warps": 1, "num_stages": 1}
    ranks, slots, scalings = [4, 2, 0], [0, 1, 1, 2, -1], [1.0, 2.0, 3.0]
    a, b, offsets = pool((5, 3), 4, 7, ranks, FP32)
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(1))
    weight = torch.randn(8, 7, generator=torch.Generator().manual_seed(2))
    out = run_fused(dict(fused="per_row", tiles=tiles, overlap=overlap), x, lambda: x @ weight.t(), a, b, offsets, slots, ranks, scalings)
    assert_close(out, reference(x, x @ weight.t(), a, b, offsets, slots, ranks, scalings), list(range(5)), FP32)


# --- what a fused plan refuses ----------------------------------------------------------------


@pytest.mark.parametrize("option", ["lora_ranks", "scalings"])
def test_a_tensor_option_is_refused_with_not_implemented(option):
    """``apply`` refuses any of SGLang's options with a fused plan, tensors included (it once died
    comparing a tensor with 0: "Boolean value of Tensor ... is ambiguous")."""
    ranks, scalings = [4, 2, 0], [1.0, 2.0, 3.0]
    runner = make_runner(fused_specs()["per_row/none"], [0, 1, 2], ranks, scalings)
    a, b, offsets = pool((20,), 4, 24, ranks, FP32)
    x = torch.randn(3, 24)
    value = torch.tensor(ranks, dtype=torch.int32) if option == "lora_ranks" else torch.tensor(scalings)
    with pytest.raises(NotImplementedError, match=option):
        runner.apply(x, lambda: torch.zeros(3, 20), runner.plans.rows[0].plan, a=a, b=b, offsets=offsets, **{option: value})


def test_a_one_slot_zero_override_is_not_silently_dropped():
    """A one-element override equal to 0 (``lora_ranks=tensor([0])``) is an option given, not
    SGLang's default 0: refused, not dropped (it once compared equal to 0 and the row got rank 4)."""
    runner = make_runner(fused_specs()["per_row/none"], [0], [4], [1.0])
    a, b, offsets = pool((20,), 4, 24, [4], FP32)
    x = torch.randn(1, 24)
    with pytest.raises(NotImplementedError, match="lora_ranks"):
        runner.apply(x, lambda: torch.zeros(1, 20), runner.plans.rows[0].plan, a=a, b=b, offsets=offsets,
                     lora_ranks=torch.tensor([0], dtype=torch.int32))


def test_an_overlap_given_by_name_is_the_enum():
    """``FusedPlan(overlap="ab_delta")`` holds ``Overlap.AB_DELTA``, which the runner tests by
    identity (a plain string once passed the check and ran as ``none``)."""
    from sglang.srt.lora.dense.plan import Overlap

    from sglang_xpu_lora.dense.fused import FusedPlan

    plan = FusedPlan(overlap="ab_delta")
    assert plan.overlap is Overlap.AB_DELTA and plan.spec()["overlap"] == "ab_delta"


def test_a_bad_overlap_name_raises_value_error():
    """``FusedPlan(overlap="a")`` and an unknown name: the documented ValueError."""
    from sglang_xpu_lora.dense.fused import FusedPlan

    for name in ("a", "sideways"):
        with pytest.raises(ValueError, match="overlaps as"):
            FusedPlan(overlap=name)


@pytest.mark.parametrize(
    "spec",
    [
        {"fused": "per_row", "tiles": {**T16, "BLOCK_SIZE_K": 2**17}},
        {"fused": "per_row", "tiles": {**T16, "BLOCK_SIZE_N": 2**21}},
    ],
    ids=["per_row_block_k_2e17", "per_row_block_n_2e21"],
)
def test_a_tile_past_the_largest_is_refused_when_the_table_is_read(spec):
    """Tiles past ``MAX_TILE`` are refused by ``plan_from_spec`` (so when the table is read, naming
    file and row): a column tile that large passes Triton's 2**20-element tensor limit and would
    fail inside Triton at every call the row matches; the K step, though capped per pool rank by
    the kernel (``shrink_k_tile``), is held to the same bound, so a table names only tiles it runs."""
    from sglang_xpu_lora.dense.plans import plan_from_spec

    with pytest.raises(ValueError, match="up to"):
        plan_from_spec(spec)
