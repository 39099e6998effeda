"""``SGLANG_XPU_LORA_KERNELS`` selection."""

from __future__ import annotations

import logging

import pytest

from sglang_xpu_lora import providers
from sglang_xpu_lora.providers import base, torch_ops


@pytest.fixture(autouse=True)
def fresh_warning(monkeypatch):
    monkeypatch.setattr(providers, "_warned_auto", False)


def test_torch_selects_portable_provider_silently(monkeypatch, caplog):
    monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", "torch")
    assert providers.load_provider() is torch_ops
    assert providers.portable_kernels_selected()
    assert caplog.records == []


def test_auto_is_portable_with_a_single_warning(monkeypatch, caplog):
    monkeypatch.delenv("SGLANG_XPU_LORA_KERNELS", raising=False)
    with caplog.at_level(logging.WARNING):
        assert providers.load_provider() is torch_ops
        assert providers.load_provider() is torch_ops
    assert len([r for r in caplog.records if "portable PyTorch LoRA kernels" in r.getMessage()]) == 1
    assert not providers.portable_kernels_selected()  # auto is not an explicit choice


def test_native_is_an_error_naming_the_alternative(monkeypatch):
    monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", "native")
    with pytest.raises(RuntimeError, match="SGLANG_XPU_LORA_KERNELS=torch"):
        providers.load_provider()


def test_invalid_value_is_rejected_with_the_choices(monkeypatch):
    monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", "cuda")
    with pytest.raises(ValueError, match="'cuda' is not one of auto, native, torch"):
        providers.kernels_choice()


def test_portable_provider_exports_every_op():
    assert torch_ops.name == "torch"
    for op in base.OP_NAMES:
        assert callable(getattr(torch_ops, op)), op
