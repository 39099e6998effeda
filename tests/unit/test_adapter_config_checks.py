"""The adapter_config.json checks: every PEFT LoraConfig field has a rule, each refused field is
named with what to do, patterns and scales follow PEFT's own functions."""

from __future__ import annotations

import dataclasses
import math

import pytest

from sglang_xpu_lora.adapters import AdapterRejected
from sglang_xpu_lora.adapters.config_checks import (
    FIELDS,
    AdapterPlan,
    check_adapter_config,
    check_target_modules,
    pattern_key,
    resolve_target_regex,
)
from sglang_xpu_lora.adapters.scale_folding import module_scale, served_scale

peft = pytest.importorskip("peft")


def saved_config(**options):
    """What PEFT writes to adapter_config.json for ``LoraConfig(**options)``."""
    config = peft.LoraConfig(task_type="CAUSAL_LM", **{"target_modules": ["q_proj", "v_proj"], **options})
    return {k: (v.value if hasattr(v, "value") else v) for k, v in config.to_dict().items()}


def test_every_peft_lora_config_field_has_a_rule():
    names = {field.name for field in dataclasses.fields(peft.LoraConfig)}
    assert names - set(FIELDS) == set(), "PEFT fields without a rule"
    assert {rule.verdict for rule in FIELDS.values()} <= {"honoured", "ignored", "refused"}


def test_peft_defaults_are_served_as_is():
    plan = check_adapter_config("plain", saved_config(r=8, lora_alpha=16))
    assert (plan.served_rank, served_scale(plan), plan.warnings) == (8, 2.0, ())


@pytest.mark.parametrize(
    "options, field, todo",
    [
        ({"modules_to_save": ["embed_tokens"]}, "modules_to_save", "merge_and_unload"),
        ({"bias": "lora_only"}, "bias", "merge_and_unload"),
        ({"bias": "all"}, "bias", "merge_and_unload"),
        ({"lora_bias": True}, "lora_bias", "merge_and_unload"),
        ({"use_dora": True}, "use_dora", "merge_and_unload"),
        ({"trainable_token_indices": [3, 4]}, "trainable_token_indices", "merge_and_unload"),
        ({"layer_replication": [[0, 1], [0, 2]]}, "layer_replication", "merge_and_unload"),
        ({"alora_invocation_tokens": [5, 6]}, "alora_invocation_tokens", "aLoRA"),
        ({"target_modules": None, "target_parameters": ["mlp.experts.gate_up_proj"]}, "target_parameters", "target modules instead"),
        ({"target_modules": "(q_proj"}, "target_modules", "not a valid regular expression"),
        ({"rank_pattern": {"q_proj": 0}}, "rank_pattern", "positive integers"),
    ],
)
def test_refused_field_is_named_with_what_to_do(options, field, todo):
    with pytest.raises(AdapterRejected) as refused:
        check_adapter_config("tenant-a", saved_config(**options))
    message = str(refused.value)
    assert message.startswith("LoRA adapter 'tenant-a' cannot be served exactly: ")
    assert f"field {field!r}" in message and todo in message, message


def test_all_refusals_are_listed_at_once():
    with pytest.raises(AdapterRejected) as refused:
        check_adapter_config("x", saved_config(use_dora=True, modules_to_save=["lm_head"]))
    assert "use_dora" in str(refused.value) and "modules_to_save" in str(refused.value)


def test_peft_type_other_than_lora_is_refused():
    with pytest.raises(AdapterRejected, match="only LoRA adapters are served"):
        check_adapter_config("ia3", {**saved_config(), "peft_type": "IA3"})


def test_unknown_field_is_refused_only_when_set():
    assert check_adapter_config("future", {**saved_config(), "new_knob": None, "other": False}).r == 8
    with pytest.raises(AdapterRejected, match="field 'new_knob'=3 is unknown to PEFT 0.21.2"):
        check_adapter_config("future", {**saved_config(), "new_knob": 3})


def test_rank_above_max_lora_rank_names_the_flag_and_rank_pattern():
    with pytest.raises(AdapterRejected, match=r"field 'r': rank 64 exceeds --max-lora-rank 32; start the server with --max-lora-rank 64"):
        check_adapter_config("big", saved_config(r=64), max_lora_rank=32)
    with pytest.raises(AdapterRejected, match=r"field 'rank_pattern': rank 48 exceeds --max-lora-rank 32"):
        check_adapter_config("big", saved_config(r=8, rank_pattern={"v_proj": 48}), max_lora_rank=32)
    assert check_adapter_config("ok", saved_config(r=32), max_lora_rank=32).served_rank == 32


def test_base_modifying_init_is_served_with_a_warning():
    plan = check_adapter_config("pissa", saved_config(init_lora_weights="pissa_niter_4"))
    assert len(plan.warnings) == 1 and "path_initial_model_for_weight_conversion" in plan.warnings[0]


@pytest.mark.parametrize(
    "module_key",
    ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.v_proj", "model.layers.10.mlp.down_proj", "lm_head"],
)
def test_pattern_keys_match_peft(module_key):
    from peft.utils.other import get_pattern_key

    patterns = {"q_proj": 4, r"layers\.1\..*v_proj": 12, "^model.layers.10.mlp.down_proj": 2, "layers.0.self_attn.v_proj": 6}
    expected = get_pattern_key(patterns.keys(), module_key)
    assert pattern_key(patterns, module_key) == (expected if expected in patterns else None)


