"""The packaging check, as a distribution packager works (README, "For packagers").

Builds the sdist from this checkout's files (tracked and not ignored) and the wheel from the sdist,
without build isolation, with the environment's setuptools, as distributions build. Then:

- under setuptools 66.1.1 (Debian 12's; Ubuntu 24.04 ships 68.1), older than the 77 that reads
  the PEP 639 licence, the build stops with one line that names the setuptools it needs (not a
  schema dump);
- ``twine check --strict`` on both; every link of the long description (the README, the PyPI
  page) is absolute, and those into this repository name a file or folder it has; the wheel's
  metadata (SPDX licence and its file, Python requirement, classifiers, Project-URLs) and contents
  (the package only, never the dev shims);
- the sdist holds every tracked file but the CI hook (so the tests can run from it);
- the wheel is byte-for-byte reproducible under ``SOURCE_DATE_EPOCH``; the sdist's files and
  contents are (setuptools does not apply ``SOURCE_DATE_EPOCH`` to sdists, pypa/setuptools#2133);
- the wheel holds every file of the sdist's ``src/sglang_xpu_lora/`` (every module, ``py.typed``, the
  plan tables in ``dense/configs/``), and nothing else but its metadata;
- the wheel, installed with ``--no-deps --no-index`` into a fresh virtual environment that sees this
  environment's torch, SGLang and test stack but neither this checkout nor ``devsupport``, is what
  the non-e2e tests of the unpacked sdist import, with networking off (a network namespace; only
  loopback is up) and the sdist's ``devsupport`` installed into a directory named on
  ``PYTHONPATH`` (for the tests only): every non-e2e test collects there (each module imports,
  against the wheel) exactly as in this checkout, and those that exercise what differs between
  the wheel and the editable checkout (``WHEEL_SAMPLE``) pass there, as do a sample of those
  marked ``launches`` (``LAUNCHES_SAMPLE``). The run from the checkout runs them all, on the same
  files (``test_sdist_holds_every_project_file``).

Marked ``e2e``, so ``-m "not e2e"`` (and the nested run itself) skips it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import warnings
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from sandbox import can_unshare

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
NAME = "sglang_xpu_lora"
#: The version the checkout builds (pyproject.toml), as it appears in the distributions' file names.
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
EPOCH = "1764460800"  # 2025-11-30T00:00:00Z: any fixed value
#: Tracked files that are not part of the project's source distribution: the CI machinery's hook.
NOT_IN_SDIST = (".ci/", ".gitignore")
#: Installed in this environment by ``pip install -e``: hidden from the fresh environment.
DEV_INSTALLS = ("sglang_xpu_lora", "sglang_cpu_devsupport", "sgl_kernel", "__editable__")
#: The host's console scripts that the tests start (``sglang serve``).
HOST_CONSOLE_SCRIPTS = ("sglang",)
#: The tests marked ``launches`` start SGLang, a benchmark or ``sglang-xpu-lora`` in fresh processes,
#: seconds each (most of the non-e2e tests' time); the main run has them all. From the sdist these
#: run again, for what a fresh process gets there: the wheel's console script, a real
#: ``sglang.Engine(...)`` and ``sglang serve`` loading the wheel's plugin and the dev shims through
#: their entry points (the shims from ``PYTHONPATH``), two processes joined over loopback in the
#: network namespace.
LAUNCHES_SAMPLE = (
    "tests/integration/test_doctor.py::test_console_script_in_a_fresh_process",
    "tests/integration/test_startup_refusals.py::test_the_real_engine_raises_in_the_caller_before_reading_the_weights",
    "tests/integration/test_startup_refusals.py::test_sglang_serve_ends_with_the_message_alone",
    "tests/integration/test_tensor_parallel.py::test_lora_layers_sharded_over_tp2_match_unsharded[portable]",
)
#: The other non-e2e tests that run from the sdist: those of what the installed wheel (and the dev
#: shims installed with ``--target``) gives that the editable checkout does not show. Every other
#: non-e2e test is only collected there (its module imports against the wheel, its parameters come
#: out as in this checkout): the run from the checkout runs it on the same files.
WHEEL_SAMPLE = (
    # package data: the plan tables shipped in dense/configs/*.plans.json, read from the wheel
    "tests/unit/test_dense_tier.py::test_the_shipped_tables_load",
    # the wheel's sglang.lora_backends entry point, loaded with torch and SGLang blocked; the leaf
    # modules (the sglang.srt.plugins target among them) import from the wheel alone
    "tests/unit/test_import_layers.py::test_entry_point_target_imports_without_torch_or_sglang",
    "tests/unit/test_import_layers.py::test_leaves_import_without_torch_or_sglang",
    # the distribution's metadata: --version reads the wheel's, pip check holds this environment
    # (the wheel's requirements included) to SGLang's pins
    "tests/integration/test_doctor_cli.py::test_version",
    "tests/integration/test_cpu_env.py::test_pip_check_reports_only_the_absent_sglang_dependencies",
    # doctor in an isolated interpreter that sees site-packages (the wheel is a directory there, not
    # an editable finder) with torch or SGLang hidden
    "tests/integration/test_doctor_cli.py::test_missing_host_package_gives_a_message_not_a_traceback",
    "tests/integration/test_doctor_cli.py::test_the_isolated_view_still_runs_doctor_when_nothing_is_hidden",
    # SGLang's own plugin loading in this process, through the wheel's sglang.srt.plugins entry
    # point and the dev shims' (the stub sgl_kernel, from PYTHONPATH), as doctor reports them
    "tests/integration/test_doctor.py::test_no_build",
    # a Hub id at argument validation with networking off: left to SGLang, nothing fetched
    "tests/integration/test_adapter_paths.py::test_a_hub_id_is_left_to_sglang",
)


def run(argv, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([str(a) for a in argv], capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{argv}: {result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def build(source: Path, out: Path, *what: str) -> Path:
    env = {**os.environ, "SOURCE_DATE_EPOCH": EPOCH}
    run([sys.executable, "-m", "build", "--no-isolation", *what, "--outdir", out, source], env=env, timeout=300)
    (built,) = out.iterdir()
    return built


def checkout_files() -> list[str]:
    """This checkout's files, tracked or not ignored (a release builds from a clean checkout)."""
    if not (REPO / ".git").exists():
        pytest.skip("the packaging check builds from a git checkout, not from an unpacked sdist")
    listed = run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO).stdout
    return sorted(p for p in listed.split("\0") if p and (REPO / p).is_file())


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    """``(sdist, wheel, unpacked sdist, checkout copy)``: the sdist built from a copy of this
    checkout, the wheel from the unpacked sdist."""
    work = tmp_path_factory.mktemp("dist")
    source = work / "checkout"
    for rel in checkout_files():
        (source / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, source / rel)
    sdist = build(source, work / "sdist", "--sdist")
    with tarfile.open(sdist) as archive:
        archive.extractall(work / "unpacked", filter="data")
    unpacked = work / "unpacked" / f"{NAME}-{VERSION}"
    wheel = build(unpacked, work / "wheel", "--wheel")
    return sdist, wheel, unpacked, source


