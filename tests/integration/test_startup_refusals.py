"""Issue 27 item 4: start-up refusals decided from the model's config and the adapters' files, at
argument validation, with the true reason; through ``check_lora_paths`` (the AFTER hook on SGLang's
``check_lora_server_args``), the real ``sglang.Engine(...)`` and ``sglang serve``.

The models are tiny transformers models with random weights and PEFT adapters built here:

* Qwen2-MoE with a PEFT adapter on ``gate_proj``, ``up_proj``, ``down_proj``: PEFT puts them on
  the dense shared expert only, but SGLang reads the names as gate_up_proj / down_proj and wraps
  the routed experts too, whose LoRA runs only in SGLang's Triton MoE-LoRA kernels;
* Qwen3-MoE with an attention adapter, served with ``--lora-target-modules all`` (which wraps the
  experts);
* GPT-2 with PEFT's adapter on ``c_attn``, ``c_proj``, ``c_fc``, which the model has and SGLang
  0.5.23 has no LoRA layer for.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types

import pytest

from sglang_cpu_devsupport import serving, tiny_model
from sglang_xpu_lora.adapters import checked_backends

ADAPTERS = {
    "qwen2_moe": tiny_model.AdapterSpec("shared", rank=4, alpha=8, target_modules=("gate_proj", "up_proj", "down_proj"), seed=41),
    "qwen3_moe": tiny_model.AdapterSpec("attn", rank=4, alpha=8, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"), seed=42),
    "gpt2": tiny_model.AdapterSpec("gpt2-peft", rank=4, alpha=8, target_modules=("c_attn", "c_proj", "c_fc"), seed=43),
}
#: Adapters whose target_modules is a regular expression (PEFT resolves it against the model): the
#: first two select what the adapters above name, the last attention only.
REGEX_ADAPTERS = {
    "qwen2_moe": tiny_model.AdapterSpec(
        "shared-regex", rank=4, alpha=8, seed=44,
        target_modules=r".*\.shared_expert\.(gate|up|down)_proj",
    ),
    "gpt2": tiny_model.AdapterSpec(
        "gpt2-regex", rank=4, alpha=8, target_modules=r".*\.c_attn", seed=45
    ),
    "qwen3_moe": tiny_model.AdapterSpec(
        "attn-regex", rank=4, alpha=8, target_modules=r".*\.self_attn\.(q|v)_proj", seed=46
    ),
}
#: The shared-expert refusal, as far as it does not depend on the device's Triton.
QWEN2_MOE_REFUSAL = (
    "LoRA on cpu cannot serve these target modules: adapter 'shared' names ['down_proj', 'gate_proj', 'up_proj']. "
    "SGLang 0.5.23 reads gate_proj/up_proj (gate_up_proj) and down_proj as LoRA targets of the routed experts too "
    "and wraps every MoE layer's experts (model.layers.0.mlp.experts, ...) when both are targeted; in this model "
    "those names are the dense mlp.shared_expert modules, which hold the adapter's weights, but the experts are "
    "wrapped all the same, and SGLang runs LoRA on experts only in its Triton MoE-LoRA kernels "
    "(sglang.kernels.ops.lora.moe), whatever --lora-backend, while Triton has no CPU backend"
)
#: The GPT-2 refusal; PEFT saves target_modules in set order, so the names are matched as a set.
GPT2_REFUSAL = re.compile(
    r"LoRA adapter 'gpt2-peft' cannot be served exactly: field 'target_modules' names \[(?P<named>[^]]*)\]: the base "
    r"model has them, but SGLang 0\.5\.23 has no LoRA layer for them \(it serves LoRA on \[.*'qkv_proj'.*\] only"
)


def assert_gpt2_refusal(message):
    found = GPT2_REFUSAL.match(message)
    assert found, message
    assert sorted(name.strip(" '") for name in found["named"].split(",")) == ["c_attn", "c_fc", "c_proj"], message
    assert "does not have" not in message and "trained for another model" not in message


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``{architecture: {"base": path, <adapter>: path}}``; each base's weights replaced by bytes
    that are no safetensors file afterwards, in a copy (``"unreadable"``), so a refusal that reads
    them cannot pass for one made before the load."""
    root = tmp_path_factory.mktemp("startup")
    built = {}
    for architecture, spec in ADAPTERS.items():
        adapters = (spec, REGEX_ADAPTERS[architecture])
        paths = tiny_model.build_all(root / architecture, adapters, architecture=architecture)
        unreadable = root / f"{architecture}-unreadable"
        unreadable.mkdir()
        for item in paths["base"].iterdir():
            target = unreadable / item.name
            target.write_bytes(b"not a safetensors file" if item.suffix == ".safetensors" else item.read_bytes())
        built[architecture] = {**paths, "unreadable": unreadable}
    return built


