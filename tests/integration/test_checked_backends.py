"""Which adapters the checks cover: plugin backends by default, SGLang's own only with
SGLANG_XPU_LORA_ADAPTER_CHECKS=all (reported by doctor); ``--lora-paths`` configs are checked at
argument validation, through SGLang's real ``check_server_args``."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from sglang_xpu_lora import doctor
from sglang_xpu_lora.adapters import checked_backends


@pytest.fixture
def big_adapter(tmp_path):
    """A rank-64 q_proj adapter directory (refused by its config before its tensors are read)."""
    from safetensors.torch import save_file

    path = tmp_path / "big-r64"
    path.mkdir()
    config = {"peft_type": "LORA", "r": 64, "lora_alpha": 64, "target_modules": ["q_proj"], "bias": "none"}
    (path / "adapter_config.json").write_text(json.dumps(config))
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{prefix}.lora_A.weight": torch.zeros(64, 128), f"{prefix}.lora_B.weight": torch.zeros(128, 64)}, path / "adapter_model.safetensors")
    return path


def write_adapter(path, tensors):
    """A rank-8 q_proj adapter directory holding ``tensors`` (layer-0 q_proj A and B)."""
    from safetensors.torch import save_file

    path.mkdir()
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "bias": "none"}
    (path / "adapter_config.json").write_text(json.dumps(config))
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{prefix}.lora_{factor}.weight": t for factor, t in zip("AB", tensors)}, path / "adapter_model.safetensors")
    return path


def check_args(tiny_artifacts, adapter, backend):
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(
        model_path=str(tiny_artifacts["base"]), device="cpu", enable_lora=True, lora_backend=backend,
        lora_paths=[f"sql-r8={tiny_artifacts['sql-r8']}", f"{adapter.name}={adapter}"], max_lora_rank=32,
    )
    args.resolve_once()
    args.check_server_args()


def test_plugin_backend_adapters_are_checked_at_argument_validation(sglang_plugins_loaded, tiny_artifacts, big_adapter, tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", "torch")
    monkeypatch.delenv(checked_backends.ADAPTER_CHECKS_ENV, raising=False)
    with pytest.raises(ValueError, match=r"LoRA adapter 'big-r64' cannot be served exactly: field 'r': rank 64 exceeds --max-lora-rank 32"):
        check_args(tiny_artifacts, big_adapter, "intel_xpu")
    dora = tmp_path / "dora"
    shutil.copytree(tiny_artifacts["sql-r8"], dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match=r"LoRA adapter 'dora' cannot be served exactly: field 'use_dora'=True: DoRA"):
        check_args(tiny_artifacts, dora, "intel_xpu")


@pytest.mark.parametrize(
    "tensors, named",
    [
        ((torch.zeros(8, 64), torch.zeros(128, 8)), r"has shape \(8, 64\), expected \(8, 128\)"),
        ((torch.zeros(8, 128), torch.full((128, 8), float("inf"))), r"q_proj\.lora_B\.weight' has 1024 non-finite"),
    ],
    ids=["other-hidden-size", "non-finite"],
)
def test_startup_adapter_tensors_are_checked_before_the_model_loads(
    sglang_plugins_loaded, tiny_artifacts, tmp_path, monkeypatch, tensors, named
):
    monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", "torch")
    monkeypatch.delenv(checked_backends.ADAPTER_CHECKS_ENV, raising=False)
    adapter = write_adapter(tmp_path / "bad", tensors)
    with pytest.raises(ValueError, match=rf"LoRA adapter 'bad' cannot be served: tensor .*{named}"):
        check_args(tiny_artifacts, adapter, "intel_xpu")


def test_sglang_backends_are_untouched_unless_opted_in(sglang_plugins_loaded, tiny_artifacts, big_adapter, monkeypatch):
    monkeypatch.delenv(checked_backends.ADAPTER_CHECKS_ENV, raising=False)
    assert checked_backends.applies_to("intel_xpu") and not checked_backends.applies_to("csgmv")
    check_args(tiny_artifacts, big_adapter, "torch_native")  # SGLang's behaviour: accepted here
    monkeypatch.setenv(checked_backends.ADAPTER_CHECKS_ENV, "all")
    assert checked_backends.applies_to("csgmv")
    with pytest.raises(ValueError, match="exceeds --max-lora-rank 32"):
        check_args(tiny_artifacts, big_adapter, "torch_native")


def test_doctor_reports_the_scope_and_an_invalid_setting(sglang_plugins_loaded, monkeypatch):
    monkeypatch.delenv(checked_backends.ADAPTER_CHECKS_ENV, raising=False)
    report = {"problems": []}
    doctor.add_adapter_checks(report)
    assert report["adapter_checks"].startswith("plugin backends only (intel_xpu)") and report["problems"] == []
    monkeypatch.setenv(checked_backends.ADAPTER_CHECKS_ENV, "all")
    doctor.add_adapter_checks(report)
    assert "every LoRA backend" in report["adapter_checks"]
    monkeypatch.setenv(checked_backends.ADAPTER_CHECKS_ENV, "some")
    doctor.add_adapter_checks(report)
    assert report["problems"] == ["SGLANG_XPU_LORA_ADAPTER_CHECKS='some' is not one of plugin, all"]
    with pytest.raises(ValueError, match="is not one of plugin, all"):
        checked_backends.applies_to("intel_xpu")


def test_invalid_scope_setting_fails_at_argument_validation(sglang_plugins_loaded, tiny_artifacts, monkeypatch):
    from sglang.srt.server_args import ServerArgs

    monkeypatch.setenv(checked_backends.ADAPTER_CHECKS_ENV, "every")
    args = ServerArgs(
        model_path=str(tiny_artifacts["base"]), device="cpu", enable_lora=True, lora_backend="torch_native",
        max_lora_rank=8, lora_target_modules=["q_proj"],
    )
    args.resolve_once()
    with pytest.raises(ValueError, match="SGLANG_XPU_LORA_ADAPTER_CHECKS='every' is not one of plugin, all"):
        args.check_server_args()


@pytest.mark.parametrize("backend, leaks", [("intel_xpu", False), ("csgmv", True)])
def test_failed_load_leaves_nothing_behind(sglang_plugins_loaded, tiny_artifacts, monkeypatch, backend, leaks):
    """SGLang's ``_load_lora_adapter`` keeps the config of an adapter whose weights fail to load;
    for a backend in scope the plugin removes it (SGLang's own backends keep upstream behaviour)."""
    import types

    from sglang.srt.lora.lora_manager import LoRAManager
    from sglang.srt.lora.lora_registry import LoRARef

    from sglang_xpu_lora.adapters import AdapterRejected

    monkeypatch.delenv(checked_backends.ADAPTER_CHECKS_ENV, raising=False)

    def refuse_weights(lora_ref):
        raise AdapterRejected("tensor refused")

    manager = types.SimpleNamespace(
        configs={}, loras={}, lora_refs={}, num_pinned_loras=0,
        lora_backend=types.SimpleNamespace(name=backend), base_hf_config=types.SimpleNamespace(vocab_size=1024),
        validate_new_adapter=lambda config, ref: None, load_lora_weights=refuse_weights,
        create_lora_update_result=lambda success, error_message="": types.SimpleNamespace(success=success, error_message=error_message),
    )
    ref = LoRARef(lora_id="id-1", lora_name="bad", lora_path=str(tiny_artifacts["sql-r8"]))
    result = LoRAManager._load_lora_adapter(manager, ref)
    named = "tensor refused" if leaks else f"LoRA adapter 'bad' cannot be loaded from {ref.lora_path}: tensor refused"
    assert not result.success and result.error_message == named  # in scope, the message names the adapter
    assert ("id-1" in manager.configs) == leaks
