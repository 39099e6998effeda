"""The compatibility guard against the pinned SGLang: every name of the table resolves, with its
parameters and attributes, and a moved symbol, a renamed parameter or attribute, or an untested
version is reported by name."""

from __future__ import annotations

import inspect

from packaging.version import Version

from sglang_xpu_lora.upstream import attributes, compat, targets


def test_pinned_sglang_passes_every_check():
    assert compat.sglang_version() == Version("0.5.23")
    assert compat.check_host() == []


def test_the_triton_providers_kernels_are_guarded():
    """Every SGLang function the triton provider calls is a compat target, so a moved or changed
    kernel is named at plugin load instead of failing at the first forward."""
    from sglang_xpu_lora.providers import triton_ops

    guarded = [compat.resolve(target) for target in targets.ALL]
    called = vars(triton_ops._kernels()).values()
    assert called and all(any(kernel is g for g in guarded) for kernel in called)
    assert all(target in targets.ALL and target in targets.REQUIRED_PARAMETERS for target in (
        targets.TRITON_EMBEDDING_LORA_A, targets.TRITON_SGEMM_LORA_A, targets.TRITON_SGEMM_LORA_B,
        targets.TRITON_QKV_LORA_B, targets.TRITON_GATE_UP_LORA_B,
    ))
    assert "n_slices" in inspect.signature(compat.resolve(targets.TRITON_QKV_LORA_B)).parameters


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


def test_incompatible_host_registers_nothing(run_python):
    result = run_python(
        """
        from unittest import mock
        from packaging.version import Version
        from sglang_xpu_lora.upstream import compat
        with mock.patch.object(compat, "sglang_version", lambda: Version("0.4.0")):
            from sglang.srt.plugins import load_plugins
            load_plugins()
        from sglang.srt.lora.backend.lora_registry import LORA_SUPPORTED_BACKENDS
        print("REGISTERED", "intel_xpu" in LORA_SUPPORTED_BACKENDS)
        """
    )
    assert "REGISTERED False" in result.stdout, result.stderr[-3000:]
    assert "[sglang-xpu-lora] not registering LoRA backends: SGLang 0.4.0 is outside the tested range" in result.stderr


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