#: What the in-tree build backend (build_backend/) says under a setuptools older than 77, and nothing more.
OLD_SETUPTOOLS = "66.1.1"
NEEDS_SETUPTOOLS = (
    f"sglang-xpu-lora needs setuptools>=77 to build (pyproject.toml has a PEP 639 SPDX license), "
    f"this environment has setuptools {OLD_SETUPTOOLS}: upgrade it, or build with build isolation"
)


def test_build_with_debian_12_setuptools_fails_with_one_line(dist, tmp_path):
    _, _, _, source = dist
    run([sys.executable, "-m", "venv", tmp_path / "venv"], timeout=120)
    python = tmp_path / "venv" / "bin" / "python"
    run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", f"setuptools=={OLD_SETUPTOOLS}", "build==1.3.0"],
        timeout=300)
    for what in ("--sdist", "--wheel"):
        result = subprocess.run(
            [python, "-m", "build", "--no-isolation", what, "--outdir", tmp_path / "out", source],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
        )
        lines = [line for line in result.stdout.splitlines() if line.strip()]
        assert result.returncode == 1, result.stdout
        # build's own two lines (the step, the hook that stopped) around the backend's one line.
        assert lines == [
            f"* Getting build dependencies for {what[2:]}...",
            NEEDS_SETUPTOOLS,
            f"ERROR Backend subprocess exited when trying to invoke get_requires_for_build_{what[2:]}",
        ], result.stdout


