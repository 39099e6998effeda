from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest


@pytest.fixture
def run_python():
    """Run a Python snippet in a fresh interpreter (SGLang loads plugins once per process).

    The child gets ``SGLANG_USE_CPU_ENGINE=1`` and no ``SGLANG_XPU_LORA_KERNELS`` unless ``env`` sets it.
    """

    def run(code: str, env: dict | None = None, timeout: float = 300.0) -> subprocess.CompletedProcess:
        child_env = {k: v for k, v in os.environ.items() if k != "SGLANG_XPU_LORA_KERNELS"}
        child_env.update({"SGLANG_USE_CPU_ENGINE": "1", **(env or {})})
        return subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)], env=child_env, capture_output=True, text=True, timeout=timeout
        )

    return run
