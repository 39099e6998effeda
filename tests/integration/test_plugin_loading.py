"""Discovery through entry points, in fresh processes, exactly as SGLang does it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from sglang_xpu_lora import __version__

pytestmark = pytest.mark.launches

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
        "'sglang.srt.arg_groups.lora_hook.check_lora_server_args', "
        "'sglang.srt.arg_groups.lora_hook.check_lora_server_args', "
        "'sglang.srt.arg_groups.serving_hook.handle_missing_default_values', "
        "'sglang.srt.entrypoints.engine._set_envs_and_config', "
        "'sglang.srt.entrypoints.engine._wait_for_scheduler_ready', "
        "'sglang.srt.layers.logits_processor.LogitsProcessor.forward', "
        "'sglang.srt.lora.lora.LoRAAdapter._normalize_weights', "
        "'sglang.srt.lora.lora_manager.LoRAManager._load_lora_adapter', "
        "'sglang.srt.lora.lora_manager.LoRAManager._load_lora_adapter_from_tensors', "
        "'sglang.srt.lora.lora_manager.LoRAManager.init_memory_pool', "
        "'sglang.srt.lora.lora_manager.LoRAManager.validate_new_adapter', "
        "'sglang.srt.lora.lora_registry.LoRARegistry.release', "
        "'sglang.srt.lora.mem_pool.LoRAMemoryPool.load_lora_weight_to_buffer', "
        "'sglang.srt.managers.io_struct.EmbeddingReqInput.normalize_batch_and_arguments', "
        "'sglang.srt.managers.io_struct.GenerateReqInput.normalize_batch_and_arguments', "
        "'sglang.srt.managers.scheduler.Scheduler.__init__', "
        "'sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin.unload_lora_adapter', "
        "'sglang.srt.managers.tokenizer_manager.TokenizerManager.__init__', "
        "'sglang.srt.managers.tokenizer_manager.TokenizerManager._resolve_lora_path', "
        "'sglang.srt.utils.common.configure_logger']" in result.stdout
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


LOG_LINE = """
import os
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import prepare_server_args
from sglang.srt.utils import configure_logger  # the name SGLang's launcher, schedulers and detokenizer call
args = prepare_server_args(["--model-path", "{model}"])
print("CONFIGURING", os.getpid(), flush=True)
configure_logger(args)
configure_logger(args)
"""


def test_one_line_per_process_once_sglang_configured_logging(run_python, tiny_artifacts):
    """Plugins load before SGLang configures logging; the plugin's line (its version, SGLang's, the
    pid, the backends registered) comes once SGLang has, at its default level, once."""
    result = run_python(LOG_LINE.format(model=tiny_artifacts["base"]))
    assert result.returncode == 0, result.stderr[-3000:]
    pid = result.stdout.split("CONFIGURING ")[1].split()[0]
    lines = [line for line in result.stderr.splitlines() if "sglang-xpu-lora" in line]
    assert len(lines) == 1, lines
    assert lines[0].startswith("[") and lines[0].endswith(  # SGLang's format: after configure_logger
        f"] sglang-xpu-lora {__version__} loaded (SGLang 0.5.23, pid {pid}): --lora-backend intel_xpu registered"
    )


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
    try:
        args.resolve_once()  # as Engine._launch_subprocesses does before check_server_args()
        args.check_server_args()
        print(kernels, build, "VALID")
    except ValueError as exc:
        print(kernels, build, "INVALID", exc)
    finally:
        kernel_emulator.uninstall()

os.environ.pop("TRITON_INTERPRET", None)
validate("auto")
validate("torch")
validate("fast")
validate("native", "v0.1.0")
validate("auto", "v0.1.0")
validate("triton")
os.environ["TRITON_INTERPRET"] = "1"
validate("triton")
"""


def test_validation_of_intel_xpu_on_cpu(run_python, tiny_artifacts):
    """Validation, as Engine runs it: the device check names both flags unless portable kernels (or
    a kernel build with CPU implementations) are selected; a bad selector, a missing native kernel
    and Triton kernels where Triton cannot run fail there too, before any worker process starts."""
    result = run_python(VALIDATE.format(model=tiny_artifacts["base"], adapter=tiny_artifacts["sql-r8"]))
    lines = result.stdout.splitlines()
    assert (
        "auto None INVALID --lora-backend intel_xpu requires --device xpu, got --device cpu; its LoRA kernels "
        "are Intel GPU kernels (sgl-kernel-xpu, Triton on XPU); to try it on CPU (portable PyTorch kernels, for "
        "testing): set SGLANG_XPU_LORA_KERNELS=torch and SGLANG_USE_CPU_ENGINE=1 and pass --device cpu, then run "
        "`sglang-xpu-lora doctor --device cpu` to check what else SGLang's CPU engine needs"
    ) in lines, result.stdout + result.stderr[-3000:]
    assert "torch None VALID" in lines
    assert "fast None INVALID SGLANG_XPU_LORA_KERNELS='fast' is not one of auto, native, triton, torch; unset it or set SGLANG_XPU_LORA_KERNELS=torch for the portable kernels" in lines
    assert any(line.startswith("native v0.1.0 INVALID SGLANG_XPU_LORA_KERNELS=native: sgl-kernel-xpu op sgemm_lora_b_fwd is unavailable") for line in lines)
    assert "auto v0.1.0 VALID" in lines  # the emulated build registers CPU kernels
    assert lines[-2].startswith(
        "triton None INVALID SGLANG_XPU_LORA_KERNELS=triton: SGLang's Triton LoRA kernels cannot run on device cpu"
    )
    assert lines[-1] == "triton None VALID"  # TRITON_INTERPRET=1: Triton's interpreter (tests)