def test_twine_check(dist):
    sdist, wheel, _, _ = dist
    run([sys.executable, "-m", "twine", "check", "--strict", sdist, wheel], timeout=120)


def test_long_description_links_work_on_pypi(dist):
    _, wheel, _, source = dist
    with zipfile.ZipFile(wheel) as archive:
        metadata = Parser().parsestr(archive.read(f"{NAME}-{VERSION}.dist-info/METADATA").decode())
    body = metadata.get_payload()
    assert body.startswith("# sglang-xpu-lora\n")
    targets = re.findall(r"\]\(([^)\s]+)\)", body) + re.findall(r"(?m)^\[[^\]]+\]:\s*(\S+)", body)
    targets += re.findall(r"(?:href|src)=[\"']([^\"']+)", body)
    assert [t for t in targets if not re.match(r"https?://", t)] == []
    # Links into this repository follow the Source Project-URL and name what the checkout has.
    (source_url,) = [url.split(", ", 1)[1] for url in metadata.get_all("Project-URL") if url.startswith("Source,")]
    own = [t.split("#")[0] for t in targets if t.startswith(source_url)]
    paths = [re.fullmatch(re.escape(source_url) + r"/(?:blob|tree)/main/(.+)", t) for t in own]
    assert None not in paths, own
    assert [m[1] for m in paths if not (source / m[1]).exists()] == []
    assert len(own) >= 19


def test_wheel_metadata_and_contents(dist):
    _, wheel, _, _ = dist
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = Parser().parsestr(archive.read(f"{NAME}-{VERSION}.dist-info/METADATA").decode())
        entry_points = archive.read(f"{NAME}-{VERSION}.dist-info/entry_points.txt").decode()
    assert f"{NAME}-{VERSION}.dist-info/licenses/LICENSE" in names
    assert {name.split("/")[0] for name in names} == {NAME, f"{NAME}-{VERSION}.dist-info"}
    assert metadata["License-Expression"] == "Apache-2.0" and metadata["License-File"] == "LICENSE"
    assert metadata["Requires-Python"] == ">=3.11"
    assert sorted(metadata.get_all("Requires-Dist")) == ["packaging>=23", "pluggy>=1.5"]
    classifiers = metadata.get_all("Classifier")
    assert "Programming Language :: Python :: 3.11" in classifiers and "Operating System :: POSIX :: Linux" in classifiers
    assert any(c.startswith("Development Status ::") for c in classifiers)
    assert {url.split(",")[0] for url in metadata.get_all("Project-URL")} >= {"Source", "Issues", "Changelog"}
    assert metadata["Author"] or metadata["Author-email"]
    assert "intel_xpu_lora = sglang_xpu_lora.plugin:load" in entry_points
    assert "sglang-xpu-lora = sglang_xpu_lora.doctor:main" in entry_points


