"""The measurement kit: one command that checks and measures ``intel_xpu`` on this machine and writes
one report to attach to an issue.

    python -m benchmarks.kit --device xpu --out DIR [--quick] [--model M --adapters "a=/p b=/p"]

(``examples/xpu/measure.sh`` runs it on an Intel GPU.) Each step runs in its own process, its
output in ``DIR/<step>.log``; a step that fails or runs past ``--step-timeout`` is recorded in the
report with its exit status and the last lines of its output, and the next step runs:

1. ``doctor``: ``sglang-xpu-lora doctor --json --device DEVICE`` (versions, the provider of each LoRA op outside and
   inside graphs, the capture probe's verdicts on a CUDA/XPU device);
2. ``capture_probe``: :mod:`benchmarks.capture_probe` (on an Intel GPU the installed sgl-kernel-xpu
   build's ops tried in trial captures, a layer replayed in a graph against eager; on CUDA the
   emulated host-syncing and sync-free builds);
3. ``ops``: :mod:`benchmarks.ops`, ``intel_xpu`` (on an Intel GPU its native ops where selected)
   against SGLang's ``triton`` and ``csgmv`` kernels, eager and in graphs, adapters of distinct
   scalings at ranks 8, 16 and 64 under ``max_lora_rank`` 64 (``--points below-max-rank``, best of 3;
   ``--quick``: the benchmark's own three-point grid);
4. ``layer``: :mod:`benchmarks.layer`, one decoder layer with its base GEMMs through every SGLang
   LoRA backend (``triton``, ``csgmv``, ``triton_v2``, ``torch_native``) and ``intel_xpu``, graph
   decode, eager decode and prefill; a backend that fails on the device is recorded per point (in
   SGLang 0.5.23 ``triton_v2`` fails on an Intel GPU at its first LoRA layer). ``intel_xpu``'s
   dense tier runs on the shipped table of the device family where there is one (none for an
   Intel GPU) and SGLang's own: ``SGLANG_XPU_LORA_PLANS`` is cleared for this step;
5. ``plan_sweep``: :mod:`benchmarks.plan_sweep` on this device, Triton's cache filled first by
   ``--sweep-compile-jobs`` compile-only processes at once, then every candidate plan timed per
   linear; writes the plan table ``DIR/<device>.plans.json`` (within 80% of ``--step-timeout``:
   the points the budget leaves out fall through to SGLang's table);
6. ``layer_tuned``: the layer benchmark again (``base`` and ``intel_xpu``), with
   ``SGLANG_XPU_LORA_PLANS`` naming that table, into ``DIR/layer-tuned/``: the report compares
   ``intel_xpu`` with the tuned table against step 4 point by point and says how to serve with it
   (``SGLANG_XPU_LORA_PLANS=DIR/<device>.plans.json sglang serve ...``); skipped when there is no
   table with rows (``plan_sweep`` failed or was not run, here or before into the same folder);
7. ``sync_cost``: :mod:`benchmarks.sync_cost`, what the native ops' host reads cost per eager decode
   step (a stand-in measured on this device);
8. ``scale``: :mod:`benchmarks.scale` on this device, many adapters over few slots: one ``sglang
   serve`` of the tiny Llama per LoRA backend that runs there (``intel_xpu``, ``torch_native``,
   ``triton``, ``csgmv``; on CUDA also ``triton_v2``), 8 then 1,000 adapters loaded over 64 slots,
   64 requests with 64 in flight and an adapter unloaded and reloaded every second (the issue's
   target run, :data:`SCALE_RUN`; ``--quick``: 2 then 3 adapters over 2 slots); writes
   ``DIR/scale-<device>.json`` (adapters and server logs under ``DIR/scale-artifacts``,
   ``DIR/scale-logs``); the report gives each backend's time to first token and tokens/s at 1,000
   adapters against 8, ``intel_xpu``'s tokens/s against the fastest other backend, and how many
   sampled outputs equal transformers + PEFT;
9. ``serving``: ``examples/xpu/bench_serving.sh`` (``intel_xpu``, ``triton`` and ``csgmv``, each
   eager and with decode graphs; its ``BACKENDS``/``SCENARIOS``/``PORT`` settings apply from the
   environment); skipped unless ``--model`` and ``--adapters`` are given.

``--steps`` picks steps, ``--skip`` leaves steps out (``--skip plan_sweep,layer_tuned``: no sweep);
``--dry-run`` prints each step's command and environment and runs nothing.

Writes ``DIR/sglang-xpu-lora-report.md`` (every section, each step's raw JSON embedded at the end)
beside the steps' own files and ``DIR/kit.json`` (the step records). Exit status 0 when every step
that ran succeeded, 1 otherwise; the report is written either way.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parents[1]
REPORT = "sglang-xpu-lora-report.md"
STEPS = ("doctor", "capture_probe", "ops", "layer", "plan_sweep", "layer_tuned", "sync_cost", "scale", "serving")
#: ``sglang_xpu_lora.settings.PLANS_ENV``, spelled here: the kit imports nothing of the plugin, so it
#: reports an environment where the plugin does not import too (the doctor step says why).
PLANS_ENV = "SGLANG_XPU_LORA_PLANS"
#: The layer benchmark's run with the swept table goes into this subfolder (same file names).
TUNED = "layer-tuned"
#: The plan sweep's share of ``--step-timeout`` (its ``--budget-seconds``): it starts no point after
#: it and writes the table of the points so far, before the kit would stop it.
SWEEP_BUDGET_SHARE = 0.8
#: Lines of a failed step's output quoted in the report.
TAIL_LINES = 15
#: Grid of the op step off ``--quick``: ranks below and at max_lora_rank 64, best of 3.
OPS_GRID = ("--points", "below-max-rank", "--repeats", "3", "--seconds", "0.1")
#: Workload of the scale step off ``--quick``: issue 31's target run (docs/sizing.md).
SCALE_RUN = ("--slots", "64", "--adapters", "8", "1000", "--in-flight", "64", "--requests", "64", "--churn", "1")


@dataclasses.dataclass
class Step:
    """One step's record: ``status`` is ``ok``, ``failed``, ``timeout`` or ``skipped``; ``files``
    the JSON files it wrote (relative to the output folder); ``error`` why it failed or was skipped."""

    name: str
    command: list[str]
    status: str = "skipped"
    seconds: float = 0.0
    returncode: Optional[int] = None
    error: str = ""
    files: list[str] = dataclasses.field(default_factory=list)


def _python(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def plan_table(out: Path, device: str) -> Path:
    """The plan table the ``plan_sweep`` step writes and ``layer_tuned`` serves with."""
    return out / f"{device}.plans.json"


def table_rows(path: Path) -> Optional[int]:
    """Rows of the plan table ``path``; None when it is missing or not a table."""
    try:
        rows = json.loads(path.read_text())["rows"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return len(rows) if isinstance(rows, list) else None


def missing_input(name: str, args) -> str:
    """Why step ``name`` cannot run now (checked when its turn comes), or ``""``: ``layer_tuned``
    needs a plan table with rows in the output folder."""
    if name != "layer_tuned":
        return ""
    table = plan_table(args.out, args.device)
    rows = table_rows(table)
    if rows:
        return ""
    why = "does not exist" if not table.exists() else "has no rows" if rows == 0 else "is not a plan table"
    return (f"not run: {table.name} {why} (the plan_sweep step writes it; it failed, was not run or found no plan "
            f"that passed)")


def plan(args) -> list[tuple[str, list[str], list[str], dict]]:
    """``(step, command, JSON files it writes, extra environment)`` per selected step; an empty
    command is a skipped step, the reason in the environment's ``"skip"``."""
    device, out, quick = args.device, args.out, args.quick
    suffix = "-quick" if quick else ""
    steps = {
        "doctor": (_python("sglang_xpu_lora.doctor", "doctor", "--json", "--device", device), ["doctor.json"], {}),
        "capture_probe": (
            _python("benchmarks.capture_probe", "--device", device, "--out", str(out / f"capture-probe-{device}.json"),
                    *(("--quick", "--decode-tokens", "8", "--prefill-tokens", "16") if quick else ())),
            [f"capture-probe-{device}.json"], {}),
        "ops": (
            _python("benchmarks.ops", "--device", device, "--out", str(out), *(("--quick", "--seconds", "0.01") if quick else OPS_GRID)),
            [f"ops-{device}{suffix}.json"], {}),
        "layer": (
            _python("benchmarks.layer", "--device", device, "--out", str(out), *(("--quick",) if quick else ())),
            [f"layer-{device}{suffix}.json"], {PLANS_ENV: ""}),
        "plan_sweep": (
            _python("benchmarks.plan_sweep", "--device", device, "--out", str(plan_table(out, device)), "--results", str(out),
                    "--compile-jobs", str(args.sweep_compile_jobs), "--budget-seconds", f"{SWEEP_BUDGET_SHARE * args.step_timeout:g}",
                    *(("--quick", "--calls", "2", "--rounds", "1") if quick else ())),
            [f"plan-sweep-{device}{suffix}.json", plan_table(out, device).name], {}),
        "layer_tuned": (
            _python("benchmarks.layer", "--device", device, "--out", str(out / TUNED), "--paths", "base,intel_xpu",
                    *(("--quick",) if quick else ())),
            [f"{TUNED}/layer-{device}{suffix}.json"], {PLANS_ENV: str(plan_table(out, device))}),
        "sync_cost": (
            _python("benchmarks.sync_cost", "--device", device, "--out", str(out), *(("--quick",) if quick else ())),
            [f"sync-cost-{device}{suffix}.json"], {}),
        "scale": (
            _python("benchmarks.scale", "--device", device, "--out", str(out), "--artifacts", str(out / "scale-artifacts"),
                    "--log-dir", str(out / "scale-logs"), *(("--quick",) if quick else SCALE_RUN)),
            [f"scale-{device}{suffix}.json"], {}),
    }
    if args.model and args.adapters:
        steps["serving"] = (["bash", str(REPO / "examples" / "xpu" / "bench_serving.sh")], [],
                            {"MODEL": args.model, "ADAPTERS": args.adapters, "DEVICE": device, "OUT": str(out / "serving"),
                             "PYTHON": sys.executable})
    else:
        steps["serving"] = ([], [], {"skip": "not run: give --model and --adapters (4 to 8 PEFT adapters, "
                                              "\"name=path ...\") to run SGLang's serving benchmark"})
    return [(name, *steps[name]) for name in STEPS if name in args.steps]


