"""The measurement kit (benchmarks/kit.py, behind examples/xpu/measure.sh) on CPU in ``--quick``
mode, through the same steps as on an Intel GPU: the report has every section, every step's status
is recorded, the ratios it prints are the quotients of the timings in the steps' own JSON, and a
step that fails or runs out of time is reported while the other steps still run. The quick run is
also the smoke run of the benchmarks it steps through (each once per suite, so they never rot):
the op benchmark's tiers are measured (finite numbers) with the ratios it prints the quotients of
its timings and the Triton tier's output within 1e-5 of the float64 reference, the sync-cost
benchmark counts the native ops' host reads, and the capture probe on CPU tries nothing and matches
the reference. The plan sweep and the layer with its table (minutes in Triton's interpreter) and the
scale benchmark (a server per backend; its own smoke run is test_benchmarks_smoke.py::test_scale)
are left out of that run: their command lines as an Intel GPU gets them come from ``measure.sh
--dry-run``, and the kit's handling of them (the table's path in the tuned layer's environment, a
stale table removed, a failed sweep skipping the tuned layer and losing no other step, the
comparison's quotients, the scale table and its ratios) is run with stand-in step commands that
read the kit's real arguments. No timing is asserted."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SECTIONS = ("## Machine", "## Steps", "## Doctor", "## Capture probe", "## Op benchmark", "## Layer benchmark", "## Plan table",
            "## Serving", "## Sync cost", "## Scale", "## Raw results")
#: The sweep and the layer with its table: left out of the quick run (minutes in the interpreter).
SWEEP_STEPS = "plan_sweep,layer_tuned"
#: Left out of the quick run: the sweep steps, and the scale benchmark (a server start-up per backend).
QUICK_RUN_LEAVES_OUT = SWEEP_STEPS + ",scale"


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
    return out, *run_kit(out, "--skip", QUICK_RUN_LEAVES_OUT, SGLANG_XPU_LORA_KERNELS="triton")


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
    assert "## Plan table (benchmarks/plan_sweep.py on this device) and the layer with it\n\nnot selected (--steps, --skip)" in report
    assert "## Scale (benchmarks/scale.py: K adapters loaded, S slots, C requests in flight; seconds, tokens/s)\n\n" \
           "not selected (--steps, --skip)" in report


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


def dry_run(out: Path, *args: str, **env_vars) -> dict[str, str]:
    """``bash examples/xpu/measure.sh --dry-run ARGS`` (``DEVICE`` xpu by default): step -> its line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_XPU_LORA", "QUICK", "DEVICE", "MODEL", "ADAPTERS"))}
    env.update(PYTHON=sys.executable, OUT=str(out), **env_vars)
    result = subprocess.run(["bash", str(REPO / "examples" / "xpu" / "measure.sh"), "--dry-run", *args], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line.removeprefix("[kit] ") for line in result.stdout.splitlines() if not line.startswith("[kit]   ")]
    return {line.split(":")[0].split(" (")[0]: line for line in lines}


def test_dry_run_lists_the_sweep_and_the_layer_with_its_table_on_an_intel_gpu(tmp_path):
    """What measure.sh runs on an Intel GPU, without one: the plan sweep on the XPU (compile
    processes first, a budget inside the step timeout) writing the table into the report folder, the
    layer benchmark again with SGLANG_XPU_LORA_PLANS naming that table, the first layer run with it
    cleared, the scale benchmark on the XPU writing into the report folder; --skip leaves steps out;
    nothing is run or written."""
    from sglang_xpu_lora.settings import PLANS_ENV

    assert PLANS_ENV == "SGLANG_XPU_LORA_PLANS"  # the name the kit spells without importing the plugin
    out = tmp_path / "report"
    steps = dry_run(out, "--sweep-compile-jobs", "4")
    assert list(steps) == ["doctor", "capture_probe", "ops", "layer", "plan_sweep", "layer_tuned", "sync_cost", "scale", "serving"]
    table = out / "xpu.plans.json"
    assert steps["plan_sweep"].endswith(f"-m benchmarks.plan_sweep --device xpu --out {table} --results {out} "
                                        "--compile-jobs 4 --budget-seconds 2880"), steps["plan_sweep"]
    assert steps["layer_tuned"] == (f"layer_tuned (runs when xpu.plans.json has rows): SGLANG_XPU_LORA_PLANS={table} {sys.executable} "
                                    f"-m benchmarks.layer --device xpu --out {out / 'layer-tuned'} --paths base,intel_xpu")
    assert steps["layer"] == f"layer: SGLANG_XPU_LORA_PLANS='' {sys.executable} -m benchmarks.layer --device xpu --out {out}"
    assert steps["serving"].startswith("serving: skipped: not run: give --model and --adapters")
    # the scale benchmark on the XPU: issue 31's target run, its adapters and server logs in the report folder
    assert steps["scale"] == (f"scale: {sys.executable} -m benchmarks.scale --device xpu --out {out} --artifacts {out / 'scale-artifacts'} "
                              f"--log-dir {out / 'scale-logs'} --slots 64 --adapters 8 1000 --in-flight 64 --requests 64 --churn 1")
    assert not out.exists()
    quick = dry_run(out, "--steps", "layer,plan_sweep,layer_tuned,scale", "--skip", "layer", QUICK="1", SGLANG_XPU_LORA_PLANS="/elsewhere")
    assert list(quick) == ["plan_sweep", "layer_tuned", "scale"]  # the tiny grid on the XPU itself, not the interpreter
    assert " -m benchmarks.scale --device xpu " in quick["scale"] and quick["scale"].endswith(" --quick")
    assert " --device xpu " in quick["plan_sweep"] and quick["plan_sweep"].endswith(" --quick --calls 2 --rounds 1")
    assert f"SGLANG_XPU_LORA_PLANS={table} " in quick["layer_tuned"] and quick["layer_tuned"].endswith(" --quick")
    assert "plan_sweep" not in dry_run(out, "--skip", "plan_sweep,layer_tuned") and not out.exists()


