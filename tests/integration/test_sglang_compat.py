"""The compatibility guard against the pinned SGLang: every name of the table resolves, with its
parameters and attributes, and a moved symbol, a renamed parameter or attribute, or an untested
version is reported by name."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from packaging.version import Version

from sglang_xpu_lora import __version__
from sglang_xpu_lora.upstream import attributes, compat, targets
from sglang_cpu_devsupport import serving


def test_pinned_sglang_passes_every_check():
    assert compat.sglang_version() == Version("0.5.23")
    assert compat.check_host() == []


def test_the_triton_providers_kernels_are_guarded():
    """Every SGLang function the triton provider calls or launches is a compat target, so a moved or
    changed kernel is named at plugin load instead of failing at the first forward: the embedding
    wrapper with the parameters passed to it, the kernels launched from compiled handles with
    their argument lists, the wrappers whose tiles those launches repeat with their tiles."""
    from sglang_xpu_lora.providers import triton_launch, triton_ops

    guarded = [compat.resolve(target) for target in targets.ALL]
    called = [triton_ops._embedding_lora_a(), *vars(triton_launch._kernels()).values()]
    assert len(called) == 5 and all(any(kernel is g for g in guarded) for kernel in called)
    assert targets.TRITON_EMBEDDING_LORA_A in targets.REQUIRED_PARAMETERS
    assert len(targets.REQUIRED_KERNEL_ARGUMENTS) == 4 and all(target in targets.ALL for target in targets.REQUIRED_KERNEL_ARGUMENTS)
    anchored = {target for target, _, _ in targets.REQUIRED_SOURCE}
    assert {targets.TRITON_SGEMM_LORA_A, targets.TRITON_SGEMM_LORA_B, targets.TRITON_QKV_LORA_B, targets.TRITON_GATE_UP_LORA_B} <= anchored


def test_moved_symbol_is_named(monkeypatch):
    moved = "sglang.srt.lora.mem_pool.LoRAMemoryPool.load_lora_weights_renamed"
    monkeypatch.setattr(targets, "ALL", targets.ALL + (moved,))
    problems = compat.check_host()
    assert len(problems) == 1 and moved in problems[0] and "SGLang 0.5.23 has no" in problems[0]


def test_missing_parameter_and_source_anchor_are_named(monkeypatch):
    monkeypatch.setattr(
        targets, "REQUIRED_PARAMETERS", {targets.TRITON_INIT_PREFILL_GRAPH_INFO: ("max_num_tokens", "max_reqs")}
    )
    monkeypatch.setattr(targets, "REQUIRED_SOURCE", ((targets.POOL_LOAD_WEIGHTS, "no such text", "because"),))
    problems = compat.check_host()
    assert any("lacks parameter(s) max_reqs" in p for p in problems)
    assert any("no longer contains 'no such text' (because)" in p for p in problems)


def test_untested_version_is_refused_with_what_to_do(monkeypatch):
    monkeypatch.setattr(compat, "sglang_version", lambda: Version("0.6.0"))
    (problem,) = compat.check_host()
    assert "SGLang 0.6.0 is outside the tested range" in problem and "sglang==0.5.23" in problem


INCOMPATIBLE = """
import types
from unittest import mock
from packaging.version import Version
from sglang_xpu_lora.upstream import compat, targets
if {hide_hook_registry}:
    targets.HOOK_REGISTRY = "sglang.srt.plugins.hook_registry.NoHookRegistry"
with mock.patch.object(compat, "sglang_version", lambda: Version("0.4.0")):
    from sglang.srt.plugins import load_plugins
    load_plugins()
from sglang.srt.lora.backend.lora_registry import LORA_SUPPORTED_BACKENDS
from sglang_xpu_lora.patches.cli_choices import lora_backend_choices
print("REGISTERED", "intel_xpu" in LORA_SUPPORTED_BACKENDS, "PARSES", "intel_xpu" in lora_backend_choices())
from sglang.srt.server_args import ServerArgs
try:
    ServerArgs(model_path="{model}", enable_lora=True, lora_backend="intel_xpu").resolve_once()
except Exception as exc:
    print("REFUSED", type(exc).__name__, exc)
