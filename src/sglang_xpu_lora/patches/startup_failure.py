"""Targets: sglang.srt.entrypoints.engine._set_envs_and_config (AFTER),
    sglang.srt.managers.tokenizer_manager.TokenizerManager.__init__ (AFTER),
    sglang.srt.entrypoints.engine._wait_for_scheduler_ready (AROUND), in the launching thread, and
    sglang.srt.managers.scheduler.Scheduler.__init__ (AROUND), in each scheduler process.
Why: what only the scheduler can decide (an adapter named by a Hub id that does not load, a backend's
    refusal of the loaded model's LoRA targets) fails in ``Scheduler.__init__``; SGLang 0.5.23's
    scheduler process logs the traceback and sends SIGQUIT to its parent. Launched from the main
    thread, the parent's launch-phase handler (``_set_envs_and_config``) kills the whole process
    tree, itself included; launched from another thread (no handler there), SIGQUIT's default
    action kills it. Either way a ``sglang.Engine(...)`` caller dies (rc 137 or 131) and the
    reason exists only in the log.
How: for launches with LoRA on a backend in scope (:mod:`sglang_xpu_lora.adapters.checked_backends`)
    and no ``custom_sigquit_handler`` (a ``ServerArgs`` field, a callable, set from Python as in
    ``sglang.Engine(..., custom_sigquit_handler=...)``: SGLang 0.5.23 has no command-line flag for
    it), the launching thread opens a :class:`Launch`: a report file and the launcher's pid, named
    in :data:`~sglang_xpu_lora.settings.STARTUP_REPORT_ENV` and
    :data:`~sglang_xpu_lora.settings.STARTUP_LAUNCHER_ENV` (inherited by the processes it
    spawns), the child processes that existed before it, and the ``TokenizerManager`` objects made
    during it. A scheduler whose ``__init__`` raises appends ``Type: message`` to the report (the
    first failure of a launch is its reason) and, when its parent is the launcher, logs the
    traceback as SGLang does and ends its process with ``SystemExit(1)`` instead of signalling it.
    (With ``--dp-size`` > 1 the parent is SGLang's data-parallel controller, which waits on the
    scheduler without noticing that it ended: there SGLang's SIGQUIT stays, and kills the
    controller, which installs no handler.) SGLang's wait for the schedulers then raises its
    "scheduler died" ``RuntimeError`` in the launching thread, whatever thread it is; with a
    report, the plugin ends the child processes started during the launch (``kill_process_tree``
    of each: other engines of the caller keep theirs), closes the ZeroMQ sockets of the launch's
    ``TokenizerManager`` (made before the wait and abandoned with the failed launch, its context's
    ``__del__`` would wait forever on them at a later garbage collection, hanging the caller) and
    raises :class:`~sglang_xpu_lora.patches.errors.BackendArgumentError` with the report instead,
    so ``Engine(...)`` raises in the caller and ``sglang serve`` ends with the message alone. A
    scheduler that dies without a report (killed by the OS) is SGLang's error. A launch out of
    scope clears the variables (a launch refused at argument validation, after
    ``_set_envs_and_config``, leaves them set). The variables are per process: two launches at
    once from two threads share them, and the first to fail reports for both.
Checked against: SGLang 0.5.23.
Remove when: SGLang raises scheduler start-up failures in the launching caller.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Optional

from sglang_xpu_lora.adapters import checked_backends
from sglang_xpu_lora.patches.errors import BackendArgumentError
from sglang_xpu_lora.patches.undo import UndoStack, queue_hook
from sglang_xpu_lora.registry import LoRABackendRegistry
from sglang_xpu_lora.settings import STARTUP_LAUNCHER_ENV, STARTUP_REPORT_ENV
from sglang_xpu_lora.upstream import targets
from sglang_xpu_lora.upstream.compat import resolve

logger = logging.getLogger(__name__)


class Launch:
    """One launch in scope, in its launching thread: ``report``, the file its schedulers append
    their start-up failures to; ``before``, the pids of this process's child processes when it
    began; ``managers``, the ``TokenizerManager`` objects made during it."""

    def __init__(self, report: Path, before: set[int]):
        self.report, self.before = report, before
        self.managers: list[Any] = []

    @classmethod
    def open(cls) -> "Launch":
        """A launch with a fresh report path in a folder of its own (the file is written only by a
        scheduler that fails), named with this process's pid for the processes about to be
        spawned. Removing the folder at :meth:`close` leaves a scheduler that fails later (with
        ``--dp-size 2`` a second one may still be ending) nowhere to write."""
        report = Path(tempfile.mkdtemp(prefix="sglang-xpu-lora-startup-")) / "report.txt"
        os.environ[STARTUP_REPORT_ENV] = str(report)
        os.environ[STARTUP_LAUNCHER_ENV] = str(os.getpid())
        return cls(report, {child.pid for child in multiprocessing.active_children()})

    def close(self) -> None:
        """The launch is over (ready, or failed): its report and folder removed, the variables unset."""
        shutil.rmtree(self.report.parent, ignore_errors=True)
        if os.environ.get(STARTUP_REPORT_ENV) == str(self.report):
            clear_variables()

    def reported(self) -> Optional[str]:
        """What the schedulers reported, one ``Type: message`` each (repeats dropped), or None."""
        try:
            lines = self.report.read_text().strip().splitlines()
        except OSError:
            return None
        return "; ".join(dict.fromkeys(lines)) or None

    def close_sockets(self) -> None:
        """Close the recorded managers' ZeroMQ sockets and contexts without lingering."""
        import zmq

        for manager in self.managers:
            for value in list(vars(manager).values()):
                if isinstance(value, zmq.Socket) and not value.closed:
                    value.context.destroy(linger=0)
        self.managers.clear()

    def fail(self, reported: str) -> BackendArgumentError:
        """End the launch's child processes and close its sockets; the error to raise.

        :param reported: what the schedulers reported (:meth:`reported`).
        """
        kill_process_tree = resolve(targets.KILL_PROCESS_TREE)
        for child in multiprocessing.active_children():
            if child.pid not in self.before:
                kill_process_tree(child.pid)
        self.close_sockets()
        return BackendArgumentError(f"SGLang's scheduler failed to start: {reported}")