@pytest.fixture
def on_cpu_without_triton(monkeypatch, sglang_plugins_loaded):
    """The CPU as users have it: no Triton interpreter (the test session sets ``TRITON_INTERPRET``)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(checked_backends.ADAPTER_CHECKS_ENV, raising=False)


def server_args(paths, adapter, **fields):
    """What SGLang's check_lora_server_args leaves for the plugin's AFTER hook."""
    from sglang.srt.lora.lora_registry import LoRARef

    values = dict(
        enable_lora=True, lora_backend="intel_xpu", lora_paths=[LoRARef(lora_name=adapter, lora_path=str(paths[adapter]))],
        model_path=str(paths["base"]), trust_remote_code=False, max_lora_rank=32, lora_target_modules=None, device="cpu",
    )
    return types.SimpleNamespace(**{**values, **fields})


def test_qwen2_moe_shared_expert_adapter_is_refused_for_the_experts_sglang_would_wrap(models, on_cpu_without_triton, monkeypatch):
    from sglang_xpu_lora.patches.adapter_checks import check_lora_paths

    with pytest.raises(ValueError) as refused:
        check_lora_paths(server_args(models["qwen2_moe"], "shared"))
    message = str(refused.value)
    assert message.startswith(QWEN2_MOE_REFUSAL), message
    assert "Serve on a device where Triton runs (--device xpu)" in message and "PeftModel.merge_and_unload" in message
    # Where Triton runs (its interpreter here), SGLang's MoE-LoRA kernels run: nothing is refused.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    check_lora_paths(server_args(models["qwen2_moe"], "shared"))


def test_qwen3_moe_experts_are_refused_where_lora_target_modules_all_wraps_them(models, on_cpu_without_triton):
    from sglang_xpu_lora.patches.adapter_checks import check_lora_paths

    paths = models["qwen3_moe"]
    check_lora_paths(server_args(paths, "attn"))  # attention only: the experts are not wrapped
    check_lora_paths(server_args(paths, "attn", lora_target_modules={"q_proj", "o_proj", "gate_up_proj"}))
    for flag in ({"all"}, {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}):
        with pytest.raises(ValueError) as refused:
            check_lora_paths(server_args(paths, "attn", lora_target_modules=flag))
        message = str(refused.value)
        assert message.startswith(f"LoRA on cpu cannot serve these target modules: --lora-target-modules names {sorted(flag)}. ")
        assert "this model has no such modules outside the routed experts, but the experts are wrapped all the same" in message
    # Without adapters at start-up the flag alone decides.
    with pytest.raises(ValueError, match="--lora-target-modules names \\['all'\\]"):
        check_lora_paths(server_args(paths, "attn", lora_paths=[], lora_target_modules={"all"}))


def test_gpt2_peft_adapter_is_refused_for_the_lora_layer_sglang_lacks(models, on_cpu_without_triton):
    from sglang_xpu_lora.patches.adapter_checks import check_lora_paths

    with pytest.raises(ValueError) as refused:
        check_lora_paths(server_args(models["gpt2"], "gpt2-peft"))
    assert_gpt2_refusal(str(refused.value))


def test_a_regular_expression_target_modules_is_refused_like_the_modules_it_selects(
    models, on_cpu_without_triton
):
    """A regex ``target_modules`` is resolved against the base model at argument validation: the
    Qwen2-MoE and GPT-2 refusals hold for it (they came only after the model load, the MoE one
    with the reason this issue replaced), and an attention-only regex on Qwen3-MoE is served."""
    from sglang_xpu_lora.patches.adapter_checks import check_lora_paths

    with pytest.raises(ValueError) as refused:
        check_lora_paths(server_args(models["qwen2_moe"], "shared-regex"))
    expected = QWEN2_MOE_REFUSAL.replace("'shared'", "'shared-regex'")
    assert str(refused.value).startswith(expected), refused.value
    with pytest.raises(ValueError) as refused:
        check_lora_paths(server_args(models["gpt2"], "gpt2-regex"))
    assert str(refused.value).startswith(
        "LoRA adapter 'gpt2-regex' cannot be served exactly: field 'target_modules' names "
        "['c_attn']: the base model has them, but SGLang 0.5.23 has no LoRA layer for them"
    ), refused.value
    check_lora_paths(server_args(models["qwen3_moe"], "attn-regex"))


ENGINE_CASES = {
    "qwen2_moe": ("shared", {}),
    "qwen3_moe": ("attn", {"lora_target_modules": ["all"]}),
    "gpt2": ("gpt2-peft", {}),
}


def engine_env():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", checked_backends.ADAPTER_CHECKS_ENV)}
    return {**env, **serving.cpu_env("torch")}


@pytest.mark.launches
def test_the_real_engine_raises_in_the_caller_before_reading_the_weights(models, tmp_path):
    """``sglang.Engine(...)`` in a fresh process, on the copies whose weights are unreadable: each
    refusal is a ``ValueError`` (``BackendArgumentError``) raised in the caller with the true reason,
    and no scheduler process was started (nothing was loaded: the weights would not have read)."""
    cases = {
        name: serving.engine_kwargs({**models[name], "base": models[name]["unreadable"]}, [adapter], **overrides)
        for name, (adapter, overrides) in ENGINE_CASES.items()
    }
    code = f"""