"""


@pytest.mark.launches
def test_incompatible_host_registers_nothing_and_refuses_intel_xpu_with_the_reason(run_python, tiny_artifacts):
    """Nothing of the backend is registered; ``Engine(lora_backend="intel_xpu")`` and the CLI get the
    reason when the arguments are resolved instead of SGLang's ``Invalid backend`` / ``invalid
    choice``."""
    result = run_python(INCOMPATIBLE.format(hide_hook_registry=False, model=tiny_artifacts["base"]))
    assert "REGISTERED False PARSES True" in result.stdout, result.stderr[-3000:]
    assert (
        f"REFUSED BackendArgumentError --lora-backend intel_xpu is unavailable: sglang-xpu-lora {__version__} registered no "
        "LoRA backend in this environment because SGLang 0.4.0 is outside the tested range >=0.5.23,<0.5.24: "
        "install sglang==0.5.23"
    ) in result.stdout
    assert "not registering" not in result.stderr


@pytest.mark.launches
def test_without_hook_registry_the_reason_is_printed_at_load(run_python, tiny_artifacts):
    """Where even the refusal cannot be installed, the reason goes to stderr as before, and the
    backend stays unknown to SGLang."""
    result = run_python(INCOMPATIBLE.format(hide_hook_registry=True, model=tiny_artifacts["base"]))
    assert "REGISTERED False PARSES False" in result.stdout, result.stderr[-3000:]
    assert "[sglang-xpu-lora] not registering LoRA backends: SGLang 0.4.0 is outside the tested range" in result.stderr


@pytest.fixture(scope="module")
def broken_kernel(tmp_path_factory):
    """A directory that, first on ``PYTHONPATH``, makes ``import sgl_kernel`` fail as a kernel build
    with a missing runtime library does."""
    root = tmp_path_factory.mktemp("broken-kernel")
    (root / "sgl_kernel").mkdir()
    (root / "sgl_kernel" / "__init__.py").write_text(
        'raise ImportError("libsycl.so.8: cannot open shared object file: No such file or directory")\n'
    )
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}


BROKEN_ROOT_CAUSE = (
    "importing sglang.srt.lora.lora_manager failed: ImportError: libsycl.so.8: cannot open shared object file: "
    "No such file or directory. A broken install, not an SGLang version mismatch"
)


@pytest.mark.launches
def test_broken_kernel_install_is_named_once_with_its_import_error(run_python, broken_kernel):
    """``pkgutil.resolve_name`` turns the failed import into 'module sglang.srt.lora has no attribute
    lora_manager' for every symbol behind it; the guard names the import error once instead."""
    result = run_python(
        """
        from sglang_xpu_lora.upstream import compat
        for problem in compat.check_host():
            print("PROBLEM", problem)
        """,
        env=broken_kernel,
    )
    problems = [line for line in result.stdout.splitlines() if line.startswith("PROBLEM")]
    assert len(problems) == 1, result.stdout + result.stderr[-3000:]
    assert problems[0].startswith(f"PROBLEM {BROKEN_ROOT_CAUSE}")
    assert "SGLang imports the kernel package sgl_kernel: install the sgl-kernel-xpu build" in problems[0]
    assert "has no sglang" not in result.stdout


@pytest.mark.launches
def test_sglang_serve_with_a_broken_kernel_exits_with_the_reason(tiny_artifacts, broken_kernel):
    """``sglang serve --lora-backend intel_xpu`` on that host: the reason, once in the log and as the
    one message the launcher exits with (status 1), instead of ``invalid choice: 'intel_xpu'`` or
    SGLang's own traceback through its argument resolution."""
    argv = serving.server_argv(tiny_artifacts, ["sql-r8"], serving.free_port())
    del argv[argv.index("--log-level") : argv.index("--log-level") + 2]  # SGLang's default level
    env = {**os.environ, **serving.cpu_env("torch"), **broken_kernel}
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    assert "Traceback" not in output and "invalid choice" not in output, output[-3000:]
    assert result.stderr.rstrip().splitlines()[-1].startswith(
        f"error: --lora-backend intel_xpu is unavailable: sglang-xpu-lora {__version__} registered no LoRA backend in this "
        f"environment because {BROKEN_ROOT_CAUSE}"
    ), output[-3000:]
    logged = [line for line in output.splitlines() if f"sglang-xpu-lora {__version__} loaded" in line]
    assert len(logged) == 1 and f"no LoRA backend registered: {BROKEN_ROOT_CAUSE}" in logged[0], logged