def run_step(name: str, command: list[str], files: list[str], env_extra: dict, out: Path, timeout: float) -> Step:
    """Run one step in its own process group with ``timeout`` seconds (then it is stopped); its
    stdout and stderr go to ``out/<name>.log`` (the doctor's stdout to ``doctor.json``). Never raises
    for a failing step: the failure is its record."""
    step = Step(name, command, files=files)
    if not command:
        step.error = env_extra["skip"]
        return step
    for stale in files:  # an earlier run's result in the same folder
        (out / stale).unlink(missing_ok=True)
    log = out / f"{name}.log"
    start = time.perf_counter()
    with contextlib.ExitStack() as outputs:
        stderr = outputs.enter_context(open(log, "w"))
        stdout = outputs.enter_context(open(out / files[0], "w")) if name == "doctor" else stderr
        try:
            process = subprocess.Popen(command, cwd=REPO, env={**os.environ, **env_extra}, stdout=stdout, stderr=stderr,
                                       start_new_session=True)
        except OSError as exc:
            step.status, step.error = "failed", f"could not start {command[0]}: {exc}"
        else:
            try:
                step.returncode = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _stop(process)
                step.status, step.error = "timeout", f"stopped after {timeout:g} s (--step-timeout); last lines of {log.name}:\n"
    step.seconds = time.perf_counter() - start
    if step.status == "timeout":
        step.error += _tail(log)
    if step.returncode is not None:
        step.status = "ok" if _succeeded(name, step.returncode, out / files[0] if files else None) else "failed"
        if step.status == "failed":
            step.error = f"exit status {step.returncode}; last lines of {log.name}:\n" + _tail(log)
    step.files = [f for f in files if (out / f).exists()]
    return step