@pytest.mark.parametrize("use_rslora", [False, True])
def test_module_scale_matches_peft_layer_scaling(use_rslora):
    from peft.tuners.lora.layer import Linear as LoraLinear
    import torch

    config = saved_config(r=8, lora_alpha=16, use_rslora=use_rslora, rank_pattern={"q_proj": 4}, alpha_pattern={"q_proj": 40})
    plan = check_adapter_config("s", config)
    for key, r, alpha in (("model.layers.0.self_attn.q_proj", 4, 40), ("model.layers.0.self_attn.v_proj", 8, 16)):
        layer = LoraLinear(torch.nn.Linear(4, 4), "default", r=r, lora_alpha=alpha, config=peft.LoraConfig(use_rslora=use_rslora))
        assert module_scale(plan, key) == pytest.approx(layer.scaling["default"], rel=1e-12)
    assert served_scale(plan) == (16 / math.sqrt(8) if use_rslora else 2.0)


def test_zero_alpha_is_served_at_scale_one_so_patterns_still_fold():
    plan = check_adapter_config("z", saved_config(r=8, lora_alpha=0, alpha_pattern={"v_proj": 16}))
    assert served_scale(plan) == 1.0 and module_scale(plan, "model.layers.0.self_attn.v_proj") == 2.0


def test_regex_target_modules_resolve_like_peft_and_must_match_something():
    keys = [f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.q_proj", "self_attn.k_proj", "mlp.up_proj")]
    plan = AdapterPlan(name="re", r=8, lora_alpha=16, target_modules=r".*layers\.1\..*(q|up)_proj")
    assert resolve_target_regex(plan, keys) == ["q_proj", "up_proj"]
    with pytest.raises(AdapterRejected, match="matches no module of the base model"):
        resolve_target_regex(AdapterPlan(name="re", r=8, lora_alpha=16, target_modules="nothing"), keys)
    assert AdapterPlan(name="a", r=8, lora_alpha=8, target_modules="all-linear").target_regex is None


def test_docs_page_names_every_field():
    from pathlib import Path

    page = (Path(__file__).parents[2] / "docs" / "peft-adapters.md").read_text()
    assert [field for field in FIELDS if f"`{field}`" not in page] == []


def normalize(modules):
    """SGLang's own names for target modules (what the plugin passes)."""
    from sglang.srt.lora.utils import get_normalized_target_modules

    return get_normalized_target_modules(modules)


def capable():
    """SGLang's own LoRA-capable target modules (what the plugin passes)."""
    from sglang_xpu_lora.adapters.served_targets import lora_capable_modules

    return lora_capable_modules()


LLAMA_MODULES = [f"model.layers.0.self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj", "o_proj")] + [
    f"model.layers.0.mlp.{m}" for m in ("gate_proj", "up_proj", "down_proj")
] + ["model.embed_tokens", "lm_head"]


@pytest.mark.parametrize(
    "target_modules",
    [["q_proj", "v_proj"], ["self_attn.q_proj", "o_proj"], ["qkv_proj", "gate_up_proj"], "all-linear", r".*\.q_proj"],
)
def test_target_modules_the_model_has_pass(target_modules):
    check_target_modules("a", target_modules, LLAMA_MODULES, normalize, capable())
    check_target_modules(
        "a", target_modules, LLAMA_MODULES, normalize, capable(), served_modules={"qkv_proj", "o_proj", "gate_up_proj"}
    )


def test_a_target_module_the_model_does_not_have_is_named():
    with pytest.raises(AdapterRejected) as refused:
        check_target_modules("a", ["q_proj", "query_key_value", "c_attn"], LLAMA_MODULES, normalize, capable())
    assert str(refused.value) == (
        "LoRA adapter 'a' cannot be served exactly: field 'target_modules' names ['query_key_value', 'c_attn'], "
        "which the base model does not have; the adapter was trained for another model (or, if it has no tensors "
        "for them, remove them from target_modules in adapter_config.json)"
    )


def test_a_target_module_the_pool_was_not_built_for_is_named_with_the_flag():
    with pytest.raises(AdapterRejected) as refused:
        check_target_modules(
            "a", ["q_proj", "up_proj", "lm_head"], LLAMA_MODULES, normalize, capable(), served_modules={"qkv_proj"}
        )
    assert "names ['up_proj', 'lm_head'], but the server was started with LoRA on ['qkv_proj'] only; restart it " \
        "with --lora-target-modules including ['gate_up_proj', 'lm_head'] (or all)" in str(refused.value)


GPT2_MODULES = [f"transformer.h.0.attn.{m}" for m in ("c_attn", "c_proj")] + ["transformer.h.0.mlp.c_fc", "lm_head"]


def test_a_module_the_model_has_but_sglang_has_no_lora_layer_for_is_named_as_such():
    """PEFT's GPT-2 adapter: the modules exist; SGLang 0.5.23's LoRA serves none of them (its
    ``_KNOWN_LORA_TARGET_MODULES``). Checked after "the model does not have", so an adapter for
    another model is still told so."""
    with pytest.raises(AdapterRejected) as refused:
        check_target_modules("gpt2", ["c_attn", "c_proj", "c_fc"], GPT2_MODULES, normalize, capable())
    message = str(refused.value)
    assert message.startswith(
        "LoRA adapter 'gpt2' cannot be served exactly: field 'target_modules' names ['c_attn', 'c_proj', 'c_fc']: "
        "the base model has them, but SGLang 0.5.23 has no LoRA layer for them (it serves LoRA on ["
    )
    assert "'qkv_proj'" in message and "does not have" not in message and message.endswith("serve that")
    with pytest.raises(AdapterRejected, match="which the base model does not have"):
        check_target_modules("gpt2", ["c_attn", "q_proj"], GPT2_MODULES, normalize, capable())
    check_target_modules("gpt2", ["lm_head"], GPT2_MODULES, normalize, capable())
