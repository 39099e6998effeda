"""Tiny runs of every benchmark (seconds each), so they never rot. No timing is asserted: what is
checked is that every peer was measured (a finite number), that the ratios the reports print are
the quotients of the timings they come from, the Triton tiers' errors, and the host overhead
benchmark's count of added device-to-host synchronisations (it must be zero)."""

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


def test_ops(tmp_path):
    """With TRITON_INTERPRET=1 (tests/conftest.py) and SGLANG_XPU_LORA_KERNELS=triton the quick run
    includes the intel_xpu tier through SGLang's Triton kernels on a tiny layer, adapters at and
    below max_lora_rank; its output matches the float64 reference, as the portable tier's does."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    run_benchmark("ops", tmp_path, "--seconds", "0.01", SGLANG_XPU_LORA_KERNELS="triton")
    rows = json.loads((tmp_path / "ops-cpu-quick.json").read_text())["rows"]
    assert len(rows) == 3 and {r["real_rank"] for r in rows} == {8, 16}
    for r in rows:
        assert math.isfinite(r["portable_ms"]) and math.isfinite(r["torch_native_ms"]), r
        assert math.isclose(r["speedup_vs_torch_native"], r["torch_native_ms"] / r["portable_ms"]), r
    assert all(math.isfinite(r["intel_xpu_ms"]) and r["intel_xpu_max_error"] < 1e-5 for r in rows)
    assert all(math.isfinite(r["intel_xpu_eager_ms"]) and r["intel_xpu_eager_max_error"] < 1e-5 for r in rows)  # the backend's run_* methods
    assert all(math.isfinite(r["triton_backend_ms"]) for r in rows)
    providers = json.loads((tmp_path / "ops-cpu-quick.json").read_text())["intel_xpu_providers"]
    assert {p["eager"] for p in providers.values()} == {"triton"}
    assert (tmp_path / "ops-cpu-quick.md").read_text().count("\n") >= 5
    assert (tmp_path / "ops-cpu-quick.png").stat().st_size > 1000


def test_host_overhead_adds_no_device_syncs(tmp_path):
    run_benchmark("host_overhead", tmp_path)
    rows = json.loads((tmp_path / "host_overhead-cpu-quick.json").read_text())["rows"]
    assert [r["batch_size"] for r in rows] == [1, 16, 256]
    assert all(r["added_syncs"] == 0 and r["intel_xpu_syncs"] == 0 for r in rows)


def test_sync_cost_counts_the_native_ops_host_reads(tmp_path):
    """The stand-in makes the host reads the research notes list per sgl-kernel-xpu op (counted
    through the aten ops behind them: 21 per module on the decode path), and reports their cost as
    the difference of the two paths' timings."""
    run_benchmark("sync_cost", tmp_path)
    rows = json.loads((tmp_path / "sync-cost-cpu-quick.json").read_text())["rows"]
    assert [r["tokens"] for r in rows] == [1, 4]
    for r in rows:
        assert r["syncs_per_step"] == r["reads_counted_per_step"] == 4 * 21 * r["layers"], r
        assert math.isfinite(r["triton_ms"]) and math.isfinite(r["synced_ms"]), r
        assert math.isclose(r["added_ms"], r["synced_ms"] - r["triton_ms"]), r
        assert math.isclose(r["step_ratio"], r["synced_ms"] / r["triton_ms"]), r


@pytest.mark.e2e
def test_e2e_cpu(tmp_path):
    run_benchmark("e2e_cpu", tmp_path, "--artifacts", str(tmp_path / "artifacts"))
    rows = json.loads((tmp_path / "e2e-cpu-quick.json").read_text())["rows"]
    assert rows
    for r in rows:
        assert math.isfinite(r["intel_xpu_tok_s"]) and math.isfinite(r["torch_native_tok_s"]), r
        assert math.isclose(r["ratio"], r["intel_xpu_tok_s"] / r["torch_native_tok_s"]), r


def test_capture_probe_smoke_on_cpu(tmp_path):
    """The device evidence script's CPU run: no device graphs, so no op is tried and none runs
    natively inside graphs; the layer through the graph table matches the float64 reference."""
    out = tmp_path / "capture-probe-cpu.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.capture_probe", "--device", "cpu", "--quick", "--decode-tokens", "8",
         "--prefill-tokens", "16", "--out", str(out)],
        cwd=REPO, env={**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] and [b["build"] for b in report["builds"]] == ["full", "full-syncfree"]
    for build in report["builds"]:
        assert set(build["eager"].values()) == {"native"} and set(build["graph"].values()) == {"torch"}
        assert len(build["trials"]) == 14 and not any(t["capture_safe"] for t in build["trials"])
        assert all(t["reason"].startswith("not tried: cpu has no device graphs") for t in build["trials"])
        assert all(layer["vs_float64"] < 1e-5 for layer in build["layers"])