def _succeeded(name: str, returncode: int, result: Optional[Path]) -> bool:
    """Exit status 0, or for ``doctor`` a JSON report (its status 1 means "cannot serve", which the
    report shows with the problems)."""
    if name == "doctor" and result is not None:
        try:
            json.loads(result.read_text())
            return True
        except (OSError, ValueError):
            return False
    return returncode == 0


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to the step's process group (bench_serving.sh then stops its server, which may take
    30 s), SIGKILL after 60 s."""
    for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
            process.wait(timeout=wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-TAIL_LINES:])
    except OSError:
        return ""


def _load(out: Path, step: Step) -> Optional[dict]:
    for name in step.files:
        try:
            return json.loads((out / name).read_text())
        except (OSError, ValueError):
            return None
    return None


# --- the report ------------------------------------------------------------------------------------


def _table(rows: list[dict], columns: list[tuple[str, str]]) -> list[str]:
    """Markdown table of ``rows`` with ``(title, key)`` columns; columns no row has are left out."""
    columns = [(title, key) for title, key in columns if any(row.get(key) is not None for row in rows)]
    if not rows or not columns:
        return ["(no rows)"]
    lines = ["| " + " | ".join(title for title, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(key)) for _, key in columns) + " |")
    return lines


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return "" if value is None else str(value).replace("|", "\\|").replace("\n", " ")


def machine_section(args) -> list[str]:
    from benchmarks.common import machine

    info = {**machine(), "platform": platform.platform(), "device": args.device}
    info.update({k: v for k, v in sorted(os.environ.items()) if k.startswith(("SGLANG_XPU_LORA", "ONEAPI", "ZE_", "SYCL"))})
    return ["## Machine", "", *[f"- {key}: {value}" for key, value in info.items()]]


def steps_section(steps: list[Step]) -> list[str]:
    lines = ["## Steps", "", "| step | status | seconds | note |", "|---|---|---|---|"]
    for s in steps:
        note = s.error.splitlines()[0] if s.error else ", ".join(s.files)
        lines.append(f"| {s.name} | {s.status} | {s.seconds:.1f} | {_cell(note)} |")
    for s in steps:
        if s.status in ("failed", "timeout"):
            lines += ["", f"`{s.name}` ({' '.join(s.command[1:] if s.command[0] == sys.executable else s.command)}):", "",
                      "```", s.error, "```"]
    return lines


def doctor_section(report: Optional[dict]) -> list[str]:
    lines = ["## Doctor", ""]
    if not report:
        return lines + ["(no doctor report)"]
    for key in ("plugin", "sglang", "torch", "kernel_build", "device", "xpu_visible", "kernels", "pool_layout", "can_serve"):
        if key in report:
            lines.append(f"- {key}: {report[key]}")
    lines += [f"- problem: {p}" for p in report.get("problems", [])]
    lines += ["", *_table(report.get("ops", []), [("op", "op"), ("eager", "provider"), ("in graphs", "graph_provider"),
                                                   ("kernel", "kernel"), ("why (eager)", "reason"), ("why (graphs)", "graph_reason")])]
    probe = report.get("graph_probe")
    lines += ["", "Capture probe (doctor):", ""]
    lines += _table(probe, [("op", "op"), ("capture-safe", "capture_safe"), ("ms", "ms"), ("reason", "reason")]) \
        if isinstance(probe, list) else [str(probe)]
    return lines


def probe_section(report: Optional[dict]) -> list[str]:
    lines = ["## Capture probe", ""]
    if not report:
        return lines + ["(no capture-probe result)"]
    lines.append(f"Device {report.get('device')}, all checks passed: {report.get('ok')}")
    for build in report.get("builds", []):
        providers = sorted(set(build.get("graph", {}).values()))
        lines += ["", f"### Build `{build['build']}`: inside graphs {', '.join(providers)}; ok: {build.get('ok')}; "
                      f"probe {build.get('probe_ms_total', 0):.1f} ms over {len(build.get('trials', []))} trials", ""]
        lines += _table(build.get("trials", []), [("setup", "setup"), ("tokens", "tokens"), ("op", "op"),
                                                  ("capture-safe", "capture_safe"), ("ms", "ms"), ("reason", "reason")])
        lines += [""] + _table(build.get("layers", []), [("layer", "mode"), ("tokens", "tokens"), ("graph ops", "graph_ops"),
                                                         ("replay vs eager", "replay_vs_eager"),
                                                         ("replay vs eager ops", "replay_vs_eager_ops"),
                                                         ("vs float64", "vs_float64"), ("ok", "ok")])
    return lines


#: ``(title, time / time)`` of the op step's ratio columns; ``best_peer`` is the faster of triton and csgmv.
OP_RATIOS = {
    "intel_xpu / triton (eager)": ("intel_xpu_ms", "triton_ms"),
    "intel_xpu / csgmv (eager)": ("intel_xpu_ms", "csgmv_ms"),
    "intel_xpu / triton (graph)": ("intel_xpu_graph_ms", "triton_graph_ms"),
    "intel_xpu / csgmv (graph)": ("intel_xpu_graph_ms", "csgmv_graph_ms"),
    "intel_xpu / best peer (graph)": ("intel_xpu_graph_ms", "best_peer_graph_ms"),
    "backend: intel_xpu / triton (eager)": ("intel_xpu_eager_ms", "triton_backend_ms"),
}
#: The targets of the ratios above that have one (issue 15): eager within 1.1x, graphs within 1.05x.
OP_TARGETS = {"intel_xpu / triton (eager)": 1.1, "intel_xpu / best peer (graph)": 1.05,
              "backend: intel_xpu / triton (eager)": 1.1}


def op_rows(rows: list[dict]) -> list[dict]:
    """The op step's rows with the :data:`OP_RATIOS` columns, each the quotient of the two timings."""
    result = []
    for row in rows:
        row = dict(row)
        if "triton_graph_ms" in row and "csgmv_graph_ms" in row:
            row["best_peer_graph_ms"] = min(row["triton_graph_ms"], row["csgmv_graph_ms"])
        for title, (num, den) in OP_RATIOS.items():
            if row.get(num) is not None and row.get(den):
                row[title] = row[num] / row[den]
        result.append(row)
    return result


