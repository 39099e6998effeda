"""Issue 27 item 4: a scheduler that fails to start ends the launch with an exception in the
launching thread naming the failure (``patches/startup_failure.py``), where SGLang 0.5.23's
launch-phase SIGQUIT handler kills the caller's process; SGLang's handler is put back once the
schedulers are ready. The real engine: ``tests/e2e/test_startup_failure_engine.py``."""

from __future__ import annotations

import os
import signal
import socket as net
import types

import pytest

from sglang_xpu_lora.adapters import checked_backends
from sglang_xpu_lora.patches import startup_failure
from sglang_xpu_lora.patches.errors import BackendArgumentError
from sglang_xpu_lora.settings import STARTUP_REPORT_ENV


def server_args(**fields):
    values = dict(enable_lora=True, lora_paths=[], lora_backend="intel_xpu", custom_sigquit_handler=None)
    return types.SimpleNamespace(**{**values, **fields})


@pytest.fixture
def launch(monkeypatch, sglang_plugins_loaded, tmp_path):
    """SGLang's launch-phase SIGQUIT handler installed (a stand-in recording calls), the children
    killed by a recorder instead of ``kill_process_tree``; the process's own handler restored."""
    import sglang.srt.utils.common as common

    monkeypatch.delenv(checked_backends.ADAPTER_CHECKS_ENV, raising=False)
    monkeypatch.delenv(STARTUP_REPORT_ENV, raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    killed, sglangs = [], []
    monkeypatch.setattr(common, "kill_process_tree", lambda pid, **kw: killed.append((pid, kw)))
    sglang_handler = lambda signum, frame: sglangs.append(signum)  # noqa: E731
    before = signal.signal(signal.SIGQUIT, sglang_handler)
    try:
        yield types.SimpleNamespace(killed=killed, sglang_handler=sglang_handler, sglangs=sglangs, tmp=tmp_path)
    finally:
        signal.signal(signal.SIGQUIT, before)


def test_a_failed_scheduler_raises_in_the_launching_thread_with_its_report(launch):
    handler = startup_failure.take_over_sigquit(server_args())
    assert handler is not None and signal.getsignal(signal.SIGQUIT) is handler
    assert os.environ[STARTUP_REPORT_ENV].startswith(str(launch.tmp))
    # What a scheduler's Scheduler.__init__ hook does before SGLang signals the parent.
    startup_failure.report_failure(ValueError("--lora-backend intel_xpu on cpu: LoRA on MoE experts\n  ..."))
    with pytest.raises(BackendArgumentError) as raised:
        os.kill(os.getpid(), signal.SIGQUIT)
    assert str(raised.value) == (
        "SGLang's scheduler failed to start: ValueError: --lora-backend intel_xpu on cpu: LoRA on MoE experts ..."
    )
    assert raised.value.code == f"error: {raised.value}"  # sglang serve: the message alone
    assert launch.killed == [(os.getpid(), {"include_parent": False})] and launch.sglangs == []
    assert signal.getsignal(signal.SIGQUIT) is launch.sglang_handler
    assert STARTUP_REPORT_ENV not in os.environ and list(launch.tmp.iterdir()) == []


def test_ready_schedulers_give_sglang_its_handler_back(launch):
    startup_failure.take_over_sigquit(server_args())
    startup_failure.give_back_sigquit()
    assert signal.getsignal(signal.SIGQUIT) is launch.sglang_handler and STARTUP_REPORT_ENV not in os.environ
    os.kill(os.getpid(), signal.SIGQUIT)  # the running phase is SGLang's
    assert launch.sglangs == [signal.SIGQUIT] and launch.killed == []
    assert list(launch.tmp.iterdir()) == []


@pytest.mark.parametrize(
    "fields", [{"lora_backend": "triton"}, {"enable_lora": False}, {"custom_sigquit_handler": print}],
    ids=["sglang-backend", "no-lora", "user-handler"],
)
def test_other_launches_keep_sglangs_handler(launch, fields):
    assert startup_failure.take_over_sigquit(server_args(**fields)) is None
    assert signal.getsignal(signal.SIGQUIT) is launch.sglang_handler and STARTUP_REPORT_ENV not in os.environ


def test_a_launch_from_another_thread_keeps_sglangs_handler(launch):
    """SGLang installs no SIGQUIT handler from a thread other than the main one; neither does the
    plugin (only the main thread may)."""
    import threading

    taken = []
    thread = threading.Thread(target=lambda: taken.append(startup_failure.take_over_sigquit(server_args())))
    thread.start()
    thread.join()
    assert taken == [None] and signal.getsignal(signal.SIGQUIT) is launch.sglang_handler


def test_sglangs_own_backends_with_the_checks_on(launch, monkeypatch):
    monkeypatch.setenv(checked_backends.ADAPTER_CHECKS_ENV, "all")
    assert startup_failure.take_over_sigquit(server_args(lora_backend="triton")) is not None
    startup_failure.give_back_sigquit()


def test_a_failed_launch_closes_its_tokenizer_managers_sockets(launch):
    """The launch's ``TokenizerManager`` (made before the wait) is abandoned with the failed
    launch; a ZeroMQ socket of its with a message queued for the dead scheduler would make its
    context's ``__del__`` wait forever at a later garbage collection (the caller hangs, e.g. in its
    next ``sglang.Engine(...)``). The failure closes them without lingering."""
    import zmq

    context = zmq.Context()
    try:
        socket = context.socket(zmq.PUSH)
        # A port nothing listens on (an ipc:// path under pytest's tmp_path can exceed the
        # 107-byte limit of a socket path, as in the sdist's test run).
        with net.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            port = listener.getsockname()[1]
        socket.connect(f"tcp://127.0.0.1:{port}")
        socket.send(b"request", zmq.NOBLOCK)  # queued: nothing reads it
        manager = types.SimpleNamespace(send_to_scheduler=socket, name="tokenizer manager")
        startup_failure.take_over_sigquit(server_args())
        startup_failure.record_manager(manager)
        with pytest.raises(BackendArgumentError):
            os.kill(os.getpid(), signal.SIGQUIT)
        assert socket.closed and context.closed
        startup_failure.record_manager(manager)  # after the launch: SGLang's handler, nothing recorded
    finally:
        context.destroy(linger=0)  # whatever failed above, no later garbage collection waits on it
