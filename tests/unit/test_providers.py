"""``SGLANG_XPU_LORA_KERNELS`` selection."""

from __future__ import annotations

import logging

import pytest

from sglang_xpu_lora import providers
from sglang_xpu_lora.providers import base, torch_ops


@pytest.fixture(autouse=True)
def fresh_reports(monkeypatch):
    monkeypatch.setattr(providers, "_reported", set())


def test_torch_selects_portable_provider_for_every_op_silently(monkeypatch, caplog):
    monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", "torch")
    with caplog.at_level(logging.INFO):
        selection = providers.select_ops()
    assert selection.eager is selection.graph
    assert all(getattr(selection.eager, op) is getattr(torch_ops, op) for op in base.OP_NAMES)
    assert {c.provider for c in selection.choices.values()} == {"torch"}
    assert providers.portable_kernels_selected() and providers.runs_on_device("cpu")
    assert caplog.records == []


def test_auto_without_a_kernel_build_is_portable_and_logs_each_op_once(monkeypatch, caplog):
    monkeypatch.delenv("SGLANG_XPU_LORA_KERNELS", raising=False)
    with caplog.at_level(logging.WARNING):
        first = providers.select_ops()
        providers.select_ops()
    assert {c.provider for c in first.choices.values()} == {"torch"}
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == len(base.OP_NAMES)  # once per op, not once per selection
    assert all("uses the portable PyTorch op" in m for m in messages)
    assert not providers.portable_kernels_selected()  # auto is not an explicit choice
    assert not providers.runs_on_device("cpu")  # the dev stub sgl_kernel has no ops


def test_native_without_the_op_is_a_start_up_error_naming_it(monkeypatch):
    monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", "native")
    with pytest.raises(RuntimeError, match="op embedding_lora_a_fwd is unavailable.*Install sgl-kernel-xpu v0.1.0"):
        providers.select_ops()


def test_invalid_value_is_rejected_with_the_choices(monkeypatch):
    monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", "cuda")
    with pytest.raises(ValueError, match="'cuda' is not one of auto, native, torch"):
        providers.kernels_choice()


def test_portable_provider_exports_every_op():
    assert torch_ops.name == "torch"
    for op in base.OP_NAMES:
        assert callable(getattr(torch_ops, op)), op