def ops_section(report: Optional[dict]) -> list[str]:
    lines = ["## Op benchmark (one decoder layer's LoRA work; ms, and ratios: below 1 is faster than the peer)", ""]
    if not report:
        return lines + ["(no op-benchmark result)"]
    rows = op_rows(report.get("rows", []))
    providers = report.get("intel_xpu_providers") or {}
    if providers:
        lines.append("intel_xpu providers (eager / in graphs): "
                     + ", ".join(f"{op} {p['eager']} / {p['graph']}" for op, p in providers.items()))
    if report.get("graph_verdicts"):
        lines.append("Trial captures: " + ", ".join(f"{op} {'safe' if v['capture_safe'] else 'falls back'}"
                                                    for op, v in report["graph_verdicts"].items()))
    for title, target in OP_TARGETS.items():
        values = [row[title] for row in rows if title in row]
        if values:
            lines.append(f"- {title}: {sum(v <= target for v in values)}/{len(values)} points within {target}x, "
                         f"worst {max(values):.3g}, best {min(values):.3g}")
    point = [("model", "model"), ("mode", "mode"), ("max rank", "rank"), ("rank", "real_rank"), ("adapters", "adapters"),
             ("tokens", "tokens"), ("dtype", "dtype")]
    timings = [("intel_xpu", "intel_xpu_ms"), ("triton", "triton_ms"), ("csgmv", "csgmv_ms"), ("intel_xpu graph", "intel_xpu_graph_ms"),
               ("triton graph", "triton_graph_ms"), ("csgmv graph", "csgmv_graph_ms"), ("intel_xpu backend", "intel_xpu_eager_ms"),
               ("triton backend", "triton_backend_ms"), ("portable", "portable_ms"), ("torch_native", "torch_native_ms")]
    ratios = [(title, title) for title in OP_RATIOS]
    errors = [("intel_xpu max error", "intel_xpu_max_error"), ("graph max error", "intel_xpu_graph_max_error")]
    return lines + ["", "Ratios:", "", *_table(rows, point + ratios), "", "Times (ms) and errors (relative to the float64 reference):",
                    "", *_table(rows, point + timings + errors)]