#: Stand-in for the benchmark a step runs: ``STANDIN STEP -m MODULE ARGS...`` reads the arguments the
#: kit gives the real module and writes what the module would, from fixed figures; the layer runs
#: record the SGLANG_XPU_LORA_PLANS they were given as their plan source.
STANDIN = r"""
import json, os, sys
from pathlib import Path
step, args = sys.argv[1], sys.argv[4:]
value = lambda flag: args[args.index(flag) + 1]
points = [dict(model="llama-3.1-8b", mode=m, max_rank=64, rank=16, adapters=8, tokens=t) for m, t in
          (("graph", 8), ("eager", 32), ("prefill", 8192))]
if step in ("layer", "layer_tuned"):
    tuned = step == "layer_tuned"
    plans = os.environ.get("SGLANG_XPU_LORA_PLANS", "")
    rows = [dict(p, base_us=100.0 * (1.25 if tuned else 1.0), intel_xpu_us=us, best_peer="triton_v2", best_peer_us=200.0)
            for p, us in zip(points, (150.0, 300.0, 1000.0) if tuned else (200.0, 300.0, 800.0))]
    dense = dict(plans=[f"SGLANG_XPU_LORA_PLANS={plans}"] * bool(plans) + ["SGLang's default"], graphs=True, eager_from_tokens=2048)
    out = Path(value("--out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "layer-xpu.json").write_text(json.dumps(dict(machine=dict(gpu="Intel GPU", torch="2.14", python="3.11", date="today"), calls=40, rounds=5, prefill_calls=8, prefill_rounds=3,
                                                        intel_xpu_dense=dict(intel_xpu=dense), rows=rows)))
elif step == "plan_sweep":
    if os.environ.get("STANDIN_SWEEP_FAILS"):
        sys.exit("RuntimeError: the sweep broke")
    table, results = Path(value("--out")), Path(value("--results"))
    good = dict(label="ab_delta|A:grouped/sk4|B:grouped/n64|block16", us=5.0)
    bad = dict(label="a|A:grouped/sk8|B:per_row/n128|block16", failed="CompilationError: acq_rel atomics\nat line 3")
    sweep = [dict(point=dict(linear=n), candidates=[good, bad], best=good["label"]) for n in ("qkv", "down")]
    if os.environ.get("STANDIN_SWEEP_RESULTS_BROKEN"):
        sweep = 7  # not a list of points
    results.joinpath("plan-sweep-xpu.json").write_text(json.dumps(dict(points=sweep, points_not_run=3, compile_jobs=[])))
    table.write_text(json.dumps(dict(rows=[dict(name="decode.llama.qkv", phase="decode")] * 2)))
elif step == "scale":
    assert Path(value("--artifacts")).name == "scale-artifacts" and value("--device") == "xpu"
    row = lambda backend, k, ttft, tok_s: dict(backend=backend, adapters=k, slots=64, in_flight=64, requests=64, ttft_p50_s=ttft,
                                               ttft_p95_s=2 * ttft, tok_s=tok_s, checked=2, exact=2 if backend == "intel_xpu" else 1)
    rows = [row("intel_xpu", 8, 0.1, 900.0), row("intel_xpu", 1000, 0.12, 720.0), row("triton", 8, 0.2, 600.0),
            row("triton", 1000, 0.5, 480.0)]
    settings = dict(backends=["intel_xpu", "torch_native", "triton", "csgmv"], slots=64, adapters=[8, 1000], in_flight=[64], requests=64,
                    new_tokens=16, churn=1.0)
    failed = dict(torch_native="RuntimeError: server exited\nmore", csgmv="TimeoutError: no answer")
    Path(value("--out")).joinpath("scale-xpu.json").write_text(json.dumps(dict(settings=settings, failed=failed, rows=rows)))
else:
    Path(value("--out")).joinpath("sync-cost-xpu.json").write_text(json.dumps(dict(rows=[dict(tokens=1, layers=1)])))
"""

