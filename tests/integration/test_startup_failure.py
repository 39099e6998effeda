"""Issue 27 item 4: a scheduler that fails to start ends the launch with an exception in the
launching thread naming the failure (``patches/startup_failure.py``), where SGLang 0.5.23's
scheduler SIGQUITs its parent (whose launch-phase handler, or SIGQUIT's default action off the main
thread, kills the caller's process). The steps of a launch, in this process; the real engine, from
the main thread and another one: ``tests/e2e/test_startup_failure_engine.py``."""

from __future__ import annotations

import multiprocessing
import os
import socket as net
import threading
import time
import types

import pytest

from sglang_xpu_lora.adapters import checked_backends
from sglang_xpu_lora.patches import startup_failure
from sglang_xpu_lora.patches.errors import BackendArgumentError
from sglang_xpu_lora.settings import STARTUP_LAUNCHER_ENV, STARTUP_REPORT_ENV

FAILURE = ValueError("--lora-backend intel_xpu on cpu: LoRA on MoE experts\n  ...")


def server_args(**fields):
    values = dict(enable_lora=True, lora_paths=[], lora_backend="intel_xpu", custom_sigquit_handler=None)
    return types.SimpleNamespace(**{**values, **fields})


def scheduler_died():
    """What SGLang's ``_wait_for_scheduler_ready`` raises when a scheduler process ended."""
    raise RuntimeError("Rank 0 scheduler died during initialization (exit code: 1). ...")


