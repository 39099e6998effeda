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