def layer_section(report: Optional[dict]) -> list[str]:
    """The layer benchmark's summary, tables and failures as docs/performance.md renders them."""
    from benchmarks.report import layer

    lines = ["## Layer benchmark (one decoder layer with its base GEMMs, every SGLang LoRA backend; µs)", ""]
    return lines + [layer(report) if report else "(no layer-benchmark result)"]


#: The layer point of a row (its key in both layer runs).
LAYER_POINT = ("model", "mode", "max_rank", "rank", "adapters", "tokens")


def dense_serves(row: dict, dense: Optional[dict]) -> bool:
    """Whether ``intel_xpu`` ran the linears of the layer ``row`` on the dense tier (where a plan
    table is read), from the layer run's ``intel_xpu_dense`` record of the path."""
    if not dense:
        return False
    if row["mode"] == "graph":
        return bool(dense.get("graphs"))
    return dense.get("eager_from_tokens") is not None and row["tokens"] >= dense["eager_from_tokens"]


def tuned_rows(default: dict, tuned: dict) -> list[dict]:
    """The two layer runs point by point: ``intel_xpu`` with the swept table (``tuned_us``) against
    the run without it (``default_us``), their quotient, the base GEMMs' quotient between the runs
    (what the machine drifted: a change of the same size is noise), and each over the best peer of
    the run without the table. ``dense``: whether the point ran on the dense tier at all (elsewhere
    the table is not read and both runs measure the same path)."""
    dense = (tuned.get("intel_xpu_dense") or {}).get("intel_xpu")
    by_point = {tuple(r[k] for k in LAYER_POINT): r for r in default.get("rows", [])}
    rows = []
    for t in tuned.get("rows", []):
        d = by_point.get(tuple(t[k] for k in LAYER_POINT))
        if d is None:
            continue
        row = {k: t[k] for k in LAYER_POINT}
        row.update(dense=dense_serves(t, dense), default_us=d.get("intel_xpu_us"), tuned_us=t.get("intel_xpu_us"),
                   best_peer=d.get("best_peer"), best_peer_us=d.get("best_peer_us"),
                   failed=t.get("intel_xpu_failed") or d.get("intel_xpu_failed"))
        if row["default_us"] and row["tuned_us"]:
            row["tuned_vs_default"] = row["tuned_us"] / row["default_us"]
        if d.get("base_us") and t.get("base_us"):
            row["base_drift"] = t["base_us"] / d["base_us"]
        if row["best_peer_us"]:
            for key in ("default", "tuned"):
                if row[f"{key}_us"]:
                    row[f"{key}_vs_best_peer"] = row[f"{key}_us"] / row["best_peer_us"]
        rows.append(row)
    return rows


def sweep_failures(results: dict) -> list[dict]:
    """The sweep's failed candidates grouped by reason (the first line, 120 characters): how many,
    at how many points, and one candidate's label (its plan family)."""
    groups: dict[str, dict] = {}
    for entry in results.get("points", []):
        for candidate in entry.get("candidates", []):
            if "failed" in candidate:
                reason = str(candidate["failed"]).splitlines()[0][:120] if candidate["failed"] else "?"
                group = groups.setdefault(reason, dict(reason=reason, candidates=0, points=set(), example=candidate.get("label")))
                group["candidates"] += 1
                group["points"].add(json.dumps(entry.get("point"), sort_keys=True))
    return [{**g, "points": len(g["points"])} for g in sorted(groups.values(), key=lambda g: -g["candidates"])]


def serve_command(table: Path) -> str:
    """How to serve with the swept table."""
    return (f"SGLANG_XPU_LORA_PLANS={shlex.quote(str(table))} sglang serve --model-path MODEL --enable-lora "
            f"--lora-paths NAME=PATH ... --max-lora-rank R --lora-backend intel_xpu")