def test_wheel_holds_every_file_of_the_package(dist):
    """Every module and data file of the sdist's package is in the wheel (a subpackage without an
    ``__init__.py``, or data outside ``package-data``, would be missing there and only there)."""
    sdist, wheel, _, _ = dist
    with tarfile.open(sdist) as archive:  # NAME-VERSION/src/NAME/...
        package = {m.name.split("/", 2)[2] for m in archive.getmembers() if m.isfile() and m.name.split("/")[1:3] == ["src", NAME]}
    with zipfile.ZipFile(wheel) as archive:
        built = {name for name in archive.namelist() if name.startswith(f"{NAME}/")}
    assert built == package
    assert {f"{NAME}/py.typed", f"{NAME}/dense/configs/sm90.plans.json"} <= built


def test_sdist_holds_every_project_file(dist):
    sdist, _, _, _ = dist
    with tarfile.open(sdist) as archive:
        members = {m.name.split("/", 1)[1] for m in archive.getmembers() if m.isfile()}
    expected = {p for p in checkout_files() if not p.startswith(NOT_IN_SDIST)}
    assert expected - members == set()
    assert {"LICENSE", "CHANGELOG.md", "CONTRIBUTING.md", "PKG-INFO"} <= members
    assert not [m for m in members if "__pycache__" in m or (".egg-info/" in m and not m.startswith("src/"))]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def sdist_files(sdist: Path) -> dict[str, str]:
    with tarfile.open(sdist) as archive:
        return {m.name: hashlib.sha256(archive.extractfile(m).read()).hexdigest() for m in archive.getmembers() if m.isfile()}


def test_reproducible_builds(dist, tmp_path):
    sdist, wheel, unpacked, source = dist
    again = build(unpacked, tmp_path / "wheel", "--wheel")
    assert digest(again) == digest(wheel)
    assert sdist_files(build(source, tmp_path / "sdist", "--sdist")) == sdist_files(sdist)


@pytest.fixture(scope="module")
def fresh_python(dist, tmp_path_factory) -> Path:
    """A new virtual environment with the wheel installed (``--no-deps --no-index``) that sees this
    environment's packages through a ``.pth`` file naming a directory of links to them, minus this
    checkout's editable installs and the dev shims, and has SGLang's ``sglang`` console script."""
    _, wheel, _, _ = dist
    work = tmp_path_factory.mktemp("fresh")
    run([sys.executable, "-m", "venv", "--without-pip", work / "venv"], timeout=120)
    python = work / "venv" / "bin" / "python"
    host = work / "host-site-packages"
    host.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if entry.suffix != ".pth" and not entry.name.startswith(DEV_INSTALLS):
            (host / entry.name).symlink_to(entry)
    for name in HOST_CONSOLE_SCRIPTS:  # as pip writes them when it installs SGLang
        (script,) = importlib.metadata.entry_points(group="console_scripts", name=name)
        launcher = python.parent / name
        launcher.write_text(f"#!{python}\nimport sys\nfrom {script.module} import {script.attr}\nsys.exit({script.attr}())\n")
        launcher.chmod(0o755)
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (site / "ci_host_packages.pth").write_text(f"{host}\n")
    run([python, "-m", "pip", "install", "--no-deps", "--no-index", "--disable-pip-version-check", "-q", wheel], timeout=300)
    return python


