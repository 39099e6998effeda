"""Discovery through entry points, in fresh processes, exactly as SGLang does it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

LOAD = """
from sglang.srt.plugins import load_plugins
load_plugins()
"""

PARSE_ARGS = """
from sglang.srt.server_args import prepare_server_args
args = prepare_server_args(["--model-path", "{model}", "--enable-lora", "--lora-paths", "a={adapter}",
                            "--lora-backend", "{backend}", "--max-lora-rank", "32"])
print("PARSED", args.lora_backend)
"""


def test_load_plugins_registers_intel_xpu_lazily_and_idempotently(run_python):
    result = run_python(
        LOAD
        + textwrap.dedent(
            """
        import sys
        from sglang.srt.lora.backend.lora_registry import LORA_SUPPORTED_BACKENDS
        from sglang.srt.plugins.hook_registry import HookRegistry
        from sglang_xpu_lora import plugin
        print("REGISTERED", "intel_xpu" in LORA_SUPPORTED_BACKENDS)
        print("LAZY", "sglang_xpu_lora.backend.xpu" not in sys.modules and "sglang_xpu_lora.providers.torch_ops" not in sys.modules)
        plugin.load(); load_plugins()  # second calls are no-ops
        ours = [t for t, hooks in HookRegistry._hooks.items() for h in hooks if h[1].__module__.startswith("sglang_xpu_lora")]
        print("HOOKS", sorted(ours))
        from sglang.srt.lora.backend.lora_registry import get_backend_from_name
        cls = get_backend_from_name("intel_xpu")
        print("CLASS", cls.__module__, cls.__name__, [c.__name__ for c in cls.__mro__[1:3]])
        """
        )
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "REGISTERED True" in result.stdout
    assert "LAZY True" in result.stdout
    assert (
        "HOOKS ['sglang.srt.arg_groups.lora_hook.check_lora_server_args', "
        "'sglang.srt.lora.lora_manager.LoRAManager.init_memory_pool', "
        "'sglang.srt.lora.mem_pool.LoRAMemoryPool.load_lora_weight_to_buffer']" in result.stdout
    )
    assert "CLASS sglang_xpu_lora.backend.xpu IntelXpuLoRABackend ['TritonLoRABackend', 'BaseLoRABackend']" in result.stdout


def test_cli_accepts_lora_backend_intel_xpu_and_still_rejects_unknown_backends(run_python, tiny_artifacts):
    accept = PARSE_ARGS.format(model=tiny_artifacts["base"], adapter=tiny_artifacts["sql-r8"], backend="intel_xpu")
    reject = PARSE_ARGS.format(model=tiny_artifacts["base"], adapter=tiny_artifacts["sql-r8"], backend="nope")
    result = run_python(LOAD + accept + reject)
    assert "PARSED intel_xpu" in result.stdout, result.stderr[-3000:]
    assert result.returncode != 0 and "invalid choice: 'nope'" in result.stderr


def test_launch_server_cli_parses_intel_xpu(tiny_artifacts):
    """``python -m sglang.launch_server --help`` runs load_plugins first, so the choice is listed."""
    result = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--help"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "intel_xpu" in result.stdout


VALIDATE = """
import os
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import prepare_server_args
from sglang_cpu_devsupport import kernel_emulator

def validate(kernels, build=None):
    os.environ["SGLANG_XPU_LORA_KERNELS"] = kernels
    if build:
        kernel_emulator.install(build)
    args = prepare_server_args(["--model-path", "{model}", "--device", "cpu", "--enable-lora", "--lora-paths",
                                "a={adapter}", "--lora-backend", "intel_xpu", "--max-lora-rank", "32"])
    args.resolve_once()  # as Engine._launch_subprocesses does before check_server_args()
    try:
        args.check_server_args()
        print(kernels, build, "VALID")
    except ValueError as exc:
        print(kernels, build, "INVALID", exc)
    finally:
        kernel_emulator.uninstall()

validate("auto")
validate("torch")
validate("fast")
validate("native", "v0.1.0")
validate("auto", "v0.1.0")
"""


def test_validation_of_intel_xpu_on_cpu(run_python, tiny_artifacts):
    """Validation, as Engine runs it: the device check names both flags unless portable kernels (or
    a kernel build with CPU implementations) are selected; a bad selector and a missing native
    kernel fail there too, before any worker process starts."""
    result = run_python(VALIDATE.format(model=tiny_artifacts["base"], adapter=tiny_artifacts["sql-r8"]))
    lines = result.stdout.splitlines()
    assert (
        "auto None INVALID --lora-backend intel_xpu requires --device xpu, got --device cpu; "
        "set SGLANG_XPU_LORA_KERNELS=torch to run the portable PyTorch LoRA kernels on it"
    ) in lines, result.stdout + result.stderr[-3000:]
    assert "torch None VALID" in lines
    assert "fast None INVALID SGLANG_XPU_LORA_KERNELS='fast' is not one of auto, native, torch; unset it or set SGLANG_XPU_LORA_KERNELS=torch for the portable kernels" in lines
    assert any(line.startswith("native v0.1.0 INVALID SGLANG_XPU_LORA_KERNELS=native: sgl-kernel-xpu op sgemm_lora_b_fwd is unavailable") for line in lines)
    assert "auto v0.1.0 VALID" in lines  # the emulated build registers CPU kernels


THROWAWAY_PYPROJECT = """
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "echo-lora-backend"
version = "0.0.1"

[project.entry-points."sglang.lora_backends"]
echo = "echo_lora_backend"
"""

THROWAWAY_MODULE = '''
"""A second distribution adding a LoRA backend through sglang.lora_backends."""
from sglang_xpu_lora.registry import LoRABackendSpec, hookimpl


def _backend():
    from sglang.srt.lora.backend.torch_backend import TorchNativeLoRABackend

    class EchoLoRABackend(TorchNativeLoRABackend):
        name = "echo_native"

    return EchoLoRABackend


@hookimpl
def sglang_lora_backends():
    return [LoRABackendSpec(name="echo_native", factory=_backend)]
'''


def test_second_distribution_adds_its_backend(run_python, tmp_path, tiny_artifacts):
    project = tmp_path / "echo"
    project.mkdir()
    (project / "pyproject.toml").write_text(THROWAWAY_PYPROJECT)
    (project / "echo_lora_backend.py").write_text(THROWAWAY_MODULE)
    site = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site), str(project)],
        capture_output=True, text=True, timeout=300,
    )
    assert install.returncode == 0, install.stderr
    code = LOAD + textwrap.dedent(
        """
        from sglang.srt.lora.backend.lora_registry import get_backend_from_name
        from sglang_xpu_lora.patches.cli_choices import lora_backend_choices
        print("CHOICES", sorted(c for c in lora_backend_choices() if c in ("intel_xpu", "echo_native")))
        print("ECHO", get_backend_from_name("echo_native").__name__)
        """
    ) + PARSE_ARGS.format(model=tiny_artifacts["base"], adapter=tiny_artifacts["sql-r8"], backend="echo_native")
    # Keep what PYTHONPATH already names (the dev shims, when the tests run from the sdist).
    result = run_python(code, env={"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))})
    assert "CHOICES ['echo_native', 'intel_xpu']" in result.stdout, result.stderr[-3000:]
    assert "ECHO EchoLoRABackend" in result.stdout
    assert "PARSED echo_native" in result.stdout

