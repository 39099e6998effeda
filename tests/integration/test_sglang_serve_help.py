"""What the README's troubleshooting says about ``sglang serve --help``: SGLang 0.5.23 prints the help
before it loads plugins, so ``--lora-backend`` lists only SGLang's own backends (the option still
accepts ``intel_xpu``: ``tests/e2e/test_engine_parity.py`` serves through it). When SGLang starts
loading plugins first, this test fails and the README line can go."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.launches

#: SGLang's ``sglang`` console script, run through its entry point (so that it works wherever SGLang
#: is importable, also where the script itself is not next to this interpreter).
SGLANG_CLI = (
    "import sys; from importlib.metadata import entry_points; "
    "(ep,) = entry_points(group='console_scripts', name='sglang'); sys.argv[0] = 'sglang'; sys.exit(ep.load()())"
)


def test_sglang_serve_help_is_printed_before_plugins_load():
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", SGLANG_CLI, "serve", "--help"], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    choices = re.search(r"--lora-backend \{([^}]*)\}", result.stdout)
    assert choices, result.stdout[-2000:]
    assert "triton" in choices.group(1).split(",")
    assert "intel_xpu" not in choices.group(1).split(",")
