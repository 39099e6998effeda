"""The measurement kit (benchmarks/kit.py, behind examples/xpu/measure.sh) on CPU in ``--quick``
mode, through the same steps as on an Intel GPU: the report has every section, every step's status
is recorded, the ratios it prints are the quotients of the timings in the steps' own JSON, and a
step that fails or runs out of time is reported while the other steps still run. The quick run is
also the smoke run of the benchmarks it steps through (each once per suite, so they never rot):
the op benchmark's tiers are measured (finite numbers) with the ratios it prints the quotients of
its timings and the Triton tier's output within 1e-5 of the float64 reference, the sync-cost
benchmark counts the native ops' host reads, and the capture probe on CPU tries nothing and matches
the reference. No timing is asserted."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SECTIONS = ("## Machine", "## Steps", "## Doctor", "## Capture probe", "## Op benchmark", "## Layer benchmark", "## Serving",
            "## Sync cost",
            "## Raw results")


def run_kit(out: Path, *args: str, **env_vars) -> tuple[subprocess.CompletedProcess, str, dict]:
    """``python -m benchmarks.kit --device cpu --quick --out OUT ARGS``: (result, report text, kit.json)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_XPU_LORA")}
    env.update({"SGLANG_USE_CPU_ENGINE": "1", **env_vars})
    result = subprocess.run([sys.executable, "-m", "benchmarks.kit", "--device", "cpu", "--quick", "--out", str(out), *args],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    return result, (out / "sglang-xpu-lora-report.md").read_text(), json.loads((out / "kit.json").read_text())


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """The kit's CPU smoke run, with the intel_xpu tier through Triton's interpreter (TRITON_INTERPRET=1,
    tests/conftest.py) as the op benchmark's own smoke test runs it."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    out = tmp_path_factory.mktemp("kit")
    return out, *run_kit(out, SGLANG_XPU_LORA_KERNELS="triton")


@pytest.mark.launches
def test_every_step_runs_and_the_report_has_every_section(quick_run):
    out, result, report, kit = quick_run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    statuses = {s["name"]: s["status"] for s in kit["steps"]}
    assert statuses == {"doctor": "ok", "capture_probe": "ok", "ops": "ok", "layer": "ok", "sync_cost": "ok", "serving": "skipped"}
    positions = [report.index(section) for section in SECTIONS]
    assert positions == sorted(positions), "sections out of order"
    for step in kit["steps"]:
        assert f"| {step['name']} | {step['status']} |" in report
        for name in step["files"]:
            assert f"<summary>{name}</summary>" in report  # the raw JSON, embedded
    serving = next(s for s in kit["steps"] if s["name"] == "serving")
    assert "give --model and --adapters" in serving["error"] and serving["error"] in report
    assert "- can_serve: True" in report and "| chunked_sgmv_lora_expand_fwd | triton | triton |" in report
    assert "Device cpu, all checks passed: True" in report


@pytest.mark.launches
def test_op_ratios_are_the_quotients_of_the_benchmark_timings(quick_run):
    out, _, report, _ = quick_run
    rows = json.loads((out / "ops-cpu-quick.json").read_text())["rows"]
    assert len(rows) == 3 and {r["real_rank"] for r in rows} == {8, 16}  # adapters below max_lora_rank 16
    ratios = [r["intel_xpu_eager_ms"] / r["triton_backend_ms"] for r in rows]
    for r, ratio in zip(rows, ratios):  # the ratio table: the point, then "backend: intel_xpu / triton (eager)"
        point = " | ".join(str(r[k]) for k in ("model", "mode", "rank", "real_rank", "adapters", "tokens", "dtype"))
        assert f"| {point} | {ratio:.3g} |" in report, (r, ratio)
    within = sum(ratio <= 1.1 for ratio in ratios)
    assert f"- backend: intel_xpu / triton (eager): {within}/3 points within 1.1x, worst {max(ratios):.3g}" in report
    sync_rows = json.loads((out / "sync-cost-cpu-quick.json").read_text())["rows"]
    assert [r["tokens"] for r in sync_rows] == [1, 4] and all(f"| {r['tokens']} | 1 | 84 |" in report for r in sync_rows)


@pytest.mark.launches
def test_op_benchmark_measures_every_tier(quick_run):
    """With TRITON_INTERPRET=1 (tests/conftest.py) and SGLANG_XPU_LORA_KERNELS=triton the quick run
    includes the intel_xpu tier through SGLang's Triton kernels on a tiny layer, adapters at and
    below max_lora_rank; its output matches the float64 reference, as the portable tier's does."""
    out = quick_run[0]
    results = json.loads((out / "ops-cpu-quick.json").read_text())
    rows = results["rows"]
    assert len(rows) == 3 and {r["real_rank"] for r in rows} == {8, 16}
    for r in rows:
        assert math.isfinite(r["portable_ms"]) and math.isfinite(r["torch_native_ms"]), r
        assert math.isclose(r["speedup_vs_torch_native"], r["torch_native_ms"] / r["portable_ms"]), r
    assert all(math.isfinite(r["intel_xpu_ms"]) and r["intel_xpu_max_error"] < 1e-5 for r in rows)
    assert all(math.isfinite(r["intel_xpu_eager_ms"]) and r["intel_xpu_eager_max_error"] < 1e-5 for r in rows)  # the backend's run_* methods
    assert all(math.isfinite(r["triton_backend_ms"]) for r in rows)
    assert {p["eager"] for p in results["intel_xpu_providers"].values()} == {"triton"}
    assert (out / "ops-cpu-quick.md").read_text().count("\n") >= 5
    assert (out / "ops-cpu-quick.png").stat().st_size > 1000


@pytest.mark.launches
def test_sync_cost_counts_the_native_ops_host_reads(quick_run):
    """The stand-in makes the host reads the research notes list per sgl-kernel-xpu op (counted
    through the aten ops behind them: 21 per module on the decode path), and reports their cost as
    the difference of the two paths' timings."""
    rows = json.loads((quick_run[0] / "sync-cost-cpu-quick.json").read_text())["rows"]
    assert [r["tokens"] for r in rows] == [1, 4]
    for r in rows:
        assert r["syncs_per_step"] == r["reads_counted_per_step"] == 4 * 21 * r["layers"], r
        assert math.isfinite(r["triton_ms"]) and math.isfinite(r["synced_ms"]), r
        assert math.isclose(r["added_ms"], r["synced_ms"] - r["triton_ms"]), r
        assert math.isclose(r["step_ratio"], r["synced_ms"] / r["triton_ms"]), r


@pytest.mark.launches
def test_capture_probe_on_cpu_tries_nothing_and_matches_the_reference(quick_run):
    """The device evidence script's CPU run: no device graphs, so no op is tried and none runs
    natively inside graphs; the layer through the graph table matches the float64 reference."""
    report = json.loads((quick_run[0] / "capture-probe-cpu.json").read_text())
    assert report["ok"] and [b["build"] for b in report["builds"]] == ["full", "full-syncfree"]
    for build in report["builds"]:
        assert set(build["eager"].values()) == {"native"} and set(build["graph"].values()) == {"torch"}
        assert len(build["trials"]) == 14 and not any(t["capture_safe"] for t in build["trials"])
        assert all(t["reason"].startswith("not tried: cpu has no device graphs") for t in build["trials"])
        assert all(layer["vs_float64"] < 1e-5 for layer in build["layers"])


@pytest.mark.launches
def test_a_failing_step_is_reported_and_the_next_steps_run(tmp_path):
    """An invalid SGLANG_XPU_LORA_KERNELS: doctor still reports (the problem listed), the op benchmark
    fails with the error, and the report is written with both; the kit's exit status is 1."""
    result, report, kit = run_kit(tmp_path, "--steps", "ops,doctor", SGLANG_XPU_LORA_KERNELS="bogus")
    assert result.returncode == 1, result.stdout[-3000:]
    steps = {s["name"]: s for s in kit["steps"]}
    assert list(steps) == ["doctor", "ops"]  # the kit's order, whatever the order asked
    assert steps["doctor"]["status"] == "ok" and steps["doctor"]["returncode"] == 1  # "cannot serve" is a report
    assert "- can_serve: False" in report and "bogus" in report
    assert steps["ops"]["status"] == "failed" and steps["ops"]["returncode"] == 1 and steps["ops"]["files"] == []
    assert "ValueError" in steps["ops"]["error"] and steps["ops"]["error"].splitlines()[-1] in report
    assert "| ops | failed |" in report and "(no op-benchmark result)" in report


@pytest.mark.launches
def test_a_step_past_its_timeout_is_stopped_and_reported(tmp_path):
    result, report, kit = run_kit(tmp_path, "--steps", "sync_cost", "--step-timeout", "0.5")
    assert result.returncode == 1
    (step,) = kit["steps"]
    assert step["status"] == "timeout" and step["returncode"] is None and 0.5 <= step["seconds"] < 30
    assert "stopped after 0.5 s (--step-timeout)" in report and "| sync_cost | timeout |" in report


def test_serving_table_compares_intel_xpu_with_the_faster_peer_of_the_same_mode(tmp_path):
    """bench_serving.sh's files (``<backend>-<scenario>.jsonl``, the last record each) become one row
    each; intel_xpu's output tokens/s is divided by the faster of triton and csgmv in the same
    scenario and decode mode (eager or +graphs). The step itself needs a server: examples' e2e test."""
    serving = tmp_path / "serving"
    serving.mkdir()
    throughput = {"intel_xpu": 90.0, "triton": 100.0, "csgmv": 80.0, "intel_xpu+graphs": 120.0, "triton+graphs": 96.0,
                  "csgmv+graphs": 150.0}
    for backend, tok_s in throughput.items():
        record = dict(completed=8, output_throughput=tok_s, median_ttft_ms=1.5, median_itl_ms=0.25)
        (serving / f"{backend}-decode.jsonl").write_text(json.dumps({"completed": 0}) + "\n" + json.dumps(record) + "\n")
    code = "import json, sys; from pathlib import Path; from benchmarks import kit; print(json.dumps(kit.serving_rows(Path(sys.argv[1]))))"
    result = subprocess.run([sys.executable, "-c", code, str(serving)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {r["backend"]: r for r in json.loads(result.stdout)}
    assert set(rows) == set(throughput) and all(r["scenario"] == "decode" and r["completed"] == 8 for r in rows.values())
    assert math.isclose(rows["intel_xpu"]["vs_best_peer"], 90 / 100)
    assert math.isclose(rows["intel_xpu+graphs"]["vs_best_peer"], 120 / 150)
    assert all("vs_best_peer" not in rows[b] for b in throughput if not b.startswith("intel_xpu"))
