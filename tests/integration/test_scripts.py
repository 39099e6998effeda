"""The set-up and run scripts as a new user meets them: help without a set-up, an environment
elsewhere through ``SGLANG_XPU_LORA_VENV``, and a failing set-up step that points at its log."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_script(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_XPU_LORA_VENV", "PYTHON")}
    return subprocess.run(
        ["bash", str(REPO / "scripts" / script), *args], env={**full_env, **env},
        capture_output=True, text=True, timeout=120,
    )


def test_run_example_help_needs_no_environment(tmp_path):
    venv = tmp_path / "no-venv-yet"
    result = run_script("run_example.sh", "--help", SGLANG_XPU_LORA_VENV=str(venv))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: run_example.sh [-h] [--artifacts ARTIFACTS] [--skip-server]")
    assert "sglang serve" in result.stdout and "``" not in result.stdout
    assert not venv.exists(), "--help must not build the environment"
    assert "[setup]" not in result.stdout + result.stderr


def test_failing_set_up_step_prints_one_line_and_the_log_path(tmp_path):
    venv = tmp_path / "venv"
    result = run_script("setup_cpu_env.sh", SGLANG_XPU_LORA_VENV=str(venv), PYTHON="false")
    assert result.returncode == 1
    first, second = result.stdout.splitlines()
    assert first == f"[setup] building {venv} (pip output: {venv}/setup.log)"
    assert re.fullmatch(r"\[setup\] 0/3 virtual environment \(false\) +FAILED after \d+ s", second), second
    assert result.stderr.splitlines()[-1] == f"[setup] failed; the full output is in {venv}/setup.log"
    assert "=== 0/3 virtual environment (false): false -m venv" in (venv / "setup.log").read_text()


def test_run_scripts_use_the_environment_named_by_sglang_xpu_lora_venv():
    for script in ("run_tests.sh", "run_example.sh"):
        text = (REPO / "scripts" / script).read_text()
        assert 'VENV=${SGLANG_XPU_LORA_VENV:-.venv}' in text and 'exec "$VENV/bin/python"' in text, script
