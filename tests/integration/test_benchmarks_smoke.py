"""Tiny runs of the benchmarks the measurement kit does not run (seconds each), so they never rot:
the host overhead benchmark's count of added device-to-host synchronisations (it must be zero) and
the CPU end-to-end benchmark's ratio. The op benchmark, the sync-cost benchmark and the capture
probe run once, in the kit's quick run, and are checked there (tests/integration/test_kit.py). No
timing is asserted."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_benchmark(module, out, *args, **env_vars):
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", **env_vars}
    result = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", "--quick", "--out", str(out), *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.launches
def test_host_overhead_adds_no_device_syncs(tmp_path):
    run_benchmark("host_overhead", tmp_path)
    rows = json.loads((tmp_path / "host_overhead-cpu-quick.json").read_text())["rows"]
    assert [r["batch_size"] for r in rows] == [1, 16, 256]
    assert all(r["added_syncs"] == 0 and r["intel_xpu_syncs"] == 0 for r in rows)


@pytest.mark.e2e
def test_e2e_cpu(tmp_path):
    run_benchmark("e2e_cpu", tmp_path, "--artifacts", str(tmp_path / "artifacts"))
    rows = json.loads((tmp_path / "e2e-cpu-quick.json").read_text())["rows"]
    assert rows
    for r in rows:
        assert math.isfinite(r["intel_xpu_tok_s"]) and math.isfinite(r["torch_native_tok_s"]), r
        assert math.isclose(r["ratio"], r["intel_xpu_tok_s"] / r["torch_native_tok_s"]), r


@pytest.mark.e2e
def test_scale(tmp_path, tiny_artifacts):
    """``benchmarks.scale --quick``: one server per backend (``intel_xpu``, ``torch_native``), 2 then
    3 adapters over 2 slots (every third adapter evicts one), 2 requests in flight. Every row is
    there with finite timings, each sampled output equals transformers + PEFT, and the loads and
    the memory were measured (values not asserted: a smoke run). It builds its adapters next to the
    session's tiny Llama (reused, not built again). About 90 s of CPU time, most of it the two server
    start-ups (85-180 s wall on the shared 2-core machine under a load of 2-5)."""
    run_benchmark("scale", tmp_path, "--artifacts", str(tiny_artifacts["base"].parent), "--log-dir", str(tmp_path))
    payload = json.loads((tmp_path / "scale-cpu-quick.json").read_text())
    rows = payload["rows"]
    assert [(r["backend"], r["adapters"], r["slots"], r["in_flight"], r["requests"]) for r in rows] == [
        (backend, k, 2, 2, 4) for backend in ("intel_xpu", "torch_native") for k in (2, 3)
    ]
    for r in rows:
        assert 0 < r["ttft_p50_s"] <= r["ttft_p95_s"] <= r["latency_max_s"], r
        assert math.isfinite(r["tok_s"]) and r["tok_s"] > 0, r
        assert r["load_ms_median"] > 0 and math.isfinite(r["rss_mib_per_adapter"]), r
    for backend in ("intel_xpu", "torch_native"):
        checked = [r for r in rows if r["backend"] == backend]
        assert sum(r["checked"] for r in checked) == 2, checked
        assert all(r["exact"] == r["checked"] for r in checked), checked
    assert (tmp_path / "scale-cpu-quick.png").stat().st_size > 0  # the plot


@pytest.mark.launches
def test_slot_cost(tmp_path):
    """``benchmarks.slot_cost --quick``: both phases at S = 8 and 16; the aten calls the plugin adds
    to a batch are the same at both (tests/integration/test_slot_cost.py has the counts' own test)."""
    run_benchmark("slot_cost", tmp_path)
    rows = json.loads((tmp_path / "slot-cost-cpu-quick.json").read_text())["rows"]
    assert [(r["phase"], r["slots"]) for r in rows] == [(p, s) for p in ("decode", "prefill") for s in (8, 16)]
    for phase in ("decode", "prefill"):
        assert len({r["aten_ops_added"] for r in rows if r["phase"] == phase}) == 1, rows
    assert all(math.isfinite(r["layer_us"]) and r["graph_setup_ms"] is not None for r in rows if r["phase"] == "decode")


def test_scale_reloads_inside_every_workload_not_only_the_long_ones(monkeypatch):
    """``benchmarks.scale --churn``: the first reload comes ``--churn-first`` seconds into a workload,
    not ``--churn`` seconds, which put reloads only in the workloads that lasted longer (the slow
    ones) and read as a cost of the reload. Counted with the HTTP calls replaced: no server, no timing."""
    import threading

    from sglang_cpu_devsupport import serving

    from benchmarks import scale

    calls, reloaded = [], threading.Event()
    monkeypatch.setattr(serving, "post_json", lambda url, body, timeout=None: calls.append(url.rsplit("/", 1)[1]))

    def generate(url, ids, lora, new_tokens):
        reloaded.set()
        return {"latency": 0.5}

    monkeypatch.setattr(scale, "streamed_generate", generate)
    stop = threading.Event()
    worker = threading.Thread(target=lambda: calls.append(scale.churn("http://x", None, 3600.0, stop, 4, 2, first=0.0)))
    worker.start()
    try:
        assert reloaded.wait(60), "no reload before --churn seconds"
    finally:
        stop.set()  # ends the churn thread whatever happened (it would otherwise wait out --churn)
        worker.join(60)
    assert calls[:2] == ["unload_lora_adapter", "load_lora_adapter"] and calls[-1] == [0.5]

    # --churn-no-reload: the churned adapter's requests alone, no unload or load.
    calls.clear()
    stop = threading.Event()
    reloaded.clear()
    worker = threading.Thread(target=lambda: calls.append(scale.churn("http://x", None, 3600.0, stop, 4, 2, first=0.0, reload=False)))
    worker.start()
    try:
        assert reloaded.wait(60), "no request before --churn seconds"
    finally:
        stop.set()
        worker.join(60)
    assert calls == [[0.5]]

    # The workload hands the mode to the churn thread, and the option is refused without --churn.
    seen = {}

    def churn(url, path, every, stop, prompt_len, new_tokens, first, reload):
        seen["reload"] = reload
        return []

    monkeypatch.setattr(scale, "churn", churn)
    monkeypatch.setattr(scale, "streamed_generate", lambda url, ids, lora, new_tokens: {"ttft": 0.1, "latency": 0.2, "output_ids": [1]})
    row = scale.run_workload("http://x", 2, 2, 2, 4, 1, seed=0, churn_every=1.0, churn_reload=False)
    assert seen == {"reload": False} and row["reloads"] == 0 and row["churn_requests"] == 0
    with pytest.raises(SystemExit):
        scale.main(["--churn-no-reload"])


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_every_plan_sweep_candidate_is_a_valid_plan_with_its_own_label(phase):
    """The sweep's candidates (SGLang's families and the fused kernel) each parse as a table row's
    spec, and their labels, which the results and plan_refine key on, are distinct."""
    from benchmarks.plan_sweep import candidates, spec_label, spec_of

    from sglang_xpu_lora.dense.plans import plan_from_spec

    specs = candidates(phase)
    assert len({spec_label(spec) for spec in specs}) == len(specs)
    for spec in specs:
        assert spec_of(plan_from_spec(spec)) == spec
    fused = candidates(phase, families="fused")
    assert bool(fused) == (phase == "decode") and all("fused" in spec for spec in fused)
    assert candidates(phase, families="sglang") + fused == specs


@pytest.mark.parametrize("quick", [False, True], ids=["grid", "quick"])
def test_plan_refine_tries_the_sweeps_fastest_plans_fused_ones_included(quick):
    """The whole-layer refinement takes the sweep's ranking by label, for the candidate set the
    sweep ran (``--quick`` has its own small tiles), fused plans included, without repeats."""
    import types

    import torch

    from benchmarks.ops import TINY
    from benchmarks.plan_refine import alternatives
    from benchmarks.plan_sweep import candidates, spec_label

    from sglang_xpu_lora.dense.fused import FusedPlan
    from sglang_xpu_lora.dense.plans import PlanTable

    specs = candidates("decode", quick)
    fused = [spec for spec in specs if "fused" in spec][:2]
    ranking = {(TINY.name, "qkv", 16, 8): [spec_label(spec) for spec in (*fused, fused[0])]}
    args = types.SimpleNamespace(phase="decode", quick=quick, top=3, architecture="sm90")
    table = PlanTable(torch.device("cpu"), "default", rows=[])
    found = alternatives(TINY, "qkv", 16, 8, table, ranking, args)
    assert [name for name, _ in found][2:] == [spec_label(spec) for spec in fused]
    assert all(isinstance(plan, FusedPlan) for _, plan in found[2:])


def test_plan_refine_merges_the_rankings_of_several_sweeps(tmp_path):
    """An earlier full sweep and a sweep of new candidates rank together, per point, by time."""
    from benchmarks.plan_refine import sweep_ranking

    def sweep(name, candidates, phase="decode"):
        point = dict(model="m", linear="qkv", pool_rank=16, tokens=1, phase=phase)
        (tmp_path / name).write_text(json.dumps({"points": [{"point": point, "candidates": candidates}]}))
        return tmp_path / name

    old = sweep("old.json", [dict(label="a|x", us=5.0), dict(label="a|y", us=3.0), dict(label="a|z", failed="error")])
    new = sweep("new.json", [dict(label="none|f", us=4.0), dict(label="a|x", us=2.0)])
    other = sweep("prefill.json", [dict(label="none|p", us=1.0)], phase="prefill")
    ranking = sweep_ranking([old, new, other], "decode")
    assert ranking == {("m", "qkv", 16, 1): ["a|x", "a|y", "none|f"]}
    with pytest.raises(FileNotFoundError, match="missing.json .*untar"):
        sweep_ranking([old, tmp_path / "missing.json"], "decode")


def test_plan_refine_leaves_out_the_retired_candidates_of_the_committed_sweeps(capsys):
    """The committed fused sweep also ranks the retired grouped fused kernel: plan_refine over it
    (``--sweep benchmarks/results/plan-sweep-cuda{,-fused,-sglang}.json``) notes and leaves out
    those candidates, and builds every alternative of every point, however many it tries."""
    import types

    import torch

    from benchmarks.common import MODELS, RESULTS
    from benchmarks.plan_refine import alternatives, sweep_ranking
    from benchmarks.plan_sweep import candidates, spec_label

    from sglang_xpu_lora.dense.plans import PlanTable

    labels = {spec_label(spec) for spec in candidates("decode")}
    paths = [RESULTS / f"plan-sweep-cuda{suffix}.json" for suffix in ("", "-fused", "-sglang")]
    ranking = sweep_ranking(paths, "decode", labels)
    assert "fused:grouped" in capsys.readouterr().out
    assert ranking and all(set(ranked) <= labels for ranked in ranking.values())
    args = types.SimpleNamespace(phase="decode", quick=False, top=len(labels), architecture="sm90")
    table = PlanTable(torch.device("cpu"), "default", rows=[])
    for model, linear, pool_rank, tokens in ranking:
        assert alternatives(MODELS[model], linear, pool_rank, tokens, table, ranking, args)


def test_the_sweep_can_try_only_some_overlaps():
    from benchmarks.plan_sweep import candidates

    in_order = candidates("decode", families="sglang", overlaps=["none"])
    assert in_order and all(spec["overlap"] == "none" and "fused" not in spec for spec in in_order)
    assert {spec["overlap"] for spec in candidates("decode")} == {"none", "a", "ab_delta"}


@pytest.mark.parametrize("subset", [["--candidates", "fused"], ["--tokens", "1", "8"], ["--overlaps", "none"], ["--phases", "decode"]])
def test_a_partial_sweep_does_not_replace_the_shipped_table(subset, capsys):
    """Only a full sweep may write the shipped table (it is written whole from the winners): a
    partial one without --out is refused before it measures anything."""
    from benchmarks.plan_sweep import main

    with pytest.raises(SystemExit) as exit_info:
        main(subset)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert subset[0] in error and "would replace the shipped plan table" in error and "give --out" in error


def test_a_sweep_that_spells_out_the_full_grid_is_full():
    import types

    from benchmarks.plan_sweep import DECODE_TOKENS, partial_sweep

    args = dict(models=None, phases=None, tokens=None, prefill_tokens=None, pool_ranks=None, overlaps=None,
                candidates="all", shard="0/1")
    assert partial_sweep(types.SimpleNamespace(**args)) == []
    spelled = {**args, "phases": ["prefill", "decode"], "tokens": list(DECODE_TOKENS)}
    assert partial_sweep(types.SimpleNamespace(**spelled)) == []
    assert partial_sweep(types.SimpleNamespace(**{**spelled, "tokens": [1, 8]})) == ["--tokens"]