#: Another plugin's module: times a function by replacing it with a wrapper, which keeps SGLang's
#: function as ``__wrapped__`` (``functools.wraps``) or not.
TIMING_PLUGIN = """
import functools, os


def wrap(original, keep_wrapped):
    def timed_call(*args, **kwargs):
        return original(*args, **kwargs)

    return functools.wraps(original)(timed_call) if keep_wrapped else timed_call


def load():  # its sglang.srt.plugins entry point, run before sglang-xpu-lora's
    from sglang.srt.lora.lora_manager import LoRAManager

    LoRAManager._load_lora_adapter = wrap(LoRAManager._load_lora_adapter, os.environ["KEEP_WRAPPED"] == "1")
"""


def hide_behind_timing_plugin(tmp_path, monkeypatch, keep_wrapped: bool) -> None:
    (tmp_path / "timing_plugin.py").write_text(TIMING_PLUGIN)
    spec = importlib.util.spec_from_file_location("timing_plugin", tmp_path / "timing_plugin.py")
    timing_plugin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(timing_plugin)
    manager = compat.resolve(targets.LORA_MANAGER)
    monkeypatch.setattr(manager, "_load_lora_adapter", timing_plugin.wrap(manager._load_lora_adapter, keep_wrapped))


def test_a_wrapper_that_keeps_wrapped_is_accepted(tmp_path, monkeypatch):
    """Another plugin's ``functools.wraps`` wrapper around a function checked by source and
    parameters: the guard reads SGLang's function behind ``__wrapped__`` and accepts the host."""
    hide_behind_timing_plugin(tmp_path, monkeypatch, keep_wrapped=True)
    assert compat.resolve(targets.LORA_MANAGER_LOAD_ADAPTER).__code__.co_filename == str(tmp_path / "timing_plugin.py")
    assert compat.check_host() == []


def test_a_wrapper_that_hides_sglangs_function_is_refused_naming_it(tmp_path, monkeypatch):
    """A wrapper without ``__wrapped__``: SGLang's code cannot be checked, so the host is refused,
    naming the wrapper, instead of reporting that SGLang changed."""
    hide_behind_timing_plugin(tmp_path, monkeypatch, keep_wrapped=False)
    assert compat.check_host() == [
        f"SGLang 0.5.23: {targets.LORA_MANAGER_LOAD_ADAPTER} is replaced by timing_plugin.wrap.<locals>.timed_call, which "
        "does not keep SGLang's function as __wrapped__, so its parameters and source cannot be checked; wrap it "
        "with functools.wraps (or a HookRegistry hook) in that plugin, or leave that plugin out (SGLANG_PLUGINS)"
    ]

TIMING_PYPROJECT = """
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "timing-plugin"
version = "0.0.1"

[project.entry-points."sglang.srt.plugins"]
timing = "timing_plugin:load"

[tool.setuptools]
py-modules = ["timing_plugin"]
"""

LOAD_AND_RESOLVE = """
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.lora.backend.lora_registry import LORA_SUPPORTED_BACKENDS
print("REGISTERED", "intel_xpu" in LORA_SUPPORTED_BACKENDS)
from sglang.srt.server_args import prepare_server_args
args = prepare_server_args(["--model-path", "{model}", "--enable-lora", "--lora-backend", "intel_xpu", "--device", "cpu"])
try:
    args.resolve_once()
except ValueError as exc:
    print("REFUSED", exc)
"""


@pytest.fixture(scope="module")
def timing_plugin_site(tmp_path_factory):
    """The timing plugin installed as a distribution with an ``sglang.srt.plugins`` entry point."""
    project = tmp_path_factory.mktemp("timing")
    (project / "pyproject.toml").write_text(TIMING_PYPROJECT)
    (project / "timing_plugin.py").write_text(TIMING_PLUGIN)
    site = tmp_path_factory.mktemp("timing-site")
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site), str(project)],
        capture_output=True, text=True, timeout=300,
    )
    assert install.returncode == 0, install.stderr
    return site


