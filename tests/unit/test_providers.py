"""``SGLANG_XPU_LORA_KERNELS`` selection without a kernel build: the torch, triton and auto tiers,
per device, eager and inside graphs (the emulated builds: tests/emulator/test_native_provider.py)."""

from __future__ import annotations

import logging

import pytest

from sglang_xpu_lora import providers
from sglang_xpu_lora.providers import base, native, selection, torch_ops, triton_ops
from sglang_xpu_lora.providers.base import Offer
from sglang_xpu_lora.providers.selection import OpChoice


@pytest.fixture(autouse=True)
def no_triton_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture
def triton_on_gpus(monkeypatch):
    """Pretend Triton has an active backend for cuda and xpu (CPU stays as it is)."""
    real = triton_ops.triton_support

    def support(device):
        kind = base.device_type(device)
        return (True, f"Triton test backend for {kind}") if kind in ("cuda", "xpu") else real(device)

    monkeypatch.setattr(triton_ops, "triton_support", support)


def providers_of(chosen) -> set:
    return {c.provider.name for c in chosen.values()}


def test_torch_selects_portable_provider_for_every_op_silently(monkeypatch, caplog):
    monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", "torch")
    with caplog.at_level(logging.INFO):
        chosen = providers.select_ops("cpu")
    assert chosen.eager is chosen.graph
    assert all(getattr(chosen.eager, op).__wrapped__ is getattr(torch_ops, op) for op in base.OP_NAMES)
    assert providers_of(chosen.choices) == providers_of(chosen.graph_choices) == {"torch"}
    assert chosen.needs_zeroed_slots and chosen.providers == {torch_ops.PROVIDER}
    assert providers.portable_kernels_selected() and providers.runs_on_device("cpu")
    assert caplog.records == []


def test_auto_without_a_kernel_build_on_cpu_is_portable_and_logs_each_op_once_per_log(monkeypatch, caplog):
    monkeypatch.delenv("SGLANG_XPU_LORA_KERNELS", raising=False)
    log = providers.SelectionLog()
    with caplog.at_level(logging.WARNING):
        first = providers.select_ops("cpu", log=log)
        providers.select_ops("cpu", log=log)
    assert providers_of(first.choices) == providers_of(first.graph_choices) == {"torch"}
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == len(base.OP_NAMES)  # once per op, not once per selection
    assert all("uses the torch provider" in m and "Triton has no CPU backend" in m for m in messages)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        providers.select_ops("cpu", log=providers.SelectionLog())  # another backend's log: nothing kept in the module
    assert len(caplog.records) == len(base.OP_NAMES)
    assert not providers.portable_kernels_selected()  # auto is not an explicit choice
    assert not providers.runs_on_device("cpu")  # the dev stub sgl_kernel has no ops


def test_auto_never_uses_the_triton_interpreter_on_cpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert providers.triton_support("cpu")[0]
    chosen = providers.choose("cpu")
    assert providers_of(chosen.choices) == providers_of(chosen.graph_choices) == {"torch"}
    assert "does not use the Triton interpreter on CPU" in chosen.choices["sgemm_lora_a_fwd"].reason


def test_auto_on_a_gpu_without_native_ops_is_triton_in_both_modes_on_the_packed_pool(triton_on_gpus, caplog):
    for device in ("cuda", "xpu"):
        with caplog.at_level(logging.WARNING):
            chosen = providers.select_ops(device)
        assert providers_of(chosen.choices) == providers_of(chosen.graph_choices) == {"triton"}
        assert all(getattr(chosen.graph, op) is getattr(triton_ops, op) for op in base.OP_NAMES)
        assert not chosen.needs_zeroed_slots  # SGLang's pool as it is
        assert "Triton test backend" in chosen.choices["qkv_lora_b_fwd"].reason
        assert providers.runs_on_device(device)
    assert caplog.records == []  # Triton is not a degraded choice: logged at INFO only


def test_unknown_device_never_uses_triton(triton_on_gpus):
    assert providers_of(providers.choose(None).choices) == {"torch"}
    assert not providers.runs_on_device(None)


def test_triton_mode_serves_every_op_where_triton_runs(monkeypatch, triton_on_gpus):
    monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", "triton")
    chosen = providers.select_ops("cuda")
    assert chosen.eager is chosen.graph
    assert providers_of(chosen.choices) == providers_of(chosen.graph_choices) == {"triton"}
    assert not chosen.needs_zeroed_slots
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # on CPU only in the interpreter (tests)
    assert providers_of(providers.select_ops("cpu").choices) == {"triton"}


def test_triton_mode_where_triton_cannot_run_is_a_validation_error(monkeypatch):
    monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", "triton")
    with pytest.raises(RuntimeError, match="=triton: SGLang's Triton LoRA kernels cannot run on device cpu: Triton has no CPU backend"):
        providers.select_ops("cpu")
    with pytest.raises(ValueError, match="cannot run on device cpu"):  # as argument validation reports it
        providers.runs_on_device("cpu")


def test_native_without_the_op_is_a_start_up_error_naming_it(monkeypatch):
    monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", "native")
    with pytest.raises(RuntimeError, match="op embedding_lora_a_fwd is unavailable.*Install sgl-kernel-xpu v0.1.0"):
        providers.select_ops("xpu")


def test_invalid_value_is_rejected_with_the_choices(monkeypatch):
    monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", "cuda")
    with pytest.raises(ValueError, match="'cuda' is not one of auto, native, triton, torch"):
        providers.kernels_choice()


def test_expands_reading_a_triton_shrink_are_served_by_triton():
    """A Triton shrink leaves rank-0 rows unwritten: a native or portable expand must not read them."""
    triton = triton_ops.PROVIDER
    offers = {triton: {op: Offer(getattr(triton_ops, op), "Triton test backend") for op in base.OP_NAMES}}
    chosen = {op: OpChoice(op, native.PROVIDER, "found", False) for op in base.OP_NAMES}
    chosen["sgemm_lora_a_fwd"] = OpChoice("sgemm_lora_a_fwd", triton, "no native op", True)
    selection._pair_shrinks(chosen, offers)
    assert {op for op, c in chosen.items() if c.provider is triton} == {
        "sgemm_lora_a_fwd", "sgemm_lora_b_fwd", "qkv_lora_b_fwd", "gate_up_lora_b_fwd", "chunked_sgmv_lora_expand_fwd",
    }
    assert "reads the Triton sgemm_lora_a_fwd output" in chosen["qkv_lora_b_fwd"].reason
    assert chosen["qkv_lora_b_fwd"].function is triton_ops.qkv_lora_b_fwd
    chosen = {op: OpChoice(op, native.PROVIDER, "found", False) for op in base.OP_NAMES}
    chosen["chunked_sgmv_lora_shrink_fwd"] = OpChoice("chunked_sgmv_lora_shrink_fwd", triton, "no native op", True)
    selection._pair_shrinks(chosen, offers)
    assert {op for op, c in chosen.items() if c.provider is triton} == {"chunked_sgmv_lora_shrink_fwd", "chunked_sgmv_lora_expand_fwd"}