import json, multiprocessing, sys
import sglang
from sglang_xpu_lora.patches.errors import BackendArgumentError
out = {{}}
for name, kwargs in json.loads(sys.argv[1]).items():
    try:
        sglang.Engine(**kwargs)
        out[name] = "started"
    except BackendArgumentError as exc:
        out[name] = {{"message": str(exc), "children": len(multiprocessing.active_children())}}
print("RESULT " + json.dumps(out))
"""
    result = subprocess.run(
        [sys.executable, "-c", code, json.dumps(cases)], env={**engine_env(), "TMPDIR": str(tmp_path)},
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    outcome = json.loads(line.removeprefix("RESULT "))
    assert outcome["qwen2_moe"]["message"].startswith(QWEN2_MOE_REFUSAL)
    assert outcome["qwen3_moe"]["message"].startswith("LoRA on cpu cannot serve these target modules: --lora-target-modules names ['all']")
    assert_gpt2_refusal(outcome["gpt2"]["message"])
    assert all(case["children"] == 0 for case in outcome.values()), outcome
    assert "safetensors" not in result.stderr.lower()


@pytest.mark.launches
def test_sglang_serve_ends_with_the_message_alone(models, tmp_path):
    paths = {**models["qwen2_moe"], "base": models["qwen2_moe"]["unreadable"]}
    argv = serving.server_argv(paths, ["shared"], serving.free_port(), log_level="info")
    result = subprocess.run(argv, env={**engine_env(), "TMPDIR": str(tmp_path)}, capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: " + QWEN2_MOE_REFUSAL), result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "Load weight" not in result.stderr + result.stdout