@pytest.mark.launches
@pytest.mark.parametrize("keep_wrapped", [True, False], ids=["functools-wraps", "plain-wrapper"])
def test_another_plugin_wrapping_a_checked_function(run_python, tiny_artifacts, timing_plugin_site, keep_wrapped):
    """In SGLang's own plugin loading: with ``__wrapped__`` kept, intel_xpu registers; without it,
    ``--lora-backend intel_xpu`` parses and is refused naming the wrapper and its distribution."""
    path = os.pathsep.join(filter(None, [str(timing_plugin_site), os.environ.get("PYTHONPATH")]))
    result = run_python(
        LOAD_AND_RESOLVE.format(model=tiny_artifacts["base"]),
        env={"PYTHONPATH": path, "KEEP_WRAPPED": str(int(keep_wrapped)), "SGLANG_XPU_LORA_KERNELS": "torch"},
    )
    assert f"REGISTERED {keep_wrapped}" in result.stdout, result.stdout + result.stderr[-3000:]
    if keep_wrapped:
        assert "REFUSED" not in result.stdout
    else:
        assert (
            f"REFUSED --lora-backend intel_xpu is unavailable: sglang-xpu-lora {__version__} registered no LoRA backend in "
            f"this environment because SGLang 0.5.23: {targets.LORA_MANAGER_LOAD_ADAPTER} is replaced by "
            "timing_plugin.wrap.<locals>.timed_call (distribution timing-plugin), which does not keep SGLang's "
            "function as __wrapped__"
        ) in result.stdout, result.stdout


def test_the_guard_reports_a_missing_attribute(monkeypatch):
    """The guard, as a renamed attribute in the next SGLang would meet it."""
    attributes = dict(targets.REQUIRED_ATTRIBUTES)
    attributes[targets.LORA_MEMORY_POOL] += ("A_buffers",)
    monkeypatch.setattr(targets, "REQUIRED_ATTRIBUTES", attributes)
    monkeypatch.setattr(targets, "MODEL_ATTRIBUTES", {**targets.MODEL_ATTRIBUTES, "w_kc_absorbed": "sglang.srt.models.deepseek_v2"})
    problems = [p.split(": ", 1)[1] for p in compat.check_host()]
    assert problems == [
        f"{targets.LORA_MEMORY_POOL} has no attribute(s) A_buffers",
        "sglang.srt.models.deepseek_v2 no longer assigns self.w_kc_absorbed",
    ]


def test_instance_attributes_are_found_in_the_methods_of_the_bases():
    """``LoRAManager.memory_pool`` is assigned in a method, ``LoRAAdapter.base_model`` through
    ``object.__setattr__``: neither is declared on the class, the guard finds both, and does not
    invent attributes that are not there."""
    manager, adapter = compat.resolve(targets.LORA_MANAGER), compat.resolve(targets.LORA_ADAPTER)
    assert not hasattr(manager, "memory_pool") and not hasattr(adapter, "base_model")
    assert attributes.missing_attributes(manager, ("memory_pool", "memory_pools")) == ["memory_pools"]
    assert attributes.missing_attributes(adapter, ("base_model", "base_models")) == ["base_models"]
    assert attributes.module_assigns("sglang.srt.models.deepseek_v2", "w_kc")
    assert not attributes.module_assigns("sglang.srt.models.deepseek_v2", "w_kc_absorbed")


def test_attributes_are_found_behind_the_plugins_own_hooks(sglang_plugins_loaded):
    """Once SGLang applied the plugin's hooks, ``LoRAManager.init_memory_pool`` (which assigns
    ``memory_pool``) is a wrapper; the guard reads the wrapped function, so ``doctor`` in a process
    with the plugin loaded reports no problem."""
    manager = compat.resolve(targets.LORA_MANAGER)
    assert getattr(manager.init_memory_pool, "__wrapped__", None) is not None
    assert attributes.missing_attributes(manager, ("memory_pool",)) == []

