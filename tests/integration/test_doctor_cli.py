"""``sglang-xpu-lora`` as a user meets it: ``--version``, a clear message (not a traceback) when torch
or SGLang is missing, the supported SGLang range as written, and no unrelated SGLang import
warnings in ``doctor``'s output."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from sglang_xpu_lora import doctor
from sglang_xpu_lora.upstream import compat

#: Every line of doctor's text report fits this many columns (issue 18; ``doctor.WIDTH``).
COLUMNS = 100


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        doctor.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"sglang-xpu-lora {importlib.metadata.version('sglang-xpu-lora')}"


def test_supported_range_is_written_lower_bound_first():
    assert compat.SUPPORTED_SGLANG_RANGE == ">=0.5.23,<0.5.24"
    assert str(compat.SUPPORTED_SGLANG) == "<0.5.24,>=0.5.23"  # why the string is kept separately


def python_without(tmp_path: Path, hidden: set[str]) -> list[str]:
    """A command running ``sglang-xpu-lora`` under this interpreter in isolated mode (``-I -S``),
    with every package this process can import except the top-level names in ``hidden``: a view
    of the ``sys.path`` directories after the standard library made of symlinks (first entry of a
    name wins)."""
    view = tmp_path / "site"
    view.mkdir()
    stdlib = [i for i, entry in enumerate(sys.path) if Path(entry).name == Path(sysconfig.get_paths()["stdlib"]).name]
    site_dirs = [Path(entry) for entry in sys.path[stdlib[-1] + 1 :]]  # lib-dynload, site-packages, .pth paths
    for directory in site_dirs:
        if directory.name == "lib-dynload" or not directory.is_dir():
            continue
        for entry in directory.iterdir():
            top = entry.name.split("-")[0].split(".")[0]
            if entry.suffix == ".pth" or top in hidden or (view / entry.name).exists():
                continue
            (view / entry.name).symlink_to(entry)
    code = f"import sys; sys.path.insert(0, {str(view)!r}); from sglang_xpu_lora.doctor import main; sys.exit(main(sys.argv[1:]))"
    return [sys.executable, "-I", "-S", "-c", code]


@pytest.mark.parametrize(
    "hidden, expected",
    [({"torch"}, ["torch is not installed"]), ({"sglang"}, ["SGLang is not installed"])],
    ids=["no-torch", "no-sglang"],
)
def test_missing_host_package_gives_a_message_not_a_traceback(tmp_path, hidden, expected):
    argv = python_without(tmp_path, hidden)
    env = {"PATH": os.environ.get("PATH", "")}
    text = subprocess.run([*argv, "doctor"], env=env, capture_output=True, text=True, timeout=120)
    assert text.returncode == 1, text.stderr[-2000:]
    assert "Traceback" not in text.stderr, text.stderr[-2000:]
    assert f"cannot check this Python ({sys.executable}):" in text.stdout
    assert [line.removeprefix("  - ") for line in text.stdout.splitlines() if line.startswith("  - ")] == expected
    assert "Install the XPU build of torch and SGLang >=0.5.23,<0.5.24" in text.stdout

    as_json = subprocess.run([*argv, "doctor", "--json"], env=env, capture_output=True, text=True, timeout=120)
    assert as_json.returncode == 1 and "Traceback" not in as_json.stderr
    report = json.loads(as_json.stdout)
    assert report["can_serve"] is False and report["problems"] == expected


def test_the_isolated_view_still_runs_doctor_when_nothing_is_hidden(tmp_path):
    """Guards the test above: the crafted interpreter fails only because of what it hides."""
    argv = python_without(tmp_path, set())
    result = subprocess.run([*argv, "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.startswith("sglang-xpu-lora "), result.stderr


def fresh_process(code_or_script: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_XPU_LORA")}
    env.update(SGLANG_USE_CPU_ENGINE="1", SGLANG_XPU_LORA_KERNELS="torch")
    return subprocess.run(code_or_script, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.launches
def test_doctor_output_has_no_unrelated_sglang_import_warnings():
    script = Path(sys.executable).parent / "sglang-xpu-lora"  # installed next to this interpreter
    result = fresh_process([str(script), "doctor"])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"(supported {compat.SUPPORTED_SGLANG_RANGE})" in result.stdout
    assert result.stderr == ""



def test_quiet_host_imports_hides_sglang_warnings_only():
    """The filter matches the module that warns: SGLang's (as its AWQ note does), not ours."""
    import warnings

    def warn_from(module):
        warnings.warn_explicit("Only CUDA, HIP and XPU support AWQ currently.", UserWarning, module, 1, module=module)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with doctor.quiet_host_imports():
            warn_from("sglang.srt.layers.quantization.awq.awq")
            warn_from("sglang_xpu_lora.providers")
        warn_from("sglang.srt.layers.quantization.awq.awq")
    assert [w.filename for w in seen] == ["sglang_xpu_lora.providers", "sglang.srt.layers.quantization.awq.awq"]