def test_sdist_tests_collect_and_the_samples_pass_offline(dist, fresh_python, tmp_path):
    _, _, unpacked, _ = dist
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_XPU_LORA", "PYTHON"))}
    env.update(SGLANG_USE_CPU_ENGINE="1", TMPDIR=str(tmp_path))
    env["PATH"] = f"{fresh_python.parent}{os.pathsep}{env.get('PATH', '')}"
    offline = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"] if can_unshare() else []
    if not offline:
        warnings.warn("networking is NOT turned off for the sdist's tests: a network namespace needs root and unshare")

    # The dev shims go to a directory named on PYTHONPATH for the tests only (with their entry
    # points: SGLang finds the CPU shims through them), never into the environment.
    devsupport = tmp_path / "devsupport"
    run([*offline, fresh_python, "-m", "pip", "install", "--no-deps", "--no-index", "--no-build-isolation",
         "--disable-pip-version-check", "-q", "--target", devsupport, "./devsupport"], cwd=unpacked, env=env, timeout=300)
    env["PYTHONPATH"] = str(devsupport)
    probe = run(
        [*offline, fresh_python, "-c",
         "import importlib.metadata as m, sglang_xpu_lora, sgl_kernel, urllib.request as u\n"
         "print(sglang_xpu_lora.__file__)\n"
         "print(sgl_kernel.__file__)\n"
         "print(sorted(ep.name for ep in m.entry_points(group='sglang.srt.plugins')))\n"
         "try:\n    u.urlopen('https://pypi.org', timeout=5)\nexcept OSError as e:\n    print('offline', type(e).__name__)\n"],
        cwd=unpacked, env=env, timeout=120,
    ).stdout.splitlines()
    assert probe[0].startswith(str(fresh_python.parents[1])), probe  # the wheel, not this checkout
    assert probe[1].startswith(str(devsupport)), probe  # the stub, from the tests' directory only
    assert probe[2] == "['cpu_pin_memory_shim', 'intel_xpu_lora', 'lora_pool_snapshot', 'nan_adapter_slot', 'no_leftovers', 'sgl_kernel_emulator']", probe
    assert probe[3].startswith("offline") or not offline, probe

    # Every non-e2e test collects from the sdist against the wheel as it does in this checkout
    # (each module imports; nothing skipped, no parameter lost); this checkout's collection meanwhile.
    collect = ["-m", "pytest", "--collect-only", "-q", "-m", "not e2e", "-p", "no:cacheprovider", "-o", "addopts="]
    here = subprocess.Popen([sys.executable, *collect], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        there = subprocess.run([*offline, fresh_python, *collect], cwd=unpacked, env=env, capture_output=True, text=True, timeout=600)
        here_out = here.communicate(timeout=600)[0]
    finally:
        here.kill()
        here.wait()
    assert there.returncode == 0, there.stdout[-6000:] + there.stderr[-3000:]
    assert here.returncode == 0, here_out[-6000:]
    collected = collected_ids(there.stdout)
    assert collected == collected_ids(here_out), "the sdist collects other tests than this checkout"
    selection = (*WHEEL_SAMPLE, *LAUNCHES_SAMPLE)
    assert [s for s in selection if not any(selected(t, s) for t in collected)] == []

    # The samples pass there (a node id not found, a skip, a failure would show in the summary).
    log = tmp_path / "pytest-samples.log"
    with open(log, "w") as out:
        result = subprocess.run(
            [*offline, fresh_python, "-m", "pytest", *selection, "-q", "-p", "no:cacheprovider", "-o", "addopts="],
            cwd=unpacked, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=1500,
        )
    text = log.read_text()
    assert result.returncode == 0, text[-6000:]
    summary = [line for line in text.splitlines() if re.match(r"\d+ (passed|failed)", line)][-1]
    expected = sum(any(selected(t, s) for s in selection) for t in collected)
    assert re.fullmatch(rf"{expected} passed(, \d+ warnings?)? in .*", summary), (expected, summary)


def collected_ids(collect_only_output: str) -> list[str]:
    """The test ids that ``pytest --collect-only -q`` lists, sorted; its summary line checked to
    report no error or skipped module."""
    ids = sorted(line for line in collect_only_output.splitlines() if re.match(r"tests/\S+\.py::", line))
    (summary,) = [line for line in collect_only_output.splitlines() if re.search(r"\d+ tests? collected", line)]
    assert re.fullmatch(rf"{len(ids)}/\d+ tests collected \(\d+ deselected\)(, \d+ warnings?)? in .*", summary), summary
    return ids


def selected(test_id: str, selection: str) -> bool:
    """Whether the pytest argument ``selection`` (a node id, or a test function of parametrized ids)
    selects ``test_id``."""
    return test_id == selection or test_id.startswith(f"{selection}[")
