"""Targets: sglang.srt.entrypoints.engine._set_envs_and_config (AFTER),
    sglang.srt.entrypoints.engine._wait_for_scheduler_ready (AROUND),
    sglang.srt.managers.tokenizer_manager.TokenizerManager.__init__ (AFTER), in the launching
    process, and sglang.srt.managers.scheduler.Scheduler.__init__ (AROUND), in each scheduler
    process.
Why: what only the scheduler can decide (an adapter named by a Hub id that does not load, a backend's
    refusal of the loaded model's LoRA targets) fails in ``Scheduler.__init__``; SGLang 0.5.23's
    scheduler process logs the traceback and sends SIGQUIT to its parent, whose launch-phase
    handler (``_set_envs_and_config``) kills the whole process tree, itself included: a
    ``sglang.Engine(...)`` caller dies (rc 137) and the reason exists only in the log.
How: for launches with LoRA on a backend in scope (:mod:`sglang_xpu_lora.adapters.checked_backends`),
    after SGLang installs its launch-phase SIGQUIT handler (main thread, no
    ``--custom-sigquit-handler``) the plugin installs its own, :class:`LaunchPhaseHandler`, and
    names a report file (:data:`~sglang_xpu_lora.settings.STARTUP_REPORT_ENV`, inherited by the
    schedulers it spawns). A scheduler whose ``__init__`` raises appends ``Type: message`` to that
    file before SGLang's handler in that process signals the parent. On SIGQUIT the plugin's
    handler ends the launch's child processes as SGLang's does (``kill_process_tree`` of this
    process's children), closes the ZeroMQ sockets of the launch's ``TokenizerManager`` (made
    before the wait; abandoned with the failed launch, its context's ``__del__`` would wait forever
    on them at a later garbage collection, hanging the caller) and raises
    :class:`~sglang_xpu_lora.patches.errors.BackendArgumentError` with the report in the
    launching thread, so ``Engine(...)`` raises in the caller and ``sglang serve`` ends with the
    message alone. Once the schedulers are ready (or the wait failed
    otherwise) SGLang's handler is put back, so the running phase is SGLang's.
Checked against: SGLang 0.5.23.
Remove when: SGLang raises scheduler start-up failures in the launching caller.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Optional

from sglang_xpu_lora.adapters import checked_backends
from sglang_xpu_lora.patches.errors import BackendArgumentError
from sglang_xpu_lora.patches.undo import UndoStack, queue_hook
from sglang_xpu_lora.registry import LoRABackendRegistry
from sglang_xpu_lora.settings import STARTUP_REPORT_ENV
from sglang_xpu_lora.upstream import targets
from sglang_xpu_lora.upstream.compat import resolve


class LaunchPhaseHandler:
    """The SIGQUIT handler of a launch in scope: the children failed to start.

    ``previous`` is the handler SGLang installed (put back once the schedulers are ready);
    ``report`` the file the schedulers append their failures to; ``managers`` the launch's
    ``TokenizerManager`` objects, recorded when made.
    """

    def __init__(self, previous: Callable, report: Path):
        self.previous, self.report = previous, report
        self.managers: list[Any] = []

    def close_sockets(self) -> None:
        """Close the recorded managers' ZeroMQ sockets and contexts without lingering."""
        import zmq

        for manager in self.managers:
            for value in list(vars(manager).values()):
                if isinstance(value, zmq.Socket) and not value.closed:
                    value.context.destroy(linger=0)
        self.managers.clear()

    def failure(self) -> str:
        """What the schedulers reported (and the report file removed), or a pointer to the log."""
        try:
            lines = self.report.read_text().strip().splitlines()
        except OSError:
            lines = []
        self.report.unlink(missing_ok=True)
        reported = "; ".join(dict.fromkeys(lines)) or "no reason reported; the scheduler's log says why"
        return f"SGLang's scheduler failed to start: {reported}"

    def __call__(self, signum: int, frame: Any) -> None:
        """End the launch's child processes and raise in the launching thread.

        Raises:
            BackendArgumentError: with the schedulers' report.
        """
        signal.signal(signal.SIGQUIT, self.previous)
        os.environ.pop(STARTUP_REPORT_ENV, None)
        message = self.failure()
        resolve(targets.KILL_PROCESS_TREE)(os.getpid(), include_parent=False)
        self.close_sockets()
        raise BackendArgumentError(message)


