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


@functools.lru_cache(maxsize=None)
def can_unshare() -> bool:
    """Whether this process may create mount and network namespaces (root with ``unshare``, as in CI)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "-n", "true"], capture_output=True).returncode == 0


#: What a run may leave in its $TMPDIR by design: torch's compile-cache directory, reused across runs.
KEPT_IN_TMPDIR = re.compile(r"torchinductor_.*")
_SHM_MARKER = "---- /dev/shm after the run ----"


def run_leaving_nothing(argv: Sequence[str], env: dict, tmpdir: Path, timeout: float) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run ``argv`` (stderr merged into stdout) with ``env``, an empty ``$TMPDIR`` at ``tmpdir`` and,
    where this process may create a mount namespace (root with ``unshare``, as in CI), an empty
    private ``/dev/shm``; elsewhere ``/dev/shm`` is compared before and after the run, which other
    processes on the machine can disturb (a warning says so).

    Returns the finished process and what it left behind: ``/dev/shm/<name>`` and
    ``$TMPDIR/<name>`` entries, except :data:`KEPT_IN_TMPDIR`.
    """
    tmpdir.mkdir(parents=True, exist_ok=True)
    env = {**env, "TMPDIR": str(tmpdir)}
    if can_unshare():
        script = f'mount -t tmpfs tmpfs /dev/shm || exit 97; "$@"; rc=$?; echo "{_SHM_MARKER}"; ls -A /dev/shm; exit $rc'
        result = subprocess.run(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *argv],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
        )
        output, marker, shm = result.stdout.rpartition(_SHM_MARKER + "\n")
        result.stdout, shm_left = (output, shm.split()) if marker else (result.stdout, [])
    else:
        warnings.warn("no private /dev/shm here (needs root and unshare): comparing /dev/shm before and after the run")
        before = set(os.listdir("/dev/shm"))
        result = subprocess.run(list(argv), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
        shm_left = sorted(set(os.listdir("/dev/shm")) - before)
    tmp_left = sorted(p.name for p in tmpdir.iterdir() if not KEPT_IN_TMPDIR.fullmatch(p.name))
    return result, [f"/dev/shm/{name}" for name in shm_left] + [f"$TMPDIR/{name}" for name in tmp_left]