def plans_section(args, by_name: dict, loaded: Callable[[str], Optional[dict]]) -> list[str]:
    """The plan sweep's table (rows, points, failed candidates by reason), the layer with it
    against the layer without it, point by point, and how to serve with it."""
    lines = ["## Plan table (benchmarks/plan_sweep.py on this device) and the layer with it", ""]
    sweep, tuned_step = by_name.get("plan_sweep"), by_name.get("layer_tuned")
    if sweep is None and tuned_step is None:
        return lines + ["not selected (--steps, --skip)"]
    table = plan_table(args.out, args.device)
    results, rows = loaded("plan_sweep"), table_rows(table)
    if sweep is not None and sweep.status != "ok":
        lines.append(f"- plan_sweep: {sweep.status}{': ' + sweep.error.splitlines()[0] if sweep.error else ''}")
    if results:
        points = results.get("points", [])
        candidates = [c for p in points for c in p.get("candidates", [])]
        lines.append(f"- swept {len(points)} points (model, linear, pool rank, tokens), {len(candidates)} candidates: "
                     f"{sum('us' in c for c in candidates)} timed, {sum('failed' in c for c in candidates)} failed; "
                     f"{sum(p.get('best') is None for p in points)} points without a plan that passed; "
                     f"{results.get('points_not_run', 0)} points not run (the budget)")
        for job in results.get("compile_jobs") or []:
            if job.get("returncode"):
                lines.append(f"- compile run {job['shard']} failed (exit status {job['returncode']}); the timed sweep compiled its share")
    if rows is not None:
        lines += [f"- plan table: `{table}`, {rows} rows (phase, pool rank, K, N, tokens; other calls fall through to "
                  f"SGLang's table)", "", "Serve with it:", "", "```", serve_command(table), "```"]
    else:
        lines.append(f"- no plan table ({table.name})")
    failures = sweep_failures(results) if results else []
    if failures:
        lines += ["", "Failed candidates (a plan that does not compile, run or match float64 on this device):", "",
                  *_table(failures, [("reason", "reason"), ("candidates", "candidates"), ("points", "points"), ("e.g.", "example")])]
    lines.append("")
    if tuned_step is None or tuned_step.status == "skipped":
        return lines + [f"layer_tuned: {tuned_step.error if tuned_step else 'not selected (--steps, --skip)'}"]
    default, tuned = loaded("layer"), loaded("layer_tuned")
    if not tuned or not default:
        return lines + ["(no layer-benchmark result " + ("with the table" if not tuned else "without the table to compare with") + ")"]
    for title, data in (("without the table (layer)", default), ("with it (layer_tuned)", tuned)):
        tiers = data.get("intel_xpu_dense") or {}
        dense = tiers.get("intel_xpu")
        lines.append(f"- intel_xpu {title}: " + (
            "not measured" if "intel_xpu" not in tiers else
            f"plans from {', '.join(dense['plans'])}; dense tier in graphs: {dense['graphs']}, eager from "
            f"{dense['eager_from_tokens']} tokens" if dense else
            "no dense tier (its selection runs no linear on SGLang's Triton kernels): no table is read"))
    compared = tuned_rows(default, tuned)
    on_tier = [r["tuned_vs_default"] for r in compared if r["dense"] and "tuned_vs_default" in r]
    drift = [r["base_drift"] for r in compared if "base_drift" in r]
    if on_tier:
        lines.append(f"- tuned / default at the {len(on_tier)} points on the dense tier: median {statistics.median(on_tier):.3g}, "
                     f"best {min(on_tier):.3g}, worst {max(on_tier):.3g} (below 1: the table is faster)"
                     + (f"; base GEMMs between the runs: {min(drift):.3g}-{max(drift):.3g} (noise)" if drift else ""))
    elif any(r["dense"] for r in compared):
        lines.append("- no point on the dense tier has intel_xpu timed in both runs: nothing to compare")
    else:
        lines.append("- no point ran on the dense tier: the table is not used by this layer run")
    return lines + ["", *_table(compared, [
        ("model", "model"), ("mode", "mode"), ("max rank", "max_rank"), ("rank", "rank"), ("adapters", "adapters"), ("tokens", "tokens"),
        ("dense tier", "dense"), ("intel_xpu µs, default table", "default_us"), ("intel_xpu µs, tuned table", "tuned_us"),
        ("tuned / default", "tuned_vs_default"), ("base tuned / default", "base_drift"), ("best peer", "best_peer"),
        ("default / best peer", "default_vs_best_peer"), ("tuned / best peer", "tuned_vs_best_peer"), ("failed", "failed")])]


def serving_rows(folder: Path) -> list[dict]:
    """One row per ``<backend>-<scenario>.jsonl`` of bench_serving.sh (the last record of each), with
    ``intel_xpu``'s output tokens/s over the faster peer's of the same scenario and decode mode."""
    rows = []
    for path in sorted(folder.glob("*.jsonl")) if folder.is_dir() else []:
        backend, _, scenario = path.stem.rpartition("-")
        try:
            record = json.loads(path.read_text().splitlines()[-1])
        except (IndexError, ValueError):
            continue
        rows.append(dict(backend=backend, scenario=scenario, completed=record.get("completed"),
                         output_tok_s=record.get("output_throughput"), median_ttft_ms=record.get("median_ttft_ms"),
                         median_itl_ms=record.get("median_itl_ms")))
    for row in rows:
        graphs = row["backend"].endswith("+graphs")
        if row["backend"].partition("+")[0] != "intel_xpu" or not row["output_tok_s"]:
            continue
        peers = [r["output_tok_s"] for r in rows if r["scenario"] == row["scenario"] and r["backend"].endswith("+graphs") == graphs
                 and r["backend"].partition("+")[0] in ("triton", "csgmv") and r["output_tok_s"]]
        if peers:
            row["vs_best_peer"] = row["output_tok_s"] / max(peers)
    return rows


def serving_section(out: Path, step: Optional[Step]) -> list[str]:
    lines = ["## Serving (SGLang's serving benchmark, examples/xpu/bench_serving.sh)", ""]
    if step is None or step.status == "skipped":
        return lines + [step.error if step else "not selected (--steps)"]
    return lines + _table(serving_rows(out / "serving"), [
        ("backend", "backend"), ("scenario", "scenario"), ("requests completed", "completed"), ("output tok/s", "output_tok_s"),
        ("median TTFT ms", "median_ttft_ms"), ("median ITL ms", "median_itl_ms"),
        ("intel_xpu tok/s / best peer", "vs_best_peer")])