def in_scope(server_args: Any) -> bool:
    """Whether the launch serves LoRA on a backend whose start-up failures the plugin reports."""
    cfg = resolve(targets.RESOLVING_VIEW)(server_args)
    return bool(cfg.enable_lora or cfg.lora_paths) and checked_backends.applies_to(cfg.lora_backend)


def take_over_sigquit(server_args: Any) -> Optional[LaunchPhaseHandler]:
    """After SGLang's ``_set_envs_and_config``: install :class:`LaunchPhaseHandler` in place of
    SGLang's launch-phase SIGQUIT handler, for launches in scope, from the main thread, when the
    user set no ``--custom-sigquit-handler``; returns it (None when SGLang's stays)."""
    os.environ.pop(STARTUP_REPORT_ENV, None)
    if threading.current_thread() is not threading.main_thread():
        return None  # SGLang installs no handler there (and only the main thread may)
    current = signal.getsignal(signal.SIGQUIT)
    cfg = resolve(targets.RESOLVING_VIEW)(server_args)
    if not in_scope(server_args) or cfg.custom_sigquit_handler:
        return None
    if not callable(current) or isinstance(current, LaunchPhaseHandler):
        return None  # not SGLang's launch-phase handler
    descriptor, name = tempfile.mkstemp(prefix="sglang-xpu-lora-startup-", suffix=".txt")
    os.close(descriptor)
    report = Path(name)
    report.unlink()  # written only by a scheduler that fails
    handler = LaunchPhaseHandler(current, report)
    signal.signal(signal.SIGQUIT, handler)
    os.environ[STARTUP_REPORT_ENV] = str(report)
    return handler


def give_back_sigquit() -> None:
    """Put SGLang's launch-phase handler back (the schedulers are ready, or failed otherwise)."""
    current = signal.getsignal(signal.SIGQUIT)
    if isinstance(current, LaunchPhaseHandler):
        signal.signal(signal.SIGQUIT, current.previous)
        current.report.unlink(missing_ok=True)
        os.environ.pop(STARTUP_REPORT_ENV, None)


def record_manager(manager: Any) -> None:
    """A ``TokenizerManager`` made during a launch in scope: recorded on its handler."""
    current = signal.getsignal(signal.SIGQUIT)
    if isinstance(current, LaunchPhaseHandler):
        current.managers.append(manager)


def report_failure(exc: BaseException) -> None:
    """In a scheduler process: append ``Type: message`` to the launch's report file, if any."""
    report = os.environ.get(STARTUP_REPORT_ENV)
    if report:
        with open(report, "a") as file:
            file.write(f"{type(exc).__name__}: {' '.join(str(exc).split())}\n")


def apply(registry: LoRABackendRegistry, undo: UndoStack) -> None:
    def after_set_envs_and_config(result, server_args, *args, **kwargs):
        take_over_sigquit(server_args)
        return result

    def around_wait_for_scheduler_ready(original, *args, **kwargs):
        try:
            return original(*args, **kwargs)
        finally:
            give_back_sigquit()

    def around_scheduler_init(original, scheduler, *args, **kwargs):
        try:
            return original(scheduler, *args, **kwargs)
        except Exception as exc:
            report_failure(exc)
            raise

    queue_hook(targets.SET_ENVS_AND_CONFIG, after_set_envs_and_config, "AFTER", undo)
    queue_hook(targets.WAIT_FOR_SCHEDULER_READY, around_wait_for_scheduler_ready, "AROUND", undo)
    def after_tokenizer_manager_init(result, manager, *args, **kwargs):
        record_manager(manager)
        return result

    queue_hook(targets.TOKENIZER_MANAGER_INIT, after_tokenizer_manager_init, "AFTER", undo)
    queue_hook(targets.SCHEDULER_INIT, around_scheduler_init, "AROUND", undo)
