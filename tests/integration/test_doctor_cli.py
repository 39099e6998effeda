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