def sync_section(report: Optional[dict]) -> list[str]:
    lines = ["## Sync cost (the native ops' host reads per eager decode step, stood in on this device)", ""]
    if not report:
        return lines + ["(no sync-cost result)"]
    return lines + _table(report.get("rows", []), [
        ("tokens", "tokens"), ("layers", "layers"), ("host reads", "syncs_per_step"), ("base ms", "base_ms"),
        ("sync-free ms", "triton_ms"), ("with reads ms", "synced_ms"), ("added ms", "added_ms"), ("us per read", "us_per_sync"),
        ("step ratio", "step_ratio"), ("LoRA ratio", "lora_ratio")])


def scale_rows(report: dict) -> list[dict]:
    """The scale benchmark's rows, each with its time to first token (p50) and tokens/s over the
    same backend's at the fewest adapters and the same requests in flight, and on ``intel_xpu``'s
    rows its tokens/s over the fastest other backend's at the same adapters and in flight."""
    rows = [dict(row) for row in report.get("rows", [])]
    for row in rows:
        same = [r for r in rows if r["backend"] == row["backend"] and r["in_flight"] == row["in_flight"]]
        fewest = min(same, key=lambda r: r["adapters"])
        if fewest.get("ttft_p50_s") and row.get("ttft_p50_s") is not None:
            row["ttft_vs_fewest"] = row["ttft_p50_s"] / fewest["ttft_p50_s"]
        if fewest.get("tok_s") and row.get("tok_s") is not None:
            row["tok_s_vs_fewest"] = row["tok_s"] / fewest["tok_s"]
        peers = [r["tok_s"] for r in rows if r["backend"] != row["backend"] and r["adapters"] == row["adapters"]
                 and r["in_flight"] == row["in_flight"] and r.get("tok_s")]
        if row["backend"] == "intel_xpu" and peers and row.get("tok_s"):
            row["vs_best_peer"] = row["tok_s"] / max(peers)
    return rows


def scale_section(report: Optional[dict], step: Optional[Step]) -> list[str]:
    """The scale step: its settings, failed backends, per backend the most adapters against the
    fewest (issue 31's targets: time to first token p50 at most 1.5x, tokens/s at least 0.8x) and
    the sampled outputs' check, then every row."""
    lines = ["## Scale (benchmarks/scale.py: K adapters loaded, S slots, C requests in flight; seconds, tokens/s)", ""]
    if step is None or step.status == "skipped":
        return lines + [step.error if step and step.error else "not selected (--steps, --skip)"]
    if not report:
        return lines + ["(no scale result)"]
    settings = report.get("settings") or {}
    lines.append(f"- backends {', '.join(settings.get('backends', []))}; slots {settings.get('slots')}, adapters "
                 f"{settings.get('adapters')}, in flight {settings.get('in_flight')}, {settings.get('requests')} requests of "
                 f"{settings.get('new_tokens')} tokens, reload every {settings.get('churn') or '-'} s")
    for backend, error in (report.get("failed") or {}).items():
        lines.append(f"- {backend}: failed: {_cell(str(error).splitlines()[0] if error else '?')}")
    rows = scale_rows(report)
    for backend in dict.fromkeys(r["backend"] for r in rows):
        mine = [r for r in rows if r["backend"] == backend]
        most = max(r["adapters"] for r in mine)
        ratios = [r for r in mine if r["adapters"] == most and "ttft_vs_fewest" in r]
        checked, exact = sum(r.get("checked", 0) for r in mine), sum(r.get("exact", 0) for r in mine)
        summary = "; ".join(f"C = {r['in_flight']}: TTFT p50 {r['ttft_vs_fewest']:.3g}x, "
                            f"tokens/s {r.get('tok_s_vs_fewest', float('nan')):.3g}x" for r in ratios)
        lines.append(f"- {backend}: {most} adapters against {min(r['adapters'] for r in mine)}: {summary or 'one K only'}; "
                     f"sampled outputs equal to transformers + PEFT: {exact}/{checked}")
    return lines + ["", *_table(rows, [
        ("backend", "backend"), ("adapters", "adapters"), ("slots", "slots"), ("in flight", "in_flight"), ("requests", "requests"),
        ("TTFT p50 s", "ttft_p50_s"), ("TTFT p95 s", "ttft_p95_s"), ("TTFT p50 / fewest K", "ttft_vs_fewest"),
        ("tok/s", "tok_s"), ("tok/s / fewest K", "tok_s_vs_fewest"), ("intel_xpu tok/s / best peer", "vs_best_peer"),
        ("latency p99 s", "latency_p99_s"), ("latency max s", "latency_max_s"), ("tail s", "tail_s"), ("reloads", "reloads"),
        ("load ms (median)", "load_ms_median"), ("load ms (max)", "load_ms_max"), ("host MiB / adapter", "rss_mib_per_adapter"),
        ("device MiB / adapter", "device_mib_per_adapter"), ("checked", "checked"), ("exact", "exact"), ("load 1m", "load_1m")])]


