"""``sglang-xpu-lora doctor`` for a full, a partial and no kernel build."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_xpu_lora import doctor
from sglang_xpu_lora.providers.base import OP_NAMES

#: Every line of doctor's text report fits this many columns (issue 18; ``doctor.WIDTH``).
COLUMNS = 100


def run_doctor(capsys, *args):
    """``(status, report)``: the JSON report with ``--json``, else the text with every line checked
    to fit 100 columns and joined into one line (wrapping can split any phrase)."""
    status = doctor.main(["doctor", *args])
    out = capsys.readouterr().out
    if "--json" in args:
        return status, json.loads(out)
    assert max(len(line) for line in out.splitlines()) <= COLUMNS, out
    return status, " ".join(out.split())


def providers_of(report):
    return {op["op"]: (op["provider"], op["graph_provider"], op["capture_safe"]) for op in report["ops"]}


def test_full_build(emulate, capsys, sglang_plugins_loaded):
    with emulate("full"):
        status, report = run_doctor(capsys, "--json")
    assert status == 0 and report["can_serve"], report["problems"]
    ops = providers_of(report)
    assert set(ops) == set(OP_NAMES)
    assert all(ops[op] == ("native", "torch", None) for op in OP_NAMES)  # no device: not tried here
    graph_reasons = {op["op"]: op["graph_reason"] for op in report["ops"]}
    assert all(graph_reasons[op].startswith(
        "native op not run inside graphs: capture safety is decided by a trial capture at graph set-up; no Triton: "
    ) for op in OP_NAMES)
    assert report["graph_probe"] == (
        "not tried here (cpu has no device graphs to try a capture in): "
        "decided by a trial capture at graph set-up on the serving device"
    )
    assert report["pool_layout"] == "SGLang's packed layout at real ranks, slots zeroed before each load"
    assert all(p["found"] for p in report["patch_points"]) and len(report["patch_points"]) > 10
    assert report["sglang"] == "0.5.23" and report["xpu_visible"] is False


def test_on_a_device_with_graphs_doctor_runs_the_trial_captures(emulate, capsys, monkeypatch, sglang_plugins_loaded):
    from fake_graphs import FakeGraphs

    from sglang_xpu_lora.providers import capture_probe

    monkeypatch.setattr(capture_probe, "device_graphs", lambda device_type: (FakeGraphs(), ""))  # graphs on CPU
    with emulate("full-syncfree"):
        status, report = run_doctor(capsys, "--json")
    assert status == 0, report["problems"]
    assert all(providers_of(report)[op] == ("native", "native", True) for op in OP_NAMES)
    assert [row["op"] for row in report["graph_probe"]] == list(OP_NAMES)
    assert all(row["capture_safe"] and row["reason"].startswith("captured in a trial fake graph (64 tokens, 8 slots")
               for row in report["graph_probe"])
    with emulate("full"):
        status, text = run_doctor(capsys)
    assert status == 0
    assert text.count("native / torch not graph-safe") == len(OP_NAMES)
    assert f"Capture probe (64 tokens, 8 slots): {len(OP_NAMES)} native ops tried" in text
    assert text.count(": falls back (") == len(OP_NAMES)
    assert ": native op not run inside graphs: capture failed in a trial fake graph" in text


def test_partial_build_in_auto_and_native_mode(emulate, capsys, sglang_plugins_loaded):
    with emulate("v0.1.0"):
        status, report = run_doctor(capsys, "--json")
    assert status == 0
    native = {op for op, (provider, _, _) in providers_of(report).items() if provider == "native"}
    assert native == {"embedding_lora_a_fwd", "sgemm_lora_a_fwd"}
    reason = {op["op"]: op["reason"] for op in report["ops"]}["qkv_lora_b_fwd"]
    assert "no native op: not in the installed build (first in an sgl-kernel-xpu build with PR #393" in reason

    with emulate("v0.1.0", kernels="native"):
        status, text = run_doctor(capsys)
    assert status == 1
    assert "CANNOT SERVE --lora-backend intel_xpu:" in text
    assert "sgl-kernel-xpu op sgemm_lora_b_fwd is unavailable" in text


def test_triton_mode(capsys, monkeypatch, sglang_plugins_loaded):
    monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", "triton")  # TRITON_INTERPRET=1: tests/conftest.py
    status, report = run_doctor(capsys, "--json")
    assert status == 0, report["problems"]
    assert set(providers_of(report).values()) == {("triton", "triton", True)}
    assert report["pool_layout"] == "SGLang's packed layout at real ranks"
    assert all("interpreter (TRITON_INTERPRET=1)" in op["reason"] for op in report["ops"])
    status, text = run_doctor(capsys)
    assert "LoRA ops for device cpu (SGLANG_XPU_LORA_KERNELS=triton; provider outside / inside graphs):" in text
    assert text.count(" triton / triton ") == len(OP_NAMES) and "LoRA pool layout: SGLang's packed layout at real ranks Linears" in text
    assert report["dense_tier"] == {
        "modes": ["eager", "graphs"], "eager_min_tokens": 2048, "direct_launches": True, "plans": ["SGLang's default"],
    }
    assert ("Linears on the dense tier (SGLang's triton_v2 kernels) outside graphs from 2048 tokens and inside graphs; "
            "plans from SGLang's default Linears of smaller eager batches: SGLang's triton kernels launched from "
            "compiled handles Capture probe:") in text
    monkeypatch.delenv("TRITON_INTERPRET")
    status, text = run_doctor(capsys)
    assert status == 1 and "=triton: SGLang's Triton LoRA kernels cannot run on device cpu" in text


def test_a_bad_plan_table_is_a_problem_the_server_would_meet(capsys, monkeypatch, tmp_path, sglang_plugins_loaded):
    """The dense tier's plan table is read as the backend reads it: a bad row fails the doctor."""
    monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", "triton")
    bad = tmp_path / "bad.plans.json"
    bad.write_text(json.dumps({"rows": [{"name": "r", "max_tokens": "many"}]}))
    monkeypatch.setenv("SGLANG_XPU_LORA_PLANS", str(bad))
    status, report = run_doctor(capsys, "--json")
    assert status == 1 and any(str(bad) in problem and "'r'" in problem for problem in report["problems"]), report["problems"]
    monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", "torch")  # no Triton op: no dense tier, no table read
    status, report = run_doctor(capsys, "--json")
    assert status == 0 and report["dense_tier"] is None


