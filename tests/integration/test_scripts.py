"""The set-up and run scripts as a new user meets them: help without a set-up, an environment
elsewhere through ``SGLANG_XPU_LORA_VENV``, and a failing set-up step that points at its log."""

from __future__ import annotations

import os
import re
import subprocess
import sys
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
    assert "--log LOG" in result.stdout
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


def test_a_failing_demo_shows_its_log_in_full(tmp_path):
    """The demo's terminal has its own lines only; on failure the log it named (SGLang's and the
    libraries' own output, here the traceback) is shown in full, then the failure."""
    not_a_directory = tmp_path / "artifacts"
    not_a_directory.write_text("a file where the demo builds its model")
    log = tmp_path / "logs" / "demo.log"
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / "serve_lora_cpu.py"), "--artifacts", str(not_a_directory), "--log", str(log)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr == ""  # everything not the demo's went to the log
    lines = result.stdout.splitlines()
    assert lines[0] == f"SGLang's own output (warnings, progress bars, logs) goes to {log}"
    assert lines[1].endswith("] building the tiny model, tokenizer and adapters (reused when already built)")
    shown = result.stdout.split(f"--- {log} (SGLang's and the libraries' own output), in full ---\n", 1)[1]
    assert shown.split(f"--- end of {log} ---", 1)[0] == log.read_text()
    assert "Traceback" in log.read_text() and "NotADirectoryError" in log.read_text()
    assert lines[-2:] == ["FAILED:", "  the demo raised (the traceback is at the end of the log)"]