#: ``python -c KIT STANDIN ARGS``: the kit with every step's command replaced by the stand-in.
KIT_WITH_STANDINS = (
    "import sys\n"
    "from benchmarks import kit\n"
    "real = kit.plan\n"
    "kit.plan = lambda args: [(name, [sys.executable, sys.argv[1], name, *command[1:]] if command else command, files, env)\n"
    "                         for name, command, files, env in real(args)]\n"
    "sys.exit(kit.main(sys.argv[2:]))\n"
)


def run_standins(tmp_path: Path, **env_vars) -> tuple[subprocess.CompletedProcess, Path, str, dict]:
    """The kit for an Intel GPU (``--device xpu``, full sizes) over the stand-ins: (result, folder,
    report, step records by name)."""
    standin, out = tmp_path / "standin.py", tmp_path / "report"
    standin.write_text(STANDIN)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_XPU_LORA")}
    env.update(env_vars)
    result = subprocess.run([sys.executable, "-c", KIT_WITH_STANDINS, str(standin), "--device", "xpu", "--out", str(out),
                             "--skip", "doctor,capture_probe,ops"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    kit = json.loads((out / "kit.json").read_text())
    return result, out, (out / "sglang-xpu-lora-report.md").read_text(), {s["name"]: s for s in kit["steps"]}


@pytest.mark.launches
def test_the_tuned_layer_runs_with_the_swept_table_and_is_compared_point_by_point(tmp_path):
    """The sweep's table goes to the tuned layer run through SGLANG_XPU_LORA_PLANS (a user's own
    setting is cleared for the first layer run and replaced for the second); the report lists the
    failed candidates by reason, the tuned / default quotient of each point with the base GEMMs'
    drift between the runs, marks the points off the dense tier, and says how to serve."""
    result, out, report, steps = run_standins(tmp_path, SGLANG_XPU_LORA_PLANS="/a/users/own.plans.json")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert {n: s["status"] for n, s in steps.items()} == {
        "layer": "ok", "plan_sweep": "ok", "layer_tuned": "ok", "sync_cost": "ok", "scale": "ok", "serving": "skipped"}
    table = out / "xpu.plans.json"
    assert steps["plan_sweep"]["files"] == ["plan-sweep-xpu.json", "xpu.plans.json"]
    assert steps["layer_tuned"]["files"] == ["layer-tuned/layer-xpu.json"]
    tuned = json.loads((out / "layer-tuned" / "layer-xpu.json").read_text())
    assert tuned["intel_xpu_dense"]["intel_xpu"]["plans"][0] == f"SGLANG_XPU_LORA_PLANS={table}"
    default = json.loads((out / "layer-xpu.json").read_text())
    assert default["intel_xpu_dense"]["intel_xpu"]["plans"] == ["SGLang's default"]
    assert "- swept 2 points (model, linear, pool rank, tokens), 4 candidates: 2 timed, 2 failed; " \
           "0 points without a plan that passed; 3 points not run (the budget)" in report
    assert "| CompilationError: acq_rel atomics | 2 | 2 | a\\|A:grouped/sk8\\|B:per_row/n128\\|block16 |" in report
    assert f"- plan table: `{table}`, 2 rows" in report
    serve = f"SGLANG_XPU_LORA_PLANS={table} sglang serve --model-path MODEL"
    assert serve in report and serve in result.stdout
    # graph 8 and prefill 8192 on the dense tier (150/200, 1000/800); eager 32 below its 2048 tokens
    assert "| llama-3.1-8b | graph | 64 | 16 | 8 | 8 | True | 200 | 150 | 0.75 | 1.25 | triton_v2 | 1 | 0.75 |" in report
    assert "| llama-3.1-8b | eager | 64 | 16 | 8 | 32 | False | 300 | 300 | 1 | 1.25 | triton_v2 | 1.5 | 1.5 |" in report
    assert "| llama-3.1-8b | prefill | 64 | 16 | 8 | 8192 | True | 800 | 1e+03 | 1.25 | 1.25 | triton_v2 | 4 | 5 |" in report
    assert "- tuned / default at the 2 points on the dense tier: median 1, best 0.75, worst 1.25 (below 1: the table is faster); " \
           "base GEMMs between the runs: 1.25-1.25 (noise)" in report


@pytest.mark.launches
def test_a_failed_sweep_skips_the_tuned_layer_and_keeps_every_other_result(tmp_path):
    """A sweep that fails leaves no table (an earlier run's in the same folder is removed before it
    starts, so the tuned layer never runs on a stale one): the tuned layer is skipped with the
    reason, the steps before and after it keep their results in the report, the exit status is 1."""
    stale = tmp_path / "report" / "xpu.plans.json"
    stale.parent.mkdir()
    stale.write_text(json.dumps(dict(rows=[dict(name="old")])))
    result, out, report, steps = run_standins(tmp_path, STANDIN_SWEEP_FAILS="1")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert {n: s["status"] for n, s in steps.items()} == {
        "layer": "ok", "plan_sweep": "failed", "layer_tuned": "skipped", "sync_cost": "ok", "scale": "ok", "serving": "skipped"}
    assert not stale.exists() and steps["plan_sweep"]["files"] == []
    assert "RuntimeError: the sweep broke" in steps["plan_sweep"]["error"]
    assert steps["layer_tuned"]["error"] == ("not run: xpu.plans.json does not exist (the plan_sweep step writes it; it failed, "
                                             "was not run or found no plan that passed)")
    assert "- plan_sweep: failed: exit status 1" in report and "- no plan table (xpu.plans.json)" in report
    assert f"layer_tuned: {steps['layer_tuned']['error']}" in report and "serve" not in result.stdout
    for kept in ("<summary>layer-xpu.json</summary>", "<summary>sync-cost-xpu.json</summary>", "*Intel GPU, torch 2.14, Python 3.11, today*",
                 "| 1 | 1 |"):  # the layer and sync-cost sections
        assert kept in report


@pytest.mark.launches
def test_a_result_the_report_cannot_read_costs_its_own_section_only(tmp_path):
    """A sweep's results of an unexpected form (``points`` not a list): the plan section says it
    could not be written and why; every other section and the step records are there."""
    result, out, report, steps = run_standins(tmp_path, STANDIN_SWEEP_RESULTS_BROKEN="1")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert steps["plan_sweep"]["status"] == steps["layer_tuned"]["status"] == "ok"
    assert "## Plan table\n\n(this section could not be written: TypeError: " in report
    positions = [report.index(section) for section in SECTIONS if section not in ("## Doctor", "## Capture probe", "## Op benchmark")]
    assert positions == sorted(positions) and "<summary>layer-tuned/layer-xpu.json</summary>" in report


@pytest.mark.launches
def test_the_scale_step_puts_its_table_and_ratios_in_the_report(tmp_path):
    """The scale benchmark's result on an Intel GPU (a stand-in's, from the kit's real arguments):
    the report lists the backends that failed with their first line, per backend the time to first
    token and tokens/s at the most adapters over the fewest and the sampled outputs' check, and the
    table with intel_xpu's tokens/s over the fastest other backend's; the raw JSON is embedded."""
    result, out, report, steps = run_standins(tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert steps["scale"]["status"] == "ok" and steps["scale"]["files"] == ["scale-xpu.json"]
    section = report[report.index("## Scale"):report.index("## Raw results")]
    assert "- backends intel_xpu, torch_native, triton, csgmv; slots 64, adapters [8, 1000], in flight [64], 64 requests of 16 " \
           "tokens, reload every 1.0 s" in section
    assert "- torch_native: failed: RuntimeError: server exited\n" in section and "- csgmv: failed: TimeoutError: no answer" in section
    assert "- intel_xpu: 1000 adapters against 8: C = 64: TTFT p50 1.2x, tokens/s 0.8x; sampled outputs equal to " \
           "transformers + PEFT: 4/4" in section
    assert "- triton: 1000 adapters against 8: C = 64: TTFT p50 2.5x, tokens/s 0.8x; sampled outputs equal to " \
           "transformers + PEFT: 2/4" in section
    # backend, adapters, slots, in flight, requests, TTFT p50, p95, / fewest K, tok/s, / fewest K, intel_xpu / best peer
    assert "| intel_xpu | 1000 | 64 | 64 | 64 | 0.12 | 0.24 | 1.2 | 720 | 0.8 | 1.5 | 2 | 2 |" in section
    assert "| intel_xpu | 8 | 64 | 64 | 64 | 0.1 | 0.2 | 1 | 900 | 1 | 1.5 | 2 | 2 |" in section
    assert "| triton | 1000 | 64 | 64 | 64 | 0.5 | 1 | 2.5 | 480 | 0.8 |  | 2 | 1 |" in section
    assert "<summary>scale-xpu.json</summary>" in report
