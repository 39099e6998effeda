"""``IntelXpuLoRABackend.validate_lora_targets`` names the LoRA math SGLang runs itself (MoE experts,
the absorbed-MLA ``kv_b_proj`` correction) and refuses it where SGLang's Triton kernels cannot run."""

from __future__ import annotations

import logging

import pytest
import torch

DENSE = {"qkv_proj", "o_proj"}


def fused_moe():
    """A ``FusedMoE`` module without its (heavy) construction: only its type is inspected."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    module = FusedMoE.__new__(FusedMoE)
    torch.nn.Module.__init__(module)
    return module


class AbsorbedMLA(torch.nn.Module):
    """What DeepseekV2AttentionMLA exposes to the check: ``kv_b_proj`` and the absorbed ``w_kc``."""

    def __init__(self):
        super().__init__()
        self.kv_b_proj = torch.nn.Linear(4, 4)
        self.w_kc = None


MODELS = {
    "moe": (lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), fused_moe()), DENSE | {"gate_up_proj", "down_proj"}, "MoE experts"),
    "mla": (lambda: torch.nn.Sequential(AbsorbedMLA()), DENSE | {"kv_b_proj"}, "absorbed-MLA kv_b_proj"),
}


@pytest.fixture
def backend(monkeypatch, sglang_plugins_loaded):
    from sglang_xpu_lora.backend.xpu import IntelXpuLoRABackend

    monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", "torch")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return IntelXpuLoRABackend(max_loras_per_batch=2, device=torch.device("cpu"))


@pytest.mark.parametrize("kind", list(MODELS))
def test_refused_where_triton_cannot_run(backend, kind):
    model, targets, what = MODELS[kind]
    with pytest.raises(ValueError, match=f"--lora-backend intel_xpu on cpu: .*{what}.*Triton does not run on this device"):
        backend.validate_lora_targets(base_model=model(), target_modules=targets)


@pytest.mark.parametrize("kind", list(MODELS))
def test_named_where_triton_runs(backend, kind, monkeypatch, caplog):
    model, targets, what = MODELS[kind]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with caplog.at_level(logging.INFO, logger="sglang_xpu_lora.backend.xpu"):
        backend.validate_lora_targets(base_model=model(), target_modules=targets)
    (message,) = [r.getMessage() for r in caplog.records if what in r.getMessage()]
    assert message.startswith("intel_xpu: ") and "SGLANG_XPU_LORA_KERNELS does not apply" in message


@pytest.mark.parametrize("kind", list(MODELS))
def test_dense_targets_of_the_same_models_stay_in_the_backend(backend, kind, caplog):
    model, _, _ = MODELS[kind]
    with caplog.at_level(logging.INFO, logger="sglang_xpu_lora.backend.xpu"):
        backend.validate_lora_targets(base_model=model(), target_modules=DENSE | {"gate_up_proj"})
    assert "does not apply" not in caplog.text