def doctor_env(**changes) -> dict:
    """This environment for a ``doctor`` subprocess, without ``SGLANG_XPU_LORA_*`` settings, with
    ``changes`` (a None value removes the variable)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_XPU_LORA")}
    env.update(SGLANG_USE_CPU_ENGINE="1")
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


#: Runs doctor with a marker line printed (flushed) the moment SGLang starts being imported.
MARKED_DOCTOR = """
import sys
def audit(event, args):
    if event == "import" and args[0].split(".")[0] == "sglang" and not audit.seen:
        audit.seen = True
        print("MARKER: SGLang is being imported", flush=True)
audit.seen = False
sys.addaudithook(audit)
from sglang_xpu_lora.doctor import main
sys.exit(main(["doctor"]))
"""


@pytest.mark.launches
def test_doctor_streams_its_report(tmp_path):
    """The first line comes before SGLang (the slow import) is imported, each step's lines as
    the step finishes: read line by line from the pipe, as a user's terminal shows them."""
    proc = subprocess.Popen(
        [sys.executable, "-c", MARKED_DOCTOR], env=doctor_env(SGLANG_XPU_LORA_KERNELS="torch"),
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    lines = [line.rstrip("\n") for line in proc.stdout]
    assert proc.wait(timeout=300) == 0, lines
    marker = lines.index("MARKER: SGLang is being imported")
    assert lines[0].startswith("sglang-xpu-lora ") and " doctor: Python " in lines[0]
    assert marker > 0 and any(line.startswith("  torch ") for line in lines[:marker]), lines
    assert any(line.startswith("  SGLang ") for line in lines[marker:]), lines


def hidden_kernel_module(tmp_path: Path) -> str:
    """A ``PYTHONPATH`` on which ``import sgl_kernel`` fails as without an install (first on the path,
    before the development stub)."""
    package = tmp_path / "hide" / "sgl_kernel"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'sgl_kernel'\", name='sgl_kernel')\n")
    return os.pathsep.join(filter(None, [str(tmp_path / "hide"), os.environ.get("PYTHONPATH")]))


@pytest.mark.launches
def test_a_broken_host_is_reported_once_in_lines_that_fit(tmp_path):
    """Without an importable ``sgl_kernel`` on SGLang's CPU engine, SGLang's LoRA modules do not
    import: every problem is printed once (stdout and stderr together; the plugin's own stderr
    report is not repeated) and every line fits 100 columns."""
    script = Path(sys.executable).parent / "sglang-xpu-lora"
    env = doctor_env(SGLANG_XPU_LORA_KERNELS="torch", PYTHONPATH=hidden_kernel_module(tmp_path))
    result = subprocess.run([str(script), "doctor"], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stdout[-3000:]
    lines = result.stdout.splitlines() + result.stderr.splitlines()
    assert max(len(line) for line in lines) <= COLUMNS, [line for line in lines if len(line) > COLUMNS]
    problems = result.stdout.split("CANNOT SERVE --lora-backend intel_xpu:\n", 1)[1]
    bullets = [" ".join(bullet.split()) for bullet in problems.split("\n  - ")]
    bullets[0] = bullets[0].removeprefix("- ")
    assert any("sgl_kernel" in bullet for bullet in bullets), bullets
    everything = " ".join((result.stdout + "\n" + result.stderr).split())
    assert [b for b in bullets if everything.count(b) != 1] == []


@pytest.mark.launches
@pytest.mark.parametrize(
    "plugins, expected",
    [
        ("intel_xpu_lora,no_leftovers", "SGLang's LoRA layers pin host memory"),
        ("cpu_pin_memory_shim", "SGLang's plugin loading did not register intel_xpu"),
    ],
    ids=["no-pinned-memory", "plugin-not-loaded"],
)
def test_what_a_cpu_start_needs_is_checked(plugins, expected):
    """Each of these made doctor say OK while ``sglang serve`` could not start (the server side of
    the first is ``tests/e2e/test_doctor_verdict.py``; without the plugin, SGLang rejects
    ``--lora-backend intel_xpu`` as an invalid choice)."""
    script = Path(sys.executable).parent / "sglang-xpu-lora"
    env = doctor_env(SGLANG_XPU_LORA_KERNELS="torch", SGLANG_PLUGINS=plugins)
    result = subprocess.run([str(script), "doctor", "--json"], env=env, capture_output=True, text=True, timeout=300)
    report = json.loads(result.stdout)
    assert result.returncode == 1 and not report["can_serve"], report["problems"]
    assert [p for p in report["problems"] if p.startswith(expected)], report["problems"]
