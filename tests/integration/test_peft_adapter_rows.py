"""Issue 12's table, module by module, against PEFT: each adapter built by PEFT on the tiny Llama,
checked and rewritten by the plugin's adapter stage, must give every linear module the update
PEFT's ``get_delta_weight`` gives (served scale x B' A', float32, 1e-6), at one rank; refused rows
must name the field or tensor. End to end over HTTP: tests/e2e/test_peft_adapters_http.py."""

from __future__ import annotations

import json

import pytest
import torch

import adapter_rows
from sglang_xpu_lora.adapters import AdapterRejected
from sglang_xpu_lora.adapters.config_checks import check_adapter_config, resolve_target_regex
from sglang_xpu_lora.adapters.scale_folding import fold_and_pad, served_scale
from sglang_xpu_lora.adapters.tensor_checks import FUSED_SLICES, check_tensors, fill_missing_slices, hf_meta_dims

TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def rows(tiny_artifacts):
    return adapter_rows.build(tiny_artifacts)


@pytest.fixture(scope="module")
def base_linears(rows):
    """The transformers base model's LoRA-able module names (PEFT module keys)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(rows["base"], dtype=torch.float32)
    return [name for name, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))]


@pytest.fixture(scope="module")
def dims(rows):
    """The base model's module shapes, read as at argument validation (meta device)."""
    return hf_meta_dims(str(rows["base"]))


def load_adapter(path):
    from safetensors.torch import load_file

    return json.loads((path / "adapter_config.json").read_text()), load_file(path / "adapter_model.safetensors")


def peft_deltas(base_dir, adapter_dir):
    """PEFT module key -> PEFT's own update ``scaling * B @ A`` (out, in) for each LoRA module."""
    from peft import PeftModel
    from peft.tuners.lora import Linear as LoraLinear
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), adapter_dir)
    prefix = "base_model.model."
    return {
        name[len(prefix):]: module.get_delta_weight("default").detach()
        for name, module in model.named_modules()
        if isinstance(module, LoraLinear)
    }


@pytest.mark.parametrize("spec", adapter_rows.SERVED, ids=lambda s: s.name)
def test_served_adapter_equals_peft_module_by_module(spec, rows, base_linears, dims):
    config, tensors = load_adapter(rows[spec.name])
    plan = check_adapter_config(spec.name, config, max_lora_rank=32)
    check_tensors(plan, tensors.items(), dims)
    fold_and_pad(plan, tensors)
    fill_missing_slices(tensors, dims, set(FUSED_SLICES))
    if plan.target_regex:  # resolved as PEFT resolves it
        assert resolve_target_regex(plan, base_linears) == ["q_proj", "up_proj"]
    expected = peft_deltas(rows["base"], rows[spec.name])
    scale = served_scale(plan)
    served_modules = {name[len("base_model.model."):].rsplit(".lora_", 1)[0] for name in tensors}
    assert set(expected) <= served_modules
    for key in sorted(served_modules):
        a = tensors[f"base_model.model.{key}.lora_A.weight"]
        b = tensors[f"base_model.model.{key}.lora_B.weight"]
        assert a.shape[0] == b.shape[1] == plan.served_rank, key  # one rank per adapter
        served = scale * (b.double() @ a.double())
        reference = expected.get(key, torch.zeros_like(served)).double()  # an untargeted slice adds nothing
        delta = float((served - reference).abs().max())
        assert delta <= TOLERANCE, f"{spec.name} {key}: max |Δ| {delta:.2e}"


def test_partial_qkv_adapters_get_zero_slices_for_the_fused_module(rows, dims):
    _, tensors = load_adapter(rows["kv-only"])
    added = fill_missing_slices(tensors, dims, {"qkv_proj"})
    assert sorted(added) == [f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_{f}.weight" for i in (0, 1) for f in "AB"]
    q_b = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert q_b.shape == (128, 8) and not q_b.any()


@pytest.mark.parametrize("spec, named", adapter_rows.REFUSED, ids=[spec.name for spec, _ in adapter_rows.REFUSED])
def test_refused_adapter_names_the_field_or_tensor(spec, named, rows, dims):
    config, tensors = load_adapter(rows[spec.name])
    with pytest.raises(AdapterRejected) as refused:
        plan = check_adapter_config(spec.name, config, max_lora_rank=32)
        check_tensors(plan, tensors.items(), dims)
    message = str(refused.value)
    assert repr(spec.name) in message and named in message, message


def test_wrong_hidden_size_names_tensor_and_both_shapes(rows, dims):
    config, tensors = load_adapter(rows["other-hidden"])
    plan = check_adapter_config("other-hidden", config)
    with pytest.raises(AdapterRejected, match=r"tensor 'base_model\.model\.model\.layers\.0\.self_attn\.q_proj\.lora_A\.weight' has shape \(8, 64\), expected \(8, 128\)"):
        check_tensors(plan, tensors.items(), dims)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_tensor_is_refused_naming_it(value, rows, dims):
    config, tensors = load_adapter(rows["alpha-pattern"])
    name = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    tensors[name][3, 2] = value
    plan = check_adapter_config("nan-adapter", config)
    with pytest.raises(AdapterRejected, match=rf"'nan-adapter'.*tensor '{name}' has 1 non-finite value"):
        check_tensors(plan, tensors.items(), dims)


def test_rank_above_max_lora_rank_is_refused_naming_the_flag(rows):
    config, _ = load_adapter(rows["big-r64"])
    with pytest.raises(AdapterRejected, match=r"'big-r64'.*rank 64 exceeds --max-lora-rank 32; start the server with --max-lora-rank 64"):
        check_adapter_config("big-r64", config, max_lora_rank=32)


def test_missing_lora_b_is_refused(rows, dims):
    config, tensors = load_adapter(rows["v-only"])
    del tensors["base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"]
    plan = check_adapter_config("v-only", config)
    with pytest.raises(AdapterRejected, match=r"has lora_A but no lora_B"):
        check_tensors(plan, tensors.items(), dims)


@pytest.mark.parametrize("name", ["rslora-r16", "alpha-pattern"])
def test_sglang_scale_alone_differs_from_peft(name, rows):
    """The failure the folding exists for: lora_alpha / r with the tensors as saved (SGLang's own
    treatment) is not PEFT's update."""
    config, tensors = load_adapter(rows[name])
    expected = peft_deltas(rows["base"], rows[name])
    key = "model.layers.0.self_attn.v_proj"
    naive = config["lora_alpha"] / config["r"] * (tensors[f"base_model.model.{key}.lora_B.weight"] @ tensors[f"base_model.model.{key}.lora_A.weight"])
    assert float((naive - expected[key]).abs().max()) > 1e-2


def test_saved_base_embeddings_are_accepted_at_the_base_shape_only(tiny_artifacts, dims):
    """PEFT saves the base embed_tokens / lm_head next to their LoRA factors; they are the base's
    own weights (not served), so only a resized vocabulary is refused."""
    adapter = tiny_artifacts["emb-head-r8"]
    config, tensors = load_adapter(adapter)
    assert "base_model.model.lm_head.base_layer.weight" in tensors
    plan = check_adapter_config("emb-head-r8", config)
    check_tensors(plan, tensors.items(), dims)
    tensors["base_model.model.model.embed_tokens.base_layer.weight"] = torch.zeros(1030, 128)
    with pytest.raises(AdapterRejected, match=r"saved model\.embed_tokens of shape \(1030, 128\), but the base model's is \(1024, 128\)"):
        check_tensors(plan, tensors.items(), dims)
