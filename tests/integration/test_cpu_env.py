"""The CPU development environment keeps SGLang 0.5.23's own pins.

``scripts/setup_cpu_env.sh`` installs ``requirements/lock-sglang-0.5.23-cpu.txt`` with ``--no-deps``
(SGLang's metadata also names CUDA kernels the CPU path never loads), so pip never holds the
packages to SGLang's pins while installing; ``scripts/check_cpu_env.py`` does, after. The reference
is the installed SGLang's own metadata (``Requires-Dist``) and ``pip check``:

- the lock pins every requirement of SGLang within SGLang's specifier, except exactly the ones in
  ``requirements/sglang-0.5.23-cpu-absent.txt``, which it leaves out; torch is SGLang's 2.14.1;
- ``pip check`` in this environment reports nothing but those absent ones (what the set-up's last
  step enforces);
- the check catches what ``pip check`` reported before the lock (tokenizers 0.23.3 against SGLang's
  ``==0.23.2``, python-dateutil 4.0.0 against ``<3``), a missing dependency not on the list, a
  broken pin of another package, and a list entry that is no requirement of SGLang.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "requirements" / "lock-sglang-0.5.23-cpu.txt"


def _load_check():
    spec = importlib.util.spec_from_file_location("check_cpu_env", REPO / "scripts" / "check_cpu_env.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_cpu_env = _load_check()


def locked_versions() -> dict[str, str]:
    """The lock's ``name==version`` lines, by canonical name."""
    pins = {}
    for line in LOCK.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            requirement = Requirement(line)
            (spec,) = requirement.specifier
            assert spec.operator == "==", line
            pins[canonicalize_name(requirement.name)] = spec.version
    return pins


def sglang_requirements() -> list[Requirement]:
    """SGLang's requirements on this machine, without extras (what ``pip check`` holds it to)."""
    requirements = [Requirement(text) for text in metadata.requires("sglang")]
    return [r for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})]


def test_lock_pins_every_sglang_requirement_within_its_specifier_but_the_absent_ones():
    pins, absent = locked_versions(), check_cpu_env.absent_names()
    assert metadata.version("sglang") == pins["sglang"] == "0.5.23"
    assert pins["torch"] == "2.14.1"
    required = {canonicalize_name(r.name): r for r in sglang_requirements()}
    assert absent <= set(required), sorted(absent - set(required))
    assert sorted(absent & set(pins)) == []
    outside = {name: (str(r.specifier), pins.get(name)) for name, r in required.items()
               if name not in absent and (name not in pins or not r.specifier.contains(pins[name], prereleases=True))}
    assert outside == {}
    assert "tokenizers" in required and pins["tokenizers"] == "0.23.2"


def test_pip_check_reports_only_the_absent_sglang_dependencies():
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "check_cpu_env.py")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("[check] pip check: consistent, but for the 39 SGLang dependencies"), result.stdout


ABSENT = {"sglang-kernel", "flashinfer-python"}
SGLANG_REQUIRES = ABSENT | {"tokenizers", "python-dateutil", "torch"}


@pytest.mark.parametrize(
    "line",
    [
        "sglang 0.5.23 has requirement tokenizers==0.23.2, but you have tokenizers 0.23.3.",
        "sglang 0.5.23 has requirement python-dateutil<3, but you have python-dateutil 4.0.0.",
        "sglang 0.5.23 requires torch, which is not installed.",
        "torchvision 0.29.1 has requirement torch==2.14.1, but you have torch 2.13.0.",
        "peft 0.21.2 requires accelerate, which is not installed.",
        "sglang 0.5.23 has requirement sglang-kernel==0.4.10, but you have sglang-kernel 0.4.9.",
    ],
)
def test_check_refuses_every_other_report(line):
    report = ["sglang 0.5.23 requires sglang-kernel, which is not installed.", line]
    assert check_cpu_env.problems(report, ABSENT, SGLANG_REQUIRES) == [f"pip check: {line}"]


def test_check_accepts_the_absent_dependencies_only():
    report = [
        "sglang 0.5.23 requires sglang-kernel, which is not installed.",
        "sglang 0.5.23 requires flashinfer_python, which is not installed.",  # pip prints names as declared
    ]
    assert check_cpu_env.problems(report, ABSENT, SGLANG_REQUIRES) == []
    assert check_cpu_env.problems(["No broken requirements found."], ABSENT, SGLANG_REQUIRES) == []


def test_check_refuses_a_list_entry_that_sglang_does_not_require():
    (problem,) = check_cpu_env.problems([], ABSENT | {"left-pad"}, SGLANG_REQUIRES)
    assert problem == "requirements/sglang-0.5.23-cpu-absent.txt: left-pad is not a requirement of the installed SGLang; remove it"
