"""Removing what an SGLang 0.5.23 engine or server leaves behind (development and CI only).

SGLang stops its processes with ``kill_process_tree`` (SIGKILL to every descendant), so the cleanup
those processes would do never runs, and nothing else does it:

- every scheduler creates a load-snapshot file ``/dev/shm/sglang_loads_<instance>_<digest>.shm``
  (``sglang.srt.managers.load_snapshot.shm_path_for(port_args.instance_id)``) that is never
  unlinked;
- the ZMQ IPC endpoints of ``PortArgs`` are files made by ``tempfile.NamedTemporaryFile(
  delete=False)`` in ``$TMPDIR`` and then bound as sockets; they stay;
- ``Engine.shutdown()`` also kills the *calling* process's multiprocessing resource tracker (one of
  its children), and ``Engine.__init__`` registers ``shutdown`` with ``atexit``, so it runs again
  at exit and kills the tracker relaunched since. The semaphores that process still owns (tqdm's
  lock, for one) are then untracked: releasing one at exit relaunches the tracker with
  "resource_tracker: process died unexpectedly", and the new tracker prints a ``KeyError``
  traceback for a name it never registered (after the example's final "OK");
- at ``--tp-size`` > 1, the TP rank 0 scheduler creates the 24 MiB broadcast queue
  ``/dev/shm/sgl_shm_mq_<pid>_<hex>`` (``distributed/device_communicators/shm_broadcast.py``,
  ``MessageQueue``) that only its ``__del__`` unlinks (SGLang's own sweep,
  ``utils/stale_shm_cleanup.py``, runs in SGLang's CI only);
- tqdm makes a multiprocessing lock (a named POSIX semaphore, ``/dev/shm/sem.mp-*``) in every
  process that shows a progress bar, SGLang's scheduler included; killed, it never unlinks it.

:func:`shutdown_engine` and :func:`server_files` / :func:`remove` undo the first four by name;
:func:`register` (an ``sglang.srt.plugins`` entry point, so it runs in every SGLang process)
prevents the last.
"""

from __future__ import annotations

import atexit
import contextlib
import os
from pathlib import Path
from typing import Iterable


def engine_files(port_args) -> list[Path]:
    """The load-snapshot file and the IPC endpoint files of one engine, from its ``PortArgs``."""
    from sglang.srt.managers.load_snapshot import shm_path_for

    files = [Path(shm_path_for(port_args.instance_id))]
    for name, value in vars(port_args).items():
        if name.endswith("_ipc_name") and isinstance(value, str) and value.startswith("ipc://"):
            files.append(Path(value.removeprefix("ipc://")))
    return files


#: ``/dev/shm`` names SGLang creates and leaves: load snapshots (``sglang_loads_*``) and the TP
#: broadcast queue (``sgl_shm_mq_*``).
SGLANG_SHM_PREFIXES = ("/dev/shm/sglang_", "/dev/shm/sgl_shm_")


def server_files(pid: int) -> set[Path]:
    """The SGLang ``/dev/shm`` files (:data:`SGLANG_SHM_PREFIXES`) mapped by process ``pid`` and its
    descendants (a running server's load-snapshot file and, at TP > 1, its broadcast queue); read
    from ``/proc/<pid>/maps`` while the processes still run."""
    import psutil

    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return set()
    files = set()
    for process in processes:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{process.pid}/maps").read_text().splitlines():
                path = line.split(maxsplit=5)[5:]
                if path and path[0].startswith(SGLANG_SHM_PREFIXES):
                    files.add(Path(path[0].removesuffix(" (deleted)")))
    return files


def remove(files: Iterable[Path]) -> None:
    """Unlink each of ``files`` that still exists."""
    for path in files:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def reattach_resource_tracker() -> None:
    """After SGLang killed this process's multiprocessing resource tracker: reap it, start a new
    one on next use (without the "died unexpectedly" warning) and register with it every semaphore
    this process still owns, so each is unregistered cleanly when released (no ``KeyError``) and
    unlinked by the tracker if it is still there at exit. No-op while the tracker is alive."""
    from multiprocessing import resource_tracker, synchronize, util

    tracker = resource_tracker._resource_tracker
    if tracker._fd is None or tracker._check_alive():
        return
    with contextlib.suppress(ChildProcessError):
        tracker._stop()
    for finalizer in list(util._finalizer_registry.values()):
        if getattr(finalizer, "_callback", None) is synchronize.SemLock._cleanup:
            resource_tracker.register(finalizer._args[0], "semaphore")


def shutdown_engine(engine) -> None:
    """``engine.shutdown()`` once (not again at exit), then remove what SGLang leaves behind (the
    engine's files and the SGLang ``/dev/shm`` files its processes, children of this one, mapped)
    and give this process a working resource tracker (see the module docstring)."""
    port_args = getattr(engine, "port_args", None)
    mapped = server_files(os.getpid())
    try:
        engine.shutdown()
    finally:
        atexit.unregister(engine.shutdown)
        reattach_resource_tracker()
        remove(mapped)
        if port_args is not None:
            remove(engine_files(port_args))


def register() -> None:
    """``sglang.srt.plugins`` entry point: tqdm progress bars in this process serialise on a thread
    lock only, so no multiprocessing semaphore is left behind when SGLang kills the process."""
    from tqdm.std import TqdmDefaultWriteLock

    if not hasattr(TqdmDefaultWriteLock, "mp_lock"):
        TqdmDefaultWriteLock.mp_lock = None