@pytest.fixture
def launch(monkeypatch, sglang_plugins_loaded, tmp_path):
    """A fresh :class:`~startup_failure.Launches`, report files under ``tmp_path``, the children
    killed by a recorder instead of ``kill_process_tree``."""
    import sglang.srt.utils.common as common

    monkeypatch.delenv(checked_backends.ADAPTER_CHECKS_ENV, raising=False)
    monkeypatch.delenv(STARTUP_REPORT_ENV, raising=False)
    monkeypatch.delenv(STARTUP_LAUNCHER_ENV, raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    killed = []
    monkeypatch.setattr(common, "kill_process_tree", lambda pid, **kw: killed.append((pid, kw)))
    return types.SimpleNamespace(launches=startup_failure.Launches(), killed=killed, tmp=tmp_path)


def failing_init(scheduler):
    raise FAILURE


def as_a_scheduler_of_this_process():
    """This process's variables as a scheduler it spawned sees them (its parent is the launcher)."""
    assert os.environ[STARTUP_LAUNCHER_ENV] == str(os.getpid())
    os.environ[STARTUP_LAUNCHER_ENV] = str(os.getppid())


def fail_a_launch(launch):
    """A launch in scope whose scheduler fails in ``__init__``: the exception its wait raises."""
    assert launch.launches.begin(server_args()) is not None
    assert os.environ[STARTUP_REPORT_ENV].startswith(str(launch.tmp))
    as_a_scheduler_of_this_process()
    with pytest.raises(SystemExit) as ended:  # what the scheduler's Scheduler.__init__ hook does
        startup_failure.init_reporting_failure(failing_init, None)
    assert ended.value.code == 1
    with pytest.raises(BackendArgumentError) as raised:
        launch.launches.wait(scheduler_died)
    return raised.value


def test_a_failed_scheduler_raises_in_the_launching_thread_with_its_report(launch):
    """The launch's child processes are ended, not the ones the caller had before (another
    engine's, say)."""
    earlier = multiprocessing.Process(target=time.sleep, args=(60,))
    earlier.start()
    try:
        error = fail_a_launch_spawning(launch)
    finally:
        earlier.terminate()
    assert str(error) == "SGLang's scheduler failed to start: ValueError: --lora-backend intel_xpu on cpu: LoRA on MoE experts ..."
    assert error.code == f"error: {error}"  # sglang serve: the message alone
    assert launch.killed == [(launch.spawned, {})] and earlier.pid != launch.spawned
    assert STARTUP_REPORT_ENV not in os.environ and STARTUP_LAUNCHER_ENV not in os.environ
    assert list(launch.tmp.iterdir()) == []


def fail_a_launch_spawning(launch):
    """:func:`fail_a_launch` with a child process started during the launch (``launch.spawned``)."""
    launch.launches.begin(server_args())
    child = multiprocessing.Process(target=time.sleep, args=(60,))
    child.start()
    launch.spawned = child.pid
    try:
        as_a_scheduler_of_this_process()
        startup_failure.report_failure(FAILURE)
        with pytest.raises(BackendArgumentError) as raised:
            launch.launches.wait(scheduler_died)
    finally:
        child.terminate()
    return raised.value


def test_a_scheduler_whose_parent_is_not_the_launcher_keeps_sglangs_signal(launch):
    """With ``--dp-size`` > 1 the schedulers' parent is SGLang's data-parallel controller, which
    would wait forever on a scheduler that ended quietly: there the failure is reported and
    SGLang's SIGQUIT (to the controller, which it kills) stays."""
    launch.launches.begin(server_args())  # the launcher is this process, not this process's parent
    with pytest.raises(ValueError, match="MoE experts"):
        startup_failure.init_reporting_failure(failing_init, None)
    assert launch.launches.current().reported().startswith("ValueError: --lora-backend intel_xpu")
    launch.launches.wait(lambda: None)


def test_a_launch_refused_after_it_began_leaves_no_variables_to_the_next(launch):
    """SGLang validates the arguments after ``_set_envs_and_config``: a launch refused there
    leaves its variables set, and the next launch, in scope or not, from any thread, clears them."""
    launch.launches.begin(server_args())  # then refused: no wait
    other = startup_failure.Launches()  # another thread's
    assert other.begin(server_args(lora_backend="triton")) is None
    assert STARTUP_REPORT_ENV not in os.environ and STARTUP_LAUNCHER_ENV not in os.environ


def test_a_launch_from_another_thread_raises_there(launch):
    """Off the main thread SGLang installs no SIGQUIT handler, and SIGQUIT's default action would
    kill the process; the scheduler's exit reaches the wait in that thread instead."""
    raised = []
    thread = threading.Thread(target=lambda: raised.append(fail_a_launch(launch)))
    thread.start()
    thread.join()
    assert [type(e) for e in raised] == [BackendArgumentError]


def test_a_scheduler_failing_after_the_launch_ended_leaves_no_report(launch):
    """With ``--dp-size 2`` a second scheduler can fail after the launcher raised and closed the
    launch (seen under load in CI: the report file was written again, after its removal, and left
    behind). The report lives in the launch's own folder, which closing removes, so the late
    scheduler, with the variables it inherited at spawn, writes nothing and leaves nothing."""
    opened = startup_failure.Launch.open()
    inherited = os.environ[STARTUP_REPORT_ENV]
    opened.close()  # the launcher: the launch is over
    os.environ[STARTUP_REPORT_ENV] = inherited  # the late scheduler's environment
    os.environ[STARTUP_LAUNCHER_ENV] = str(os.getppid())
    assert startup_failure.report_failure(FAILURE) is True  # it still ends quietly
    assert list(launch.tmp.iterdir()) == []
    startup_failure.clear_variables()


def test_ready_schedulers_close_the_launch(launch):
    launch.launches.begin(server_args())
    assert launch.launches.wait(lambda: ["info"]) == ["info"]
    assert STARTUP_REPORT_ENV not in os.environ and list(launch.tmp.iterdir()) == []
    assert launch.launches.current() is None and launch.killed == []


def test_a_scheduler_that_died_without_a_report_is_sglangs_error(launch):
    """Killed by the OS (no report): SGLang's own error, the children left to SGLang."""
    launch.launches.begin(server_args())
    with pytest.raises(RuntimeError, match="Rank 0 scheduler died"):
        launch.launches.wait(scheduler_died)
    assert launch.killed == [] and STARTUP_REPORT_ENV not in os.environ


@pytest.mark.parametrize(
    "fields", [{"lora_backend": "triton"}, {"enable_lora": False}, {"custom_sigquit_handler": print}],
    ids=["sglang-backend", "no-lora", "user-handler"],
)
def test_other_launches_keep_sglangs_behaviour(launch, fields):
    """No report to write: the scheduler's failure goes to SGLang's handler (its SIGQUIT)."""
    assert launch.launches.begin(server_args(**fields)) is None and STARTUP_REPORT_ENV not in os.environ
    with pytest.raises(ValueError, match="MoE experts"):
        startup_failure.init_reporting_failure(failing_init, None)


def test_sglangs_own_backends_with_the_checks_on(launch, monkeypatch):
    monkeypatch.setenv(checked_backends.ADAPTER_CHECKS_ENV, "all")
    assert launch.launches.begin(server_args(lora_backend="triton")) is not None
    launch.launches.wait(lambda: None)


def test_the_hooks_are_sglangs_launch_steps(launch, monkeypatch):
    """Through SGLang's own (hooked) functions: a scheduler's ``Scheduler.__init__`` that raises in
    a launch in scope ends its process with status 1, not SGLang's SIGQUIT."""
    from sglang.srt.managers.scheduler import Scheduler

    monkeypatch.setenv(STARTUP_REPORT_ENV, str(launch.tmp / "report.txt"))
    monkeypatch.setenv(STARTUP_LAUNCHER_ENV, str(os.getppid()))
    with pytest.raises(SystemExit):
        Scheduler(None, None)  # SGLang's __init__ fails on these arguments
    assert (launch.tmp / "report.txt").read_text() == "ValueError: config namespace 'device' not published\n"


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
        launch.launches.begin(server_args())
        launch.launches.record(manager)
        as_a_scheduler_of_this_process()
        startup_failure.report_failure(FAILURE)
        with pytest.raises(BackendArgumentError):
            launch.launches.wait(scheduler_died)
        assert socket.closed and context.closed
    finally:
        context.destroy(linger=0)  # whatever failed above, no later garbage collection waits on it