@pytest.mark.parametrize("kernels", ["triton", "torch"])
def test_a_bad_eager_threshold_is_a_problem_whatever_the_selection(kernels, capsys, monkeypatch, sglang_plugins_loaded):
    """The backend reads SGLANG_XPU_LORA_EAGER_DENSE_MIN_TOKENS whatever serves the linears, so the
    doctor refuses a bad one with the portable ops too (it passed there before)."""
    monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", kernels)
    monkeypatch.setenv("SGLANG_XPU_LORA_EAGER_DENSE_MIN_TOKENS", "0")
    status, report = run_doctor(capsys, "--json")
    assert status == 1, report["problems"]
    assert any("SGLANG_XPU_LORA_EAGER_DENSE_MIN_TOKENS='0' is not a positive integer" in p for p in report["problems"])


@pytest.mark.parametrize("kernels, status", [("auto", 1), ("torch", 0)])
def test_no_build(kernels, status, capsys, monkeypatch, sglang_plugins_loaded):
    monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", kernels)
    got, text = run_doctor(capsys)
    assert got == status, text
    assert "kernel build sgl_kernel 0.0.0+cpu-devsupport-stub" in text
    assert "patch points " in text
    if status:
        assert "--lora-backend intel_xpu requires --device xpu, got --device cpu" in text
    else:
        assert "OK: --lora-backend intel_xpu can serve on this machine." in text
        assert text.count(" torch / torch ") == len(OP_NAMES)


@pytest.mark.launches
def test_console_script_in_a_fresh_process():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_XPU_LORA")}
    env.update(SGLANG_USE_CPU_ENGINE="1", SGLANG_XPU_LORA_KERNELS="torch")
    script = Path(sys.executable).parent / "sglang-xpu-lora"  # installed next to this interpreter
    result = subprocess.run([str(script), "doctor", "--json"], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["can_serve"] and report["kernels"] == "torch"


def clauses(reason):
    """A selection reason's clauses ("no native op: ...; no Triton: ..."), split outside parentheses."""
    return re.split(r"; (?![^(]*\))", reason)


@pytest.mark.parametrize("build", ["v0.1.0", None], ids=["partial-build", "no-build"])
def test_each_reason_is_printed_once_with_the_ops_it_applies_to(build, emulate, capsys, monkeypatch, sglang_plugins_loaded):
    with contextlib.ExitStack() as stack:
        if build:
            stack.enter_context(emulate(build))
        else:
            monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", "auto")
        _, report = run_doctor(capsys, "--json")
        _, text = run_doctor(capsys)
    shared = {}
    for op in report["ops"]:
        eager = clauses(op["reason"])
        for clause in eager + [c for c in clauses(op["graph_reason"]) if c not in eager]:
            shared.setdefault(clause, []).append(op["op"])
    assert max(len(ops) for ops in shared.values()) > 1  # a reason several ops share (else nothing to group)
    for clause, ops in shared.items():
        assert text.count(clause) == 1, clause
        listed = text[: text.index(clause)].rsplit("- ", 1)[1]  # "all 7 ops: " or the ops' names
        assert listed == f"all {len(OP_NAMES)} ops: " or [o for o in OP_NAMES if o in listed] == [o for o in OP_NAMES if o in ops], (clause, listed)


def test_cpu_needs_the_cpu_engine_switch(capsys, monkeypatch, sglang_plugins_loaded):
    """``sglang serve --device cpu`` without SGLANG_USE_CPU_ENGINE=1 dies in its scheduler (No module
    named 'vllm'; tests/e2e/test_doctor_verdict.py starts it); doctor said OK."""
    monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", "torch")
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE")
    status, report = run_doctor(capsys, "--json", "--device", "cpu")
    assert status == 1 and not report["can_serve"]
    assert report["problems"] == [
        "SGLang serves on the CPU only with SGLANG_USE_CPU_ENGINE=1; without it SGLang takes its generic "
        "platform and its scheduler fails at start-up (No module named 'vllm')"
    ]
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    status, report = run_doctor(capsys, "--json", "--device", "cpu")
    assert status == 0 and report["device"] == "cpu" and report["device_source"] == "--device given"
    status, text = run_doctor(capsys, "--device", "cpu")
    assert status == 0  # the table names the device it was selected for, not an XPU's graphs
    assert "LoRA ops for device cpu (SGLANG_XPU_LORA_KERNELS=torch; provider outside / inside graphs):" in text
