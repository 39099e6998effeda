"""Which adapters the checks cover: plugin backends by default, SGLang's own only with
SGLANG_XPU_LORA_ADAPTER_CHECKS=all (reported by doctor); ``--lora-paths`` configs are checked at
argument validation, through SGLang's real ``check_server_args``."""

from __future__ import annotations

import json

import pytest

from sglang_xpu_lora import doctor
from sglang_xpu_lora.adapters import scope


@pytest.fixture
def big_adapter(tmp_path):
    """An adapter directory whose config is rank 64 (no tensors are read at argument validation)."""
    path = tmp_path / "big-r64"
    path.mkdir()
    config = {"peft_type": "LORA", "r": 64, "lora_alpha": 64, "target_modules": ["q_proj"], "bias": "none"}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def check_args(tiny_artifacts, big_adapter, backend):
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(
        model_path=str(tiny_artifacts["base"]), device="cpu", enable_lora=True, lora_backend=backend,
        lora_paths=[f"sql-r8={tiny_artifacts['sql-r8']}", f"big={big_adapter}"], max_lora_rank=32,
    )
    args.resolve_once()
    args.check_server_args()


def test_plugin_backend_adapters_are_checked_at_argument_validation(sglang_plugins_loaded, tiny_artifacts, big_adapter, monkeypatch):
    monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", "torch")
    monkeypatch.delenv(scope.ADAPTER_CHECKS_ENV, raising=False)
    with pytest.raises(ValueError, match=r"LoRA adapter 'big' cannot be served exactly: field 'r': rank 64 exceeds --max-lora-rank 32"):
        check_args(tiny_artifacts, big_adapter, "intel_xpu")


def test_sglang_backends_are_untouched_unless_opted_in(sglang_plugins_loaded, tiny_artifacts, big_adapter, monkeypatch):
    monkeypatch.delenv(scope.ADAPTER_CHECKS_ENV, raising=False)
    assert scope.applies_to("intel_xpu") and not scope.applies_to("csgmv")
    check_args(tiny_artifacts, big_adapter, "torch_native")  # SGLang's behaviour: accepted here
    monkeypatch.setenv(scope.ADAPTER_CHECKS_ENV, "all")
    assert scope.applies_to("csgmv")
    with pytest.raises(ValueError, match="exceeds --max-lora-rank 32"):
        check_args(tiny_artifacts, big_adapter, "torch_native")


def test_doctor_reports_the_scope_and_an_invalid_setting(sglang_plugins_loaded, monkeypatch):
    monkeypatch.delenv(scope.ADAPTER_CHECKS_ENV, raising=False)
    report = {"problems": []}
    doctor.add_adapter_checks(report)
    assert report["adapter_checks"].startswith("plugin backends only (intel_xpu)") and report["problems"] == []
    monkeypatch.setenv(scope.ADAPTER_CHECKS_ENV, "all")
    doctor.add_adapter_checks(report)
    assert "every LoRA backend" in report["adapter_checks"]
    monkeypatch.setenv(scope.ADAPTER_CHECKS_ENV, "some")
    doctor.add_adapter_checks(report)
    assert report["problems"] == ["SGLANG_XPU_LORA_ADAPTER_CHECKS='some' is not one of plugin, all"]
    with pytest.raises(ValueError, match="is not one of plugin, all"):
        scope.applies_to("intel_xpu")
