"""``sglang-xpu-lora doctor --device cpu`` against a real ``sglang serve --device cpu`` started in the
same environment: where doctor says CANNOT SERVE, the server must not start, and doctor names the
cause the server dies of.

The other direction (doctor says OK, and the server then starts and serves) is
``test_examples.py::test_bench_serving_script_on_cpu``: ``examples/xpu/serve_multi_lora.sh`` runs
``doctor --device $DEVICE`` before it starts each server, in the environment the server gets.

Each environment below is the CPU demo's (``serving.cpu_env``) with one thing taken away that
SGLang's CPU engine needs; doctor said OK to the first one before it checked what the server needs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_cpu_devsupport import serving

pytestmark = pytest.mark.e2e

#: name: (environment changes, what doctor's reason must say, what the server's log shows: one of)
BROKEN = {
    "no CPU engine switch": ({"SGLANG_USE_CPU_ENGINE": None}, "SGLANG_USE_CPU_ENGINE=1", ("No module named 'vllm'",)),
    "no pinned-memory shim": (
        {"SGLANG_PLUGINS": "intel_xpu_lora,no_leftovers"}, "pin host memory",
        ("Found no NVIDIA driver", "pin_memory=True requires"),  # torch's CUDA build, its CPU build
    ),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_doctor_refuses_where_the_server_cannot_start(case, tiny_artifacts, tmp_path, monkeypatch):
    changes, doctor_says, server_says = BROKEN[case]
    for name, value in {**serving.cpu_env("torch"), **changes}.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)  # started_process passes os.environ to the server

    doctor = subprocess.run(
        [str(Path(sys.executable).parent / "sglang-xpu-lora"), "doctor", "--device", "cpu"],
        env=dict(os.environ), capture_output=True, text=True, timeout=600,
    )
    verdict = " ".join(doctor.stdout.split())
    assert doctor.returncode == 1, doctor.stdout[-3000:]
    assert "CANNOT SERVE --lora-backend intel_xpu:" in verdict and doctor_says in verdict, doctor.stdout[-3000:]

    port = serving.free_port()
    log = tmp_path / "server.log"
    with serving.started_process(serving.server_argv(tiny_artifacts, ["sql-r8"], port), {}, log) as server:
        with pytest.raises(RuntimeError, match="the server exited"):
            serving.wait_until_healthy(server, port, log, timeout=600)
    assert any(text in log.read_text() for text in server_says), log.read_text()[-3000:]
