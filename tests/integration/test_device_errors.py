"""``--lora-backend intel_xpu`` on a device it cannot use is refused at argument resolution, by SGLang's
real resolution pipeline, with a message that says which device SGLang picked and why, why
``intel_xpu`` needs ``xpu`` and what to set to try it on CPU; ``--device xpu`` without an XPU gets
the plugin's hint instead of SGLang's "No GPU memory values found."; and the launcher ends with
that one message, not a traceback.

This machine has no XPU (and its torch is not an XPU build), as a user's CPU-only machine.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from sglang_cpu_devsupport import serving

pytestmark = pytest.mark.launches

RESOLVE = """
import json
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import ServerArgs

outcome = {{}}
for name, device in {cases}:
    args = ServerArgs(model_path={model!r}, lora_paths=["sql={adapter}"], lora_backend="intel_xpu",
                      max_lora_rank=32, device=device)
    try:
        args.resolve_once()
        args.check_server_args()
        outcome[name] = "accepted"
    except ValueError as exc:  # the plugin's BackendArgumentError is one
        outcome[name] = "refused: " + str(exc)
    except Exception as exc:
        outcome[name] = f"{{type(exc).__name__}}: {{exc}}"
print("OUTCOME", json.dumps(outcome))
"""


def resolve_cases(run_python, tiny_artifacts, cases: dict, env: dict) -> dict:
    """Run SGLang's resolution and validation of ``intel_xpu`` server arguments, one per
    ``{name: device}`` case, in a fresh process with ``env``; the outcome per case."""
    import json

    code = RESOLVE.format(
        cases=list(cases.items()), model=str(tiny_artifacts["base"]), adapter=str(tiny_artifacts["sql-r8"])
    )
    result = run_python(code, env=env, timeout=600)
    lines = [line for line in result.stdout.splitlines() if line.startswith("OUTCOME ")]
    assert lines, result.stderr[-3000:]
    return json.loads(lines[0].removeprefix("OUTCOME "))


def test_cpu_engine_machine(run_python, tiny_artifacts):
    """With SGLANG_USE_CPU_ENGINE=1 (as on the project's CPU machines) and the default kernels."""
    outcome = resolve_cases(
        run_python, tiny_artifacts, {"no --device": None, "--device xpu": "xpu", "--device cpu": "cpu"},
        env={"SGLANG_XPU_LORA_KERNELS": "auto"},
    )
    picked = outcome["no --device"]
    assert picked.startswith("refused: --lora-backend intel_xpu requires --device xpu, got --device cpu "
                             "(SGLang picked it: --device was not given and SGLANG_USE_CPU_ENGINE=1 makes "
                             "SGLang serve on the CPU; torch sees no XPU: this torch ("), picked
    assert "is not an XPU build)" in picked
    assert "its LoRA kernels are Intel GPU kernels" in picked
    assert "set SGLANG_XPU_LORA_KERNELS=torch and SGLANG_USE_CPU_ENGINE=1 and pass --device cpu" in picked

    no_xpu = outcome["--device xpu"]
    assert no_xpu.startswith("refused: --lora-backend intel_xpu runs on --device xpu, but torch sees no XPU: "
                             "this torch ("), no_xpu  # not SGLang's "No GPU memory values found."
    assert "`sglang-xpu-lora doctor` shows what this Python sees" in no_xpu
    assert "set SGLANG_XPU_LORA_KERNELS=torch" in no_xpu

    given = outcome["--device cpu"]
    assert given.startswith("refused: --lora-backend intel_xpu requires --device xpu, got --device cpu; "), given
    assert "SGLang picked" not in given  # the user chose it


def test_machine_without_any_device(run_python, tiny_artifacts):
    """Without SGLANG_USE_CPU_ENGINE SGLang finds no device here (its own error: "No accelerator
    ... is available."); the refusal says so and what to set."""
    outcome = resolve_cases(run_python, tiny_artifacts, {"no --device": None}, env={"SGLANG_USE_CPU_ENGINE": "0"})
    refused = outcome["no --device"]
    assert refused.startswith("refused: --lora-backend intel_xpu requires --device xpu, and SGLang found no "
                              "device to serve on (--device was not given): torch sees no XPU"), refused
    assert "SGLANG_USE_CPU_ENGINE is not 1" in refused and "set SGLANG_XPU_LORA_KERNELS=torch" in refused


def test_launcher_ends_with_the_one_message(tiny_artifacts, tmp_path):
    """``sglang serve`` without ``--device`` on this machine: one ``error:`` line, no traceback, no
    model load."""
    argv = serving.server_argv(tiny_artifacts, ["sql-r8"], serving.free_port(), log_level="info")
    del argv[argv.index("--device") : argv.index("--device") + 2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_XPU_LORA")}
    result = subprocess.run(argv, env={**env, "TMPDIR": str(tmp_path)}, capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --lora-backend intel_xpu requires --device xpu, got --device cpu (SGLang "
                           "picked it: --device was not given"), result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "Load weight" not in result.stderr + result.stdout