def in_scope(server_args: Any) -> bool:
    """Whether a launch's scheduler start-up failures are raised in its caller: LoRA on a backend
    in scope, and no ``custom_sigquit_handler`` (the ``ServerArgs`` field, set from Python only;
    whose user wants SGLang's SIGQUIT)."""
    cfg = resolve(targets.RESOLVING_VIEW)(server_args)
    return (
        bool(cfg.enable_lora or cfg.lora_paths)
        and checked_backends.applies_to(cfg.lora_backend)
        and cfg.custom_sigquit_handler is None
    )


def clear_variables() -> None:
    """Unset the launch's variables: no launch of this process is open."""
    os.environ.pop(STARTUP_REPORT_ENV, None)
    os.environ.pop(STARTUP_LAUNCHER_ENV, None)


def report_failure(exc: BaseException) -> bool:
    """In a scheduler process whose ``__init__`` raised ``exc``: append ``Type: message`` to the
    launch's report file when nothing is reported yet (the first failure is the reason). Returns
    whether this process should end without signalling its parent: a launch in scope, and the
    parent is the launcher (whose wait notices the ended process)."""
    report = os.environ.get(STARTUP_REPORT_ENV)
    if not report:
        return False
    if not os.path.exists(report):
        try:
            with open(report, "a") as file:
                file.write(f"{type(exc).__name__}: {' '.join(str(exc).split())}\n")
        except FileNotFoundError:  # the launch is over (its folder removed): nobody reads it now
            pass
    return os.environ.get(STARTUP_LAUNCHER_ENV) == str(os.getppid())


def init_reporting_failure(original: Callable, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """SGLang's ``Scheduler.__init__``; a failure in a launch in scope is reported
    (:func:`report_failure`) and, where the parent is the launcher, logged and ended with status 1
    instead of SGLang's SIGQUIT to the parent.

    Raises:
        SystemExit: (1) after a reported failure (not an ``Exception``, which SGLang's
            ``run_scheduler_process`` would catch and signal).
        Exception: the failure itself otherwise (SGLang logs it and signals the parent).
    """
    try:
        return original(scheduler, *args, **kwargs)
    except Exception as exc:
        if not report_failure(exc):
            raise
        logger.error("Scheduler hit an exception", exc_info=exc)
    raise SystemExit(1)  # multiprocessing flushes the standard streams as the process ends


class Launches:
    """The launches in scope of this process, one per launching thread (SGLang launches an engine
    from any thread, and each step below runs in the thread that launches)."""

    def __init__(self):
        self.local = threading.local()  # .launch: the open Launch of this thread, or None

    def current(self) -> Optional[Launch]:
        """The launch this thread runs, if in scope."""
        return getattr(self.local, "launch", None)

    def begin(self, server_args: Any) -> Optional[Launch]:
        """After SGLang's ``_set_envs_and_config``: a launch in scope (:func:`in_scope`) opens its
        :class:`Launch`; a launch of this thread left open before is closed, and the variables of
        any left unset."""
        if self.current() is not None:
            self.current().close()
        clear_variables()  # what a launch refused after _set_envs_and_config left set
        self.local.launch = Launch.open() if in_scope(server_args) else None
        return self.local.launch

    def record(self, manager: Any) -> None:
        """A ``TokenizerManager`` made during this thread's launch."""
        if self.current() is not None:
            self.current().managers.append(manager)

    def wait(self, original: Callable, *args: Any, **kwargs: Any) -> Any:
        """SGLang's ``_wait_for_scheduler_ready``; a scheduler that died after reporting ends the
        launch (:meth:`Launch.fail`). The launch is closed either way.

        Raises:
            BackendArgumentError: with the schedulers' report.
            RuntimeError: SGLang's own, for a scheduler that died without a report.
        """
        launch, self.local.launch = self.current(), None
        try:
            return original(*args, **kwargs)
        except RuntimeError:
            reported = launch.reported() if launch is not None else None
            if reported is None:
                raise
            raise launch.fail(reported) from None
        finally:
            if launch is not None:
                launch.close()


def apply(registry: LoRABackendRegistry, undo: UndoStack) -> None:
    launches = Launches()

    def after_set_envs_and_config(result, server_args, *args, **kwargs):
        launches.begin(server_args)
        return result

    def after_tokenizer_manager_init(result, manager, *args, **kwargs):
        launches.record(manager)
        return result

    queue_hook(targets.SET_ENVS_AND_CONFIG, after_set_envs_and_config, "AFTER", undo)
    queue_hook(targets.WAIT_FOR_SCHEDULER_READY, launches.wait, "AROUND", undo)
    queue_hook(targets.TOKENIZER_MANAGER_INIT, after_tokenizer_manager_init, "AFTER", undo)
    queue_hook(targets.SCHEDULER_INIT, init_reporting_failure, "AROUND", undo)
