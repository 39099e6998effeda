"""Issue 27 item 4, what only the scheduler can decide: an adapter named by a Hugging Face Hub id
that cannot be fetched (offline) fails in SGLang's scheduler after the model load. SGLang 0.5.23's
scheduler SIGQUITs the caller's process, which dies (rc 137 from its launch-phase handler, 131
off the main thread) with the reason in the log only; with the plugin (``patches/startup_failure.py``) ``sglang.Engine(...)`` raises in the caller
with the reason and the caller carries on, and ``sglang serve`` ends with the message alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sglang_cpu_devsupport import serving

pytestmark = pytest.mark.e2e

HUB_ADAPTER = "some-org/no-such-adapter"
REASON = f"LoRA adapter 'hub' cannot be loaded from {HUB_ADAPTER}: "


def offline_env(tmp_path):
    env = {**os.environ, **serving.cpu_env("torch"), "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmp_path)}
    env.pop("SGLANG_CPU_OMP_THREADS_BIND", None)
    return env


#: The scheduler failure of ``--dp-size 2`` on this CPU engine (one NUMA node, no core binding set).
NUMA_REASON = "AssertionError: SGLANG_CPU_OMP_THREADS_BIND is not set, in this case, the total number of ranks"


@pytest.mark.parametrize(
    ("thread", "dp_size", "reason"),
    [
        ("main", 1, "RuntimeError: Failed to load LoRA adapter hub: " + REASON),
        ("other", 1, "RuntimeError: Failed to load LoRA adapter hub: " + REASON),
        ("main", 2, NUMA_REASON),
    ],
    ids=["main-thread", "other-thread", "dp2"],
)
def test_the_engine_raises_in_the_caller(tiny_artifacts, tmp_path, thread, dp_size, reason):
    """From the main thread and from another one (where SGLang installs no SIGQUIT handler and the
    scheduler's SIGQUIT would kill the process: rc 131); with ``--dp-size 2``, whose schedulers'
    parent is SGLang's data-parallel controller (a scheduler that ended quietly would leave it
    waiting forever, and the caller with it)."""
    kwargs = serving.engine_kwargs({**tiny_artifacts, "hub": HUB_ADAPTER}, ["sql-r8", "hub"])
    kwargs["dp_size"] = dp_size
    code = """
import faulthandler, gc, json, sys

def main():
    import sglang
    from sglang_xpu_lora.patches.errors import BackendArgumentError
    try:
        sglang.Engine(**json.loads(sys.argv[1]))
    except BackendArgumentError as exc:
        print("RAISED " + json.dumps(str(exc)))
    # The failed launch's objects are collected: none of them may block (its sockets are closed).
    faulthandler.dump_traceback_later(120, exit=True)
    gc.collect()
    faulthandler.cancel_dump_traceback_later()
    print("CALLER ALIVE")

if __name__ == "__main__":
    if sys.argv[2] == "main":
        main()
    else:
        import threading

        launcher = threading.Thread(target=main)
        launcher.start()
        launcher.join()
"""
    (tmp_path / "tmp").mkdir()
    script = tmp_path / "caller.py"
    script.write_text(code)
    result = subprocess.run(
        [sys.executable, str(script), json.dumps(kwargs), thread], env=offline_env(tmp_path / "tmp"),
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("RAISED ")]
    message = json.loads(line.removeprefix("RAISED "))
    assert message.startswith("SGLang's scheduler failed to start: " + reason), message
    assert "CALLER ALIVE" in result.stdout
    assert not [p for p in (tmp_path / "tmp").iterdir() if p.name.startswith("sglang-xpu-lora-startup-")]


def test_sglang_serve_ends_with_the_message_alone(tiny_artifacts, tmp_path):
    argv = serving.server_argv({**tiny_artifacts, "hub": HUB_ADAPTER}, ["sql-r8", "hub"], serving.free_port())
    result = subprocess.run(argv, env=offline_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: SGLang's scheduler failed to start: RuntimeError: Failed to load LoRA adapter hub: " + REASON), last
