"""The compatibility guard against the pinned SGLang: every touched symbol resolves, and a moved
symbol or an untested version is reported by name."""

from __future__ import annotations

from packaging.version import Version

from sglang_xpu_lora.upstream import compat
from sglang_xpu_lora.upstream import targets


def test_pinned_sglang_passes_every_check():
    assert compat.sglang_version() == Version("0.5.23")
    assert compat.check_host() == []


def test_every_target_resolves_to_a_real_symbol():
    for target in targets.ALL:
        assert compat.resolve(target) is not None, target


def test_the_triton_providers_kernels_are_guarded():
    """Every SGLang function the triton provider calls is a compat target, so a moved or changed
    kernel is named at plugin load instead of failing at the first forward."""
    import inspect

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
