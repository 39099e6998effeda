"""Running commands in a sandbox: a private ``/dev/shm`` and ``$TMPDIR`` (to check that a run leaves
nothing behind) or no network (the packaging check), through Linux namespaces (``unshare``)."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import warnings
from pathlib import Path
from typing import Sequence

from sglang_cpu_devsupport.serving import kill_process_group


@functools.lru_cache(maxsize=None)
def can_unshare() -> bool:
    """Whether this process may create mount and network namespaces (root with ``unshare``, as in CI)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "-n", "true"], capture_output=True).returncode == 0


#: What a run may leave in its $TMPDIR by design: torch's compile-cache directory, reused across runs.
KEPT_IN_TMPDIR = re.compile(r"torchinductor_.*")
_SHM_MARKER = "---- /dev/shm after the run ----"


def run_in_own_group(argv: Sequence[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run`` (stderr merged into stdout, text) in a new session; on timeout, SIGKILL to
    the session's process group, reap it, and raise ``subprocess.TimeoutExpired`` with the output."""
    proc = subprocess.Popen(list(argv), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_process_group(proc.pid)
        stdout, _ = proc.communicate()
        raise subprocess.TimeoutExpired(proc.args, timeout, output=stdout) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout)


def run_leaving_nothing(argv: Sequence[str], env: dict, tmpdir: Path, timeout: float) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run ``argv`` (stderr merged into stdout) with ``env``, an empty ``$TMPDIR`` at ``tmpdir`` and,
    where this process may create a mount namespace (root with ``unshare``, as in CI), an empty
    private ``/dev/shm``; elsewhere ``/dev/shm`` is compared before and after the run, which other
    processes on the machine can disturb (a warning says so).

    The command runs in a session of its own; past ``timeout`` seconds its whole process group (an
    engine's schedulers and TP ranks included) is killed before ``subprocess.TimeoutExpired`` is
    raised, so a hung run leaves no process behind.

    Returns the finished process and what it left behind: ``/dev/shm/<name>`` and
    ``$TMPDIR/<name>`` entries, except :data:`KEPT_IN_TMPDIR`.
    """
    tmpdir.mkdir(parents=True, exist_ok=True)
    env = {**env, "TMPDIR": str(tmpdir)}
    if can_unshare():
        script = f'mount -t tmpfs tmpfs /dev/shm || exit 97; "$@"; rc=$?; echo "{_SHM_MARKER}"; ls -A /dev/shm; exit $rc'
        result = run_in_own_group(["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *argv], env, timeout)
        output, marker, shm = result.stdout.rpartition(_SHM_MARKER + "\n")
        result.stdout, shm_left = (output, shm.split()) if marker else (result.stdout, [])
    else:
        warnings.warn("no private /dev/shm here (needs root and unshare): comparing /dev/shm before and after the run")
        before = set(os.listdir("/dev/shm"))
        result = run_in_own_group(argv, env, timeout)
        shm_left = sorted(set(os.listdir("/dev/shm")) - before)
    tmp_left = sorted(p.name for p in tmpdir.iterdir() if not KEPT_IN_TMPDIR.fullmatch(p.name))
    return result, [f"/dev/shm/{name}" for name in shm_left] + [f"$TMPDIR/{name}" for name in tmp_left]