THROWAWAY_PYPROJECT = """
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "echo-lora-backend"
version = "0.0.1"

[project.entry-points."sglang.lora_backends"]
echo = "echo_lora_backend"
hijack = "hijack_lora_backend"
typo = "typo_lora_backend"

[tool.setuptools]
py-modules = ["echo_lora_backend", "hijack_lora_backend", "typo_lora_backend"]
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


#: Declares SGLang's own ``csgmv``: must be refused, not take over ``--lora-backend csgmv``.
HIJACK_MODULE = '''
from sglang_xpu_lora.registry import LoRABackendSpec, hookimpl


@hookimpl
def sglang_lora_backends():
    from echo_lora_backend import _backend
    return [LoRABackendSpec(name="csgmv", factory=_backend)]
'''

#: The hook name misspelled: reported, not silently ignored.
TYPO_MODULE = '''
from sglang_xpu_lora.registry import LoRABackendSpec, hookimpl


@hookimpl
def sglang_lora_backend():
    return []
'''


def test_second_distribution_adds_its_backend(run_python, tmp_path, tiny_artifacts):
    """A second distribution adds ``echo_native``; its entry points that hijack SGLang's ``csgmv`` or
    misspell the hook are refused and reported; doctor names each backend's distribution."""
    project = tmp_path / "echo"
    project.mkdir()
    (project / "pyproject.toml").write_text(THROWAWAY_PYPROJECT)
    (project / "echo_lora_backend.py").write_text(THROWAWAY_MODULE)
    (project / "hijack_lora_backend.py").write_text(HIJACK_MODULE)
    (project / "typo_lora_backend.py").write_text(TYPO_MODULE)
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
        print("CSGMV", get_backend_from_name("csgmv").__name__)
        from sglang_xpu_lora import doctor
        report = doctor.collect()
        print("BACKENDS", sorted((b["name"], b["plugin"], b["distribution"]) for b in report["backends"]))
        print(chr(10).join(doctor.render_plugins(report)))
        """
    ) + PARSE_ARGS.format(model=tiny_artifacts["base"], adapter=tiny_artifacts["sql-r8"], backend="echo_native")
    # Keep what PYTHONPATH already names (the dev shims, when the tests run from the sdist).
    result = run_python(code, env={"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))})
    assert "CHOICES ['echo_native', 'intel_xpu']" in result.stdout, result.stderr[-3000:]
    assert "ECHO EchoLoRABackend" in result.stdout
    assert "CSGMV ChunkedSgmvLoRABackend" in result.stdout
    assert (
        f"BACKENDS [('echo_native', 'echo', 'echo-lora-backend 0.0.1'), ('intel_xpu', 'intel_xpu', 'sglang-xpu-lora {__version__}')]"
        in result.stdout
    )
    rendered = " ".join(result.stdout.split())  # doctor wraps its lines at 100 columns
    assert (
        "plugin load error: hijack: ReservedBackendNameError: plugin 'hijack' declares LoRA backend 'csgmv', a name "
        "SGLang already has" in rendered
    )
    assert "plugin load error: typo: PluginValidationError: plugin 'typo': unknown hook 'sglang_lora_backend'" in rendered
    assert "PARSED echo_native" in result.stdout



ROLLBACK = """
import types
from sglang.srt.lora.backend import lora_registry
from sglang.srt.plugins.hook_registry import HookRegistry
import sglang_xpu_lora.patches.cli_choices as cli_choices
import sglang_xpu_lora.patches.log_lines as log_lines

events = []
queue = HookRegistry.register.__func__
HookRegistry.register = classmethod(lambda cls, target, *a, **k: events.append("hook " + target) or queue(cls, target, *a, **k))
register_backend = lora_registry.register_lora_backend
lora_registry.register_lora_backend = lambda name: events.append("backend " + name) or register_backend(name)

def fail(registry, undo):
    raise RuntimeError("boom")

log_lines.apply = fail  # the last patch: every other step was taken before it
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang_xpu_lora import plugin
print("EVENTS", events)
print("SELECTABLE", "intel_xpu" in lora_registry.LORA_SUPPORTED_BACKENDS, "intel_xpu" in cli_choices.lora_backend_choices())
refusal = ("sglang.srt.server_args.ServerArgs.resolve_once", "sglang.srt.utils.common.configure_logger")
ours = [(t, k.name, h) for t, hooks in HookRegistry._hooks.items() for k, h, _ in hooks if h.__module__.startswith("sglang_xpu_lora")]
untouched = object()  # our hooks would read attributes of their arguments; passed through, they do not
print("PASS-THROUGH", [h(lambda *a, **k: "original", untouched) if k != "AFTER" else h("result", untouched) for t, k, h in ours if t not in refusal])
(refuse,) = [h for t, _, h in ours if t == refusal[0]]
try:
    refuse(types.SimpleNamespace(lora_backend="intel_xpu", enable_lora=True))
