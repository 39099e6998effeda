"""Check the CPU development environment against SGLang's own pins: the last step of
``scripts/setup_cpu_env.sh``, also run by ``tests/integration/test_cpu_env.py``.

SGLang 0.5.23 is installed from a lock (``requirements/lock-sglang-0.5.23-cpu.txt``) with
``--no-deps``, so pip never checks the pins while installing. This runs ``pip check`` afterwards and
accepts exactly one kind of report: ``sglang 0.5.23 requires X, which is not installed`` for an X
named in ``requirements/sglang-0.5.23-cpu-absent.txt`` (the dependencies left out on purpose, with
the reasons). Anything else ``pip check`` reports (a version that breaks a pin of SGLang or of any
other package, a missing dependency not on that list) is a problem, and so is a stale list entry:
a name that is no requirement of the installed SGLang.

Usage: ``python scripts/check_cpu_env.py`` with the environment's interpreter. Prints one line when
the environment is consistent (exit status 0), else one line per problem (exit status 1).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ABSENT_LIST = Path(__file__).resolve().parents[1] / "requirements" / "sglang-0.5.23-cpu-absent.txt"
_NOT_INSTALLED = re.compile(r"(?P<dist>\S+) \S+ requires (?P<name>\S+), which is not installed\.")


def absent_names(path: Path = ABSENT_LIST) -> set[str]:
    """The canonical names in the list of deliberately absent SGLang dependencies (one requirement
    per line, ``#`` comments)."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {canonicalize_name(Requirement(line).name) for line in lines if line}


def requirement_names(distribution: str) -> set[str]:
    """Canonical names of what the installed ``distribution`` requires on this machine, without
    extras (the requirements ``pip check`` holds it to)."""
    names = set()
    for text in metadata.requires(distribution) or ():
        requirement = Requirement(text)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            names.add(canonicalize_name(requirement.name))
    return names


def problems(pip_check_lines: Iterable[str], absent: set[str], sglang_requires: set[str]) -> list[str]:
    """What is wrong with the environment, one line each; empty when it is consistent.

    ``pip_check_lines`` is ``pip check``'s output; ``absent`` the canonical names of the SGLang
    dependencies allowed to be missing; ``sglang_requires`` those of SGLang's requirements.
    """
    found = []
    for line in (line.strip() for line in pip_check_lines):
        if not line or line == "No broken requirements found.":
            continue
        missing = _NOT_INSTALLED.fullmatch(line)
        if missing and canonicalize_name(missing["dist"]) == "sglang" and canonicalize_name(missing["name"]) in absent:
            continue
        found.append(f"pip check: {line}")
    where = ABSENT_LIST.relative_to(ABSENT_LIST.parents[1])
    found += [
        f"{where}: {name} is not a requirement of the installed SGLang; remove it" for name in sorted(absent - sglang_requires)
    ]
    return found


def main() -> int:
    report = subprocess.run(
        [sys.executable, "-m", "pip", "check"], capture_output=True, text=True,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    absent = absent_names()
    found = problems((report.stdout + report.stderr).splitlines(), absent, requirement_names("sglang"))
    if found:
        print("\n".join(found))
        print(f"[check] the environment breaks {len(found)} pin(s) or list entries (above)")
        return 1
    print(f"[check] pip check: consistent, but for the {len(absent)} SGLang dependencies left out on purpose ({ABSENT_LIST.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