def raw_section(out: Path, steps: list[Step]) -> list[str]:
    lines = ["## Raw results", ""]
    for step in steps:
        for name in step.files:
            lines += [f"<details><summary>{name}</summary>", "", "```json", (out / name).read_text().strip(), "```", "", "</details>", ""]
    return lines


def _section(title: str, make: Callable[[], list[str]]) -> list[str]:
    """The section ``make`` writes, or where it raises (a step's file of an unexpected form) a
    section that says so: one unreadable result costs its own section, not the report."""
    try:
        return make()
    except Exception as exc:  # noqa: BLE001 - recorded in the report
        return [f"## {title}", "", f"(this section could not be written: {type(exc).__name__}: {exc}; the step's files are in "
                                   f"the folder and embedded below)"]


def write_report(args, steps: list[Step]) -> Path:
    """``args.out/kit.json`` (the step records) and ``args.out/REPORT`` from the records and files."""
    out = args.out
    (out / "kit.json").write_text(json.dumps({"device": args.device, "quick": args.quick,
                                              "steps": [dataclasses.asdict(s) for s in steps]}, indent=1))
    by_name = {s.name: s for s in steps}
    loaded: Callable[[str], Optional[dict]] = lambda name: _load(out, by_name[name]) if name in by_name else None  # noqa: E731
    sections = [
        [f"# sglang-xpu-lora measurement report ({args.device}{', quick' if args.quick else ''})", "",
         f"`python -m benchmarks.kit {' '.join(args.argv)}`; attach this file to an issue."],
        _section("Machine", lambda: machine_section(args)), steps_section(steps),
        _section("Doctor", lambda: doctor_section(loaded("doctor"))),
        _section("Capture probe", lambda: probe_section(loaded("capture_probe"))),
        _section("Op benchmark", lambda: ops_section(loaded("ops"))),
        _section("Layer benchmark", lambda: layer_section(loaded("layer"))),
        _section("Plan table", lambda: plans_section(args, by_name, loaded)),
        _section("Serving", lambda: serving_section(out, by_name.get("serving"))),
        _section("Sync cost", lambda: sync_section(loaded("sync_cost"))),
        _section("Scale", lambda: scale_section(loaded("scale"), by_name.get("scale"))),
        raw_section(out, steps),
    ]
    path = out / REPORT
    path.write_text("\n".join(line for section in sections for line in [*section, ""]))
    return path


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="xpu", choices=("xpu", "cuda", "cpu"))
    parser.add_argument("--out", type=Path, required=True, help="folder for the report and every step's files")
    parser.add_argument("--quick", action="store_true", help="the benchmarks' smallest sizes (tests, a first look)")
    parser.add_argument("--model", help="base model (path or hub id) for the serving step")
    parser.add_argument("--adapters", help='"name=path name=path ..." PEFT adapters for the serving step')
    names = lambda s: [n for n in s.split(",") if n]  # noqa: E731
    parser.add_argument("--steps", type=names, default=list(STEPS),
                        help=f"comma-separated subset of {','.join(STEPS)} (default: all)")
    parser.add_argument("--skip", type=names, default=[], help="comma-separated steps to leave out (e.g. plan_sweep,layer_tuned)")
    parser.add_argument("--step-timeout", type=float, default=3600, help="seconds one step may run before it is stopped")
    parser.add_argument("--sweep-compile-jobs", type=int, default=min(8, max(1, (os.cpu_count() or 2) // 2)),
                        help="processes compiling the plan sweep's kernels at once before it times them (default: half the "
                             "cores, at most 8)")
    parser.add_argument("--dry-run", action="store_true", help="print each step's command and environment; run nothing")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    unknown = (set(args.steps) | set(args.skip)) - set(STEPS)
    if unknown:
        parser.error(f"unknown steps {sorted(unknown)}; choose from {', '.join(STEPS)}")
    args.steps = [name for name in args.steps if name not in args.skip]
    args.out = args.out.resolve()
    if args.dry_run:
        for name, command, files, env in plan(args):
            if not command:
                print(f"[kit] {name}: skipped: {env['skip']}")
                continue
            needs = f" (runs when {plan_table(args.out, args.device).name} has rows)" if name == "layer_tuned" else ""
            print(f"[kit] {name}{needs}: {' '.join(f'{k}={shlex.quote(v)}' for k, v in env.items())}{' ' if env else ''}"
                  f"{shlex.join(command)}\n[kit]   writes {', '.join(files) or '(its own folder)'}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    steps = []
    for name, command, files, env in plan(args):
        print(f"[kit] {name} ...", flush=True)
        missing = missing_input(name, args)
        steps.append(Step(name, command, error=missing) if missing else run_step(name, command, files, env, args.out, args.step_timeout))
        print(f"[kit] {name}: {steps[-1].status} ({steps[-1].seconds:.1f} s) {steps[-1].error.splitlines()[0] if steps[-1].error else ''}",
              flush=True)
    path = write_report(args, steps)
    print(f"[kit] wrote {path}")
    table = plan_table(args.out, args.device)
    if any(s.name == "plan_sweep" and s.status == "ok" for s in steps) and table_rows(table):
        print(f"[kit] plan table for this device: {table}; serve with it:\n  {serve_command(table)}")
    return 0 if all(s.status in ("ok", "skipped") for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