except ValueError as exc:
    print("REFUSED", exc)
plugin.load()
print("STILL", "intel_xpu" in lora_registry.LORA_SUPPORTED_BACKENDS)
"""


def test_a_failed_patch_rolls_back_everything_and_hooks_come_first(run_python):
    """The plugin applies whole or not at all: a patch failing after the others leaves no backend
    registered and every queued hook passing straight through, and ``--lora-backend intel_xpu``
    then fails at validation saying what failed and what was undone; hooks are queued before any
    backend is registered."""
    result = run_python(ROLLBACK)
    assert result.returncode == 0, result.stderr[-3000:]
    events = next(line for line in result.stdout.splitlines() if line.startswith("EVENTS"))
    adapter_hooks = [  # patches.adapter_checks, queued after mem_pool
        ("AFTER", "sglang.srt.arg_groups.lora_hook.check_lora_server_args"),
        ("AROUND", "sglang.srt.lora.lora_manager.LoRAManager.validate_new_adapter"),
        ("AROUND", "sglang.srt.lora.lora_manager.LoRAManager._load_lora_adapter"),
        ("AROUND", "sglang.srt.lora.lora_manager.LoRAManager._load_lora_adapter_from_tensors"),
        ("BEFORE", "sglang.srt.lora.lora.LoRAAdapter._normalize_weights"),
    ]
    unload_hooks = [  # patches.unload_final, queued after adapter_checks
        ("AROUND", "sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin.unload_lora_adapter"),
        ("AROUND", "sglang.srt.lora.lora_registry.LoRARegistry.release"),
    ]
    request_hooks = [  # patches.request_checks, queued after unload_final
        ("AFTER", "sglang.srt.arg_groups.lora_hook.check_lora_server_args"),
        ("AROUND", "sglang.srt.managers.io_struct.GenerateReqInput.normalize_batch_and_arguments"),
        ("AROUND", "sglang.srt.managers.io_struct.EmbeddingReqInput.normalize_batch_and_arguments"),
        ("AROUND", "sglang.srt.managers.tokenizer_manager.TokenizerManager._resolve_lora_path"),
    ]
    hooks = [
        ("AFTER", "sglang.srt.arg_groups.lora_hook.check_lora_server_args"),
        ("AROUND", "sglang.srt.arg_groups.serving_hook.handle_missing_default_values"),
        ("AROUND", "sglang.srt.lora.lora_manager.LoRAManager.init_memory_pool"),
        ("AROUND", "sglang.srt.lora.mem_pool.LoRAMemoryPool.load_lora_weight_to_buffer"),
        *adapter_hooks,
        ("AROUND", "sglang.srt.layers.logits_processor.LogitsProcessor.forward"),  # patches.embedding_logits
        *unload_hooks,
        *request_hooks,
        ("AFTER", "sglang.srt.entrypoints.engine._set_envs_and_config"),  # patches.startup_failure
        ("AROUND", "sglang.srt.entrypoints.engine._wait_for_scheduler_ready"),
        ("AFTER", "sglang.srt.managers.tokenizer_manager.TokenizerManager.__init__"),
        ("AROUND", "sglang.srt.managers.scheduler.Scheduler.__init__"),
    ]
    refusal = ["sglang.srt.server_args.ServerArgs.resolve_once", "sglang.srt.utils.common.configure_logger"]
    assert events == "EVENTS " + repr(
        [f"hook {target}" for _, target in hooks] + ["backend intel_xpu"] + [f"hook {target}" for target in refusal]
    )
    undone = "; ".join(f"undid the {kind} hook on {target}" for kind, target in reversed(hooks))
    assert (
        f"REFUSED --lora-backend intel_xpu is unavailable: sglang-xpu-lora {__version__} registered no LoRA backend in this "
        "environment because could not patch SGLang: patch log_lines failed (RuntimeError: boom); rolled back: "
        f"undid --lora-backend choice 'intel_xpu'; undid LoRA backend 'intel_xpu'; {undone}. Run `sglang-xpu-lora doctor`"
    ) in result.stdout
    assert "not registering" not in result.stderr  # the refusal carries the reason; nothing printed at load
    assert "SELECTABLE False True" in result.stdout  # the choice parses, to be refused with the reason
    # AFTER hooks return the result, AROUND hooks call the original, BEFORE hooks change nothing.
    passed = {"AFTER": "result", "AROUND": "original", "BEFORE": None}
    by_target = sorted(hooks, key=lambda hook: hook[1] != hooks[0][1])  # HookRegistry groups by target
    assert "PASS-THROUGH " + repr([passed[kind] for kind, _ in by_target]) in result.stdout
    assert "STILL False" in result.stdout  # a second call does not half-apply again
