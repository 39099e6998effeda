"""The dense tier (:mod:`sglang_xpu_lora.dense`): SGLang's ``triton_v2`` kernels run by Triton's
interpreter on CPU tensors (``TRITON_INTERPRET=1``, tests/conftest.py), against a float64 loop over
the rows (base GEMM + ``scaling * B_p (A_p x)`` per slice at the slot's real rank).

Every plan family the tables can name (shrink grouped with and without split-K in both split modes,
per-row, all-slots; expand grouped and per-row; overlap none, ``a``, ``ab_delta``; the project's
fused per-row kernel, overlap none and ``ab_delta``), on one, two
(gate/up) and three uneven (q/k/v) slices, fp32 and fp16 (the interpreter multiplies bf16 bit
patterns in ``tl.dot``: triton-lang/triton#11584). The pool holds ranks below the maximum, a rank-0
slot, and stale rank tails (a reused slot: nothing zeroes them for the dense tier), and a slot that
holds NaN everywhere: no row of another adapter may see it, on every plan (the all-slots shrink
reads every slot). Tolerances relative to the reference's largest magnitude: fp32 1e-5, fp16 2e-3
(the kernels accumulate in fp32; fp16 rounds the shrink's output and the output once).
"""

from __future__ import annotations

import json

import pytest
import torch

MAX_RANK, K, SLOTS = 4, 24, 5
RANKS = [0, 2, 4, 3, 4]  # slot 0: the base model (rank 0); slot 4: NaN everywhere
SCALINGS = [0.0, 2.0, 0.5, 1.5, 1.0]
NAN_SLOT = 4
#: Requests: (slot, tokens); an empty request and one on the base slot included.
REQUESTS = [(1, 3), (0, 2), (2, 0), (3, 4), (2, 2)]
SLICES = {"one": (20,), "gate_up": (12, 12), "qkv": (16, 8, 8)}
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}
A_TILES = {"BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 16, "GROUP_SIZE_M": 8, "num_warps": 4, "num_stages": 1}
B_TILES = {"BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 16, "GROUP_SIZE_M": 8, "num_warps": 4, "num_stages": 1}
#: The fused kernel's tiles: 16 columns (a tail tile on the 20-wide slice), 16 of K = 24 per step (a tail step).
FUSED_TILES = {"BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 16, "num_warps": 4, "num_stages": 1}
#: Every family pairing and overlap a plan row can name (all-slots shrink: per-row expand only).
PLANS = {
    "grouped/grouped/none": dict(a_family="grouped", b_family="grouped", overlap="none"),
    "grouped-splitk-serial/grouped/a": dict(a_family="grouped", b_family="grouped", overlap="a", a_tiles={**A_TILES, "SPLIT_K": 2}),
    "grouped-splitk-planes/per_row/ab_delta": dict(
        a_family="grouped", b_family="per_row", overlap="ab_delta", a_tiles={**A_TILES, "SPLIT_K": 2, "SPLIT_MODE": "planes"}
    ),
    "grouped/grouped/ab_delta": dict(a_family="grouped", b_family="grouped", overlap="ab_delta"),
    "per_row/per_row/a": dict(a_family="per_row", b_family="per_row", overlap="a"),
    "per_row/grouped/none": dict(a_family="per_row", b_family="grouped", overlap="none"),
    "all_slots/per_row/ab_delta": dict(a_family="all_slots", b_family="per_row", overlap="ab_delta"),
    "all_slots/per_row/none": dict(a_family="all_slots", b_family="per_row", overlap="none"),
    "fused-per-row/none": dict(fused="per_row", tiles=FUSED_TILES, overlap="none"),
    "fused-per-row/ab_delta": dict(fused="per_row", tiles=FUSED_TILES, overlap="ab_delta"),
}


@pytest.fixture(autouse=True)
def interpreter():
    import triton

    assert triton.knobs.runtime.interpret, "TRITON_INTERPRET=1 must be set before SGLang's kernels are imported"


def spec(name: str) -> dict:
    if "fused" in PLANS[name]:
        return dict(PLANS[name])
    return {"a_tiles": A_TILES, "b_tiles": B_TILES, "block_size": 16, **PLANS[name]}


def pool(slices, dtype, seed=0, nan_tails=False):
    """A ``(slots, stacks * max_rank, K)`` and B ``(slots, N, max_rank)`` in SGLang's packed layout,
    rank tails stale (random; NaN with ``nan_tails``), the NaN slot all NaN."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(SLOTS, len(slices) * MAX_RANK, K, generator=gen) * 0.5
    b = torch.randn(SLOTS, sum(slices), MAX_RANK, generator=gen) * 0.5
    if nan_tails:  # what no kernel may read: A's rows past the packed slices, B's columns past the rank
        for slot, rank in enumerate(RANKS):
            a[slot, len(slices) * rank :], b[slot, :, rank:] = float("nan"), float("nan")
    a[NAN_SLOT], b[NAN_SLOT] = float("nan"), float("nan")
    return a.to(dtype), b.to(dtype)


def slot_of_row(requests):
    return [slot for slot, tokens in requests for _ in range(tokens)]


def reference(x, weight, a, b, slices, rows):
    """float64: ``x W^T`` plus, per row of a slot with rank ``r > 0``, ``scaling * B_p (A_p x)`` for
    each slice ``p`` (``A_p``: rows ``[p r, (p + 1) r)``; ``B_p``: its band's first ``r`` columns)."""
    bounds = [0]
    for width in slices:
        bounds.append(bounds[-1] + width)
    out = x.double() @ weight.double().t()
    for row, slot in enumerate(rows):
        rank = RANKS[slot]
        for p in range(len(slices)):
            if rank:
                shrink = a[slot, p * rank : (p + 1) * rank].double() @ x[row].double()
                band = b[slot, bounds[p] : bounds[p + 1], :rank].double()
                out[row, bounds[p] : bounds[p + 1]] += SCALINGS[slot] * (band @ shrink)
    return out


def batch_info(requests):
    """SGLang's request view of the batch (what ``TritonLoRABackend.prepare_lora_batch`` builds)."""
    from sglang.srt.lora.utils import LoRABatchInfo

    lens = torch.tensor([tokens for _, tokens in requests], dtype=torch.int32)
    seg_indptr = torch.zeros(len(requests) + 1, dtype=torch.int32)
    seg_indptr[1:] = torch.cumsum(lens, 0)
    return LoRABatchInfo(
        use_cuda_graph=False, bs=len(requests), num_segments=len(requests), seg_indptr=seg_indptr,
        weight_indices=torch.tensor([slot for slot, _ in requests], dtype=torch.int32),
        lora_ranks=torch.tensor(RANKS, dtype=torch.int32), scalings=torch.tensor(SCALINGS, dtype=torch.float32),
        max_len=max(1, int(lens.max())), seg_lens=lens, permutation=None,
    )


def runner_for(plan_name, rows=None):
    from sglang_xpu_lora.dense.plans import PlanRow, PlanTable
    from sglang_xpu_lora.dense.runner import DeviceDenseRunner
    from sglang_xpu_lora.dense.workspace import DeviceLoraWorkspace

    plan_rows = [PlanRow({"name": plan_name, "spec": spec(plan_name)})] if rows is None else rows
    runner = DeviceDenseRunner(DeviceLoraWorkspace(), max_loras=SLOTS, device=torch.device("cpu"))
    runner.plans = PlanTable(torch.device("cpu"), "default", rows=plan_rows)
    return runner


def run_linear(runner, requests, slices, dtype, *, phase="prefill", all_reduce=None, seed=1, nan_tails=False):
    from sglang.srt.lora.dense.plan import DenseLoraKind
    from sglang.srt.lora.utils import Phase

    rows = slot_of_row(requests)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(len(rows), K, generator=gen).to(dtype)
    weight = (torch.randn(sum(slices), K, generator=gen) * 0.3).to(dtype)
    a, b = pool(slices, dtype, nan_tails=nan_tails)
    runner.begin_lora_batch(batch_info(requests), requests=len(requests), num_tokens=len(rows), phase=Phase(phase), graph=False)
    offsets = (0, *torch.tensor(slices).cumsum(0).tolist())
    plan = runner.plan_for(DenseLoraKind.LINEAR, MAX_RANK, K, offsets[-1], num_tokens=len(rows))
    out = runner.apply(x, lambda: x @ weight.t(), plan, a=a, b=b, offsets=offsets, all_reduce=all_reduce)
    return out, reference(x, weight, a, b, slices, rows), rows


def assert_rows_close(out, ref, rows, dtype):
    scale = ref[torch.isfinite(ref).all(1)].abs().max()
    error = (out.double() - ref).abs().max(dim=1).values / scale
    assert torch.isfinite(out[rows]).all(), "non-finite output on a row"
    assert float(error.max()) <= TOLERANCE[dtype], f"relative error {float(error.max()):.3g} per row {error.tolist()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("slices", list(SLICES), ids=list(SLICES))
@pytest.mark.parametrize("plan_name", list(PLANS))
def test_every_plan_equals_the_float64_loop(plan_name, slices, dtype):
    """Ranks below the maximum, rank 0, an empty request, stale rank tails: exact on every row."""
    out, ref, rows = run_linear(runner_for(plan_name), REQUESTS, SLICES[slices], dtype)
    assert_rows_close(out, ref, list(range(len(rows))), dtype)


@pytest.mark.parametrize("plan_name", list(PLANS))
def test_a_nan_adapter_reaches_no_other_row(plan_name):
    """A slot holding NaN (also read, as a whole, by the all-slots shrink) spoils only the rows of
    its own request; every other row, base rows included, equals the loop."""
    requests = [(1, 2), (NAN_SLOT, 2), (0, 1), (3, 3)]
    out, ref, rows = run_linear(runner_for(plan_name), requests, SLICES["qkv"], torch.float32)
    others = [i for i, slot in enumerate(rows) if slot != NAN_SLOT]
    assert_rows_close(out[others], ref[others], list(range(len(others))), torch.float32)
    assert torch.isnan(out[[i for i, slot in enumerate(rows) if slot == NAN_SLOT]]).any()


@pytest.mark.parametrize("plan_name", list(PLANS))
def test_nan_past_a_slots_real_rank_is_never_read(plan_name):
    """A reused slot's stale tail (A's rows past its packed slices, B's columns past its rank) may
    hold anything, NaN included: no plan reads it, so every row equals the loop."""
    out, ref, rows = run_linear(runner_for(plan_name), REQUESTS, SLICES["qkv"], torch.float32, nan_tails=True)
    assert_rows_close(out, ref, list(range(len(rows))), torch.float32)


def test_the_nan_check_catches_a_leak():
    """The isolation check above fails when a NaN does reach another row."""
    out, ref, rows = run_linear(runner_for("grouped/grouped/none"), [(1, 2), (3, 2)], SLICES["one"], torch.float32)
    out[0, 0] = float("nan")
    with pytest.raises(AssertionError, match="non-finite"):
        assert_rows_close(out, ref, list(range(len(rows))), torch.float32)


def test_a_long_prefill_routes_without_the_cuda_only_alignment_kernel():
    """Above 512 routed rows SGLang calls a CUDA JIT kernel; the tier uses its Triton large builder."""
    from sglang_xpu_lora.dense.runner import SMALL_ROUTE_ROWS

    requests = [(1, 300), (2, 200), (0, 50), (3, 40)]
    assert sum(t for _, t in requests) > SMALL_ROUTE_ROWS
    out, ref, rows = run_linear(runner_for("grouped/grouped/none"), requests, SLICES["one"], torch.float32)
    assert_rows_close(out, ref, list(range(len(rows))), torch.float32)


@pytest.mark.parametrize("plan_name", ["grouped/grouped/none", "fused-per-row/none", "fused-per-row/ab_delta"])
def test_row_parallel_makes_one_collective_of_base_plus_lora(plan_name):
    """At TP > 1 a row-parallel linear reduces once, base and LoRA summed (B is replicated)."""
    reduced = []

    def all_reduce(t):
        reduced.append(t.clone())
        return t * 2  # two ranks holding the same shard

    out, ref, _ = run_linear(runner_for(plan_name), REQUESTS, SLICES["one"], torch.float32, all_reduce=all_reduce)
    assert len(reduced) == 1
    torch.testing.assert_close(reduced[0].double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), 2 * ref, rtol=1e-5, atol=1e-5)


# --- plan tables -------------------------------------------------------------------------------


def test_first_matching_row_wins_and_sglang_table_is_the_fallback(tmp_path):
    from sglang.srt.lora.dense.plan import AFamily, DenseLoraKind, DensePlanTable, Overlap
    from sglang.srt.lora.utils import Phase

    from sglang_xpu_lora.dense.plans import PlanRow, PlanTable

    rows = [
        PlanRow({"name": "small", "phase": "decode", "max_tokens": 8, "max_in_features": 4096, "spec": spec("per_row/per_row/a")}),
        PlanRow({"name": "any-decode", "phase": "decode", "max_rank": 16, "spec": spec("all_slots/per_row/ab_delta")}),
    ]
    table = PlanTable(torch.device("cpu"), "default", rows=rows)
    linear, decode, prefill = DenseLoraKind.LINEAR, Phase.DECODE, Phase.PREFILL
    assert table.plan_for(linear, decode, 8, 64, 4096, 6144).a_family is AFamily.PER_ROW
    assert table.plan_for(linear, decode, 9, 16, 4096, 6144).overlap is Overlap.AB_DELTA
    assert table.plan_for(linear, decode, 1, 16, 8192, 6144).a_family is AFamily.ALL_SLOTS
    # no own row: SGLang's table for the architecture, exactly
    for tokens, rank in ((9, 64), (300, 64)):
        expected = DensePlanTable("default", rank).plan_for(linear, decode, tokens, 4096, 6144)
        assert table.plan_for(linear, decode, tokens, rank, 4096, 6144) == expected
    assert table.plan_for(linear, prefill, 4, 16, 4096, 6144) == DensePlanTable("default", 16).plan_for(linear, prefill, 4, 4096, 6144)


def test_the_plans_variable_names_a_table_read_before_the_shipped_ones(tmp_path, monkeypatch):
    from sglang.srt.lora.dense.plan import AFamily, DenseLoraKind
    from sglang.srt.lora.utils import Phase

    from sglang_xpu_lora.dense.plans import PlanTable
    from sglang_xpu_lora.settings import PLANS_ENV

    path = tmp_path / "mine.plans.json"
    path.write_text(json.dumps({"rows": [{"name": "mine", "spec": spec("per_row/grouped/none")}]}))
    monkeypatch.setenv(PLANS_ENV, str(path))
    table = PlanTable(torch.device("cpu"), "default")
    assert table.sources[0] == f"{PLANS_ENV}={path}"
    assert table.plan_for(DenseLoraKind.LINEAR, Phase.PREFILL, 4096, 64, 4096, 4096).a_family is AFamily.PER_ROW


@pytest.mark.parametrize(
    "row, message",
    [
        ({"name": "bad", "spec": {"a_family": "all_slots", "b_family": "grouped"}}, "only per_row B reads planes"),
        ({"name": "bad", "max_tokens": -1}, "max_tokens must be a non-negative integer"),
        ({"name": "bad", "min_tokens": 4}, "unknown keys"),
        ({"name": "bad", "spec": {"overlap": "sideways"}}, "sideways"),
        ({"name": "bad", "spec": {"fused": "per_row", "tiles": {**FUSED_TILES, "BLOCK_SIZE_N": 24}}}, "power of two"),
        ({"name": "bad", "spec": {"fused": "per_row", "tiles": {"BLOCK_SIZE_N": 16}}}, "fused tiles need exactly"),
        ({"name": "bad", "spec": {"fused": "per_row", "tiles": FUSED_TILES, "overlap": "a"}}, "a fused plan overlaps as"),
        ({"name": "bad", "spec": {"fused": "per_row", "tiles": FUSED_TILES, "block_size": 16}}, "a fused spec takes"),
        # the retired grouped form, as the sweep wrote its rows
        ({"name": "bad", "spec": {"fused": "grouped", "tiles": FUSED_TILES, "block_size": 16, "overlap": "ab_delta"}},
         r"form is one of \['per_row'\], not 'grouped'"),
        ({"name": "bad", "spec": {"fused": "sideways", "tiles": FUSED_TILES}}, "form is one of"),
        ({"name": "bad", "spec": {"fused": "per_row", "tiles": FUSED_TILES, "a_tiles": {}}}, "a fused spec takes"),
    ],
)
def test_a_bad_table_row_is_refused_naming_file_and_row(tmp_path, monkeypatch, row, message):
    from sglang_xpu_lora.dense.plans import PlanTable
    from sglang_xpu_lora.settings import PLANS_ENV

    path = tmp_path / "bad.plans.json"
    path.write_text(json.dumps({"rows": [row]}))
    monkeypatch.setenv(PLANS_ENV, str(path))
    with pytest.raises(ValueError, match=message) as caught:
        PlanTable(torch.device("cpu"), "default")
    assert str(path) in str(caught.value) and "'bad'" in str(caught.value)


def test_a_fused_plan_refuses_what_only_sglangs_plans_serve():
    """The fused kernel serves plain linears; an embedding shrink, windowed or shared-bridge call
    with a fused plan is refused, not run wrongly."""
    from sglang.srt.lora.utils import Phase

    runner = runner_for("fused-per-row/none")
    runner.begin_lora_batch(batch_info(REQUESTS), requests=len(REQUESTS), num_tokens=11, phase=Phase.DECODE, graph=False)
    a, b = pool(SLICES["one"], torch.float32)
    x = torch.zeros(11, K)
    with pytest.raises(NotImplementedError, match="bridge_slices"):
        runner.apply(x, lambda: torch.zeros(11, 20), runner.plans.rows[0].plan, a=a, b=b, offsets=(0, 20), bridge_slices=2)


def test_a_missing_table_file_is_refused(tmp_path, monkeypatch):
    from sglang_xpu_lora.dense.plans import PlanTable
    from sglang_xpu_lora.settings import PLANS_ENV

    monkeypatch.setenv(PLANS_ENV, str(tmp_path / "none.json"))
    with pytest.raises(ValueError, match="none.json"):
        PlanTable(torch.device("cpu"), "default")


def test_the_shipped_tables_load():
    from sglang_xpu_lora.dense.plans import CONFIG_DIR, read_rows

    tables = sorted(CONFIG_DIR.glob("*.plans.json"))
    assert tables, "no shipped plan table"
    for path in tables:
        assert read_rows(path), path


# --- slice geometry ----------------------------------------------------------------------------


def test_slice_geometry_follows_sglangs_rules():
    from sglang_xpu_lora.dense.geometry import build_slice_geometry

    qkv = build_slice_geometry((0, 4096, 5120, 6144), 128, torch.device("cpu"))
    assert qkv.slice_offsets.tolist() == [0, 4096, 5120, 6144] and qkv.out_offsets.tolist() == [0, 4096, 5120]
    assert (qkv.num_slices, qkv.num_column_tiles, qkv.uniform_width, qkv.out_stride, qkv.full_tiles) == (3, 48, 0, 0, True)
    gate_up = build_slice_geometry((0, 100, 200), 64, torch.device("cpu"))
    assert (gate_up.num_column_tiles, gate_up.uniform_width, gate_up.out_stride, gate_up.full_tiles) == (4, 100, 100, False)
    assert gate_up.slice_offsets.dtype == torch.int32 and gate_up.block_size_n == 64
    for bad in ((0,), (1, 4), (0, 4, 4)):
        with pytest.raises(ValueError, match="increasing int32 prefixes"):
            build_slice_geometry(bad, 64, torch.device("cpu"))
    with pytest.raises(ValueError, match="power of two"):
        build_slice_geometry((0, 8), 48, torch.device("cpu"))


# --- the workspace -----------------------------------------------------------------------------


def test_overlap_runs_in_order_without_streams():
    from sglang_xpu_lora.dense.workspace import DeviceLoraWorkspace, fork_join_captures

    order = []
    result = DeviceLoraWorkspace().run_parallel(
        name="t", device=torch.device("cpu"), compute=lambda: order.append("base") or 7, side=lambda: order.append("lora")
    )
    assert (result, order) == (7, ["lora", "base"])
    assert fork_join_captures(torch.device("cpu")) is False


def test_the_fused_shrink_caps_its_k_step_to_keep_the_a_tile_in_registers():
    """At most 32 fp32 values of A per thread (no spill at pool rank 64 in sm90 compiles), at least 16."""
    from sglang_xpu_lora.dense.fused import shrink_k_tile

    assert shrink_k_tile(512, 16, 4) == 256 and shrink_k_tile(512, 16, 8) == 512
    assert shrink_k_tile(512, 64, 4) == 64 and shrink_k_tile(128, 64, 8) == 128
    assert shrink_k_tile(64, 4, 4) == 64 and shrink_k_tile(512, 1024, 1) == 16
