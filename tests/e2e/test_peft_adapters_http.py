"""Issue 12 (and issue 10 item 2) over HTTP, on one real ``launch_server`` (intel_xpu, portable
kernels, CPU, float32): PEFT adapters with rsLoRA, alpha/rank patterns, partial q/k/v and a regex
``target_modules`` are served as transformers + PEFT compute them (first-token log-probs within
1e-4 and 16 identical greedy tokens; rsLoRA also from ``--lora-paths``); adapters with refused
fields, for another hidden size, or with a NaN tensor get HTTP 400 naming the field or tensor,
leave nothing loaded, and the server keeps serving; so do a mistyped local path, a directory
without ``adapter_config.json`` or without weights, a target module the model does not have, added
tokens and a module the pool was not built for (issue 18). A launcher given a rank-64 adapter with
``--max-lora-rank 32`` and each of those bad adapters stops at argument validation, before the model
loads, naming every one."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

import adapter_rows
from sglang_cpu_devsupport import serving, tiny_model

pytestmark = pytest.mark.e2e

LOGPROB_TOLERANCE = 1e-4
PROMPT = "def main(self):"
AT_STARTUP = ["sql-r8", "rslora-r16"]


@pytest.fixture(scope="module")
def paths(tiny_artifacts):
    return {**tiny_artifacts, **adapter_rows.build(tiny_artifacts)}


@pytest.fixture(scope="module")
def nan_adapter(paths, tmp_path_factory):
    """A copy of alpha-pattern whose layer-1 v_proj LoRA-B holds one NaN."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("nan") / "nan-adapter"
    shutil.copytree(paths["alpha-pattern"], out)
    tensors = load_file(out / "adapter_model.safetensors")
    tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"][0, 0] = float("nan")
    save_file(tensors, out / "adapter_model.safetensors")
    return out


@pytest.fixture(scope="module")
def bad_adapters(paths, tmp_path_factory):
    """Adapters refused for their files, their target modules or their tokens (issue 18)."""
    return adapter_rows.build_broken(paths["sql-r8"], tmp_path_factory.mktemp("bad"), tiny_model.VOCAB_SIZE)


@pytest.fixture(scope="module")
def refused_launch(paths, bad_adapters, tmp_path_factory):
    """A launcher given ``--lora-paths big-r64`` with ``--max-lora-rank 32`` and every bad adapter,
    started before (and running alongside) the shared server's start-up; yields
    ``wait() -> (returncode, output)``."""
    bad = {name: path for name, (path, _) in bad_adapters.items()}
    argv = serving.server_argv({**paths, **bad}, ["sql-r8", "big-r64", *bad], serving.free_port())
    argv[argv.index("--log-level") + 1] = "info"  # so a model load would show ("Load weight begin")
    log_path = tmp_path_factory.mktemp("refused") / "launcher.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, env={**os.environ, **serving.cpu_env("torch")}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield lambda: (proc.wait(300), log_path.read_text())
    finally:
        serving.stop_server(proc)


@pytest.fixture(scope="module")
def server(paths, refused_launch, tmp_path_factory):
    """``post(path, payload)`` against one server started with ``--lora-paths sql-r8 rslora-r16``."""
    port = serving.free_port()
    argv = serving.server_argv(paths, AT_STARTUP, port)
    log = tmp_path_factory.mktemp("server") / "server.log"
    with serving.running_server(argv, port, serving.cpu_env("torch"), log):
        yield lambda path, payload: serving.post_json(f"http://127.0.0.1:{port}{path}", payload)


@pytest.fixture(scope="module")
def tokenizer(paths):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(paths["base"])


def generate(server, tokenizer, loras):
    ids = tokenizer.encode(PROMPT)
    return server(
        "/generate",
        {
            "input_ids": [ids] * len(loras),
            "lora_path": loras,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": serving.GREEDY_TOKENS, "ignore_eos": True},
            "return_logprob": True,
            "top_logprobs_num": tiny_model.VOCAB_SIZE,
        },
    )


def assert_equals_peft(outputs, loras, paths, tokenizer):
    ids = tokenizer.encode(PROMPT)
    for lora, out in zip(loras, outputs):
        ref_logprobs, ref_tokens = serving.hf_reference(paths["base"], paths[lora] if lora else None, ids, serving.GREEDY_TOKENS)
        got = serving.first_token_logprobs(out["meta_info"], tiny_model.VOCAB_SIZE)
        delta = float((got - ref_logprobs).abs().max())
        assert delta <= LOGPROB_TOLERANCE, f"{lora or 'base'}: max |Δ logprob| {delta:.2e}"
        assert out["output_ids"] == ref_tokens, lora or "base"


def test_served_rows_equal_transformers_and_peft(server, paths, tokenizer):
    loaded = [spec.name for spec in adapter_rows.SERVED if spec.name not in AT_STARTUP]
    for name in loaded:
        answer = server("/load_lora_adapter", {"lora_name": name, "lora_path": str(paths[name])})
        assert answer["success"], answer
    loras = [*AT_STARTUP, *loaded, None]
    assert_equals_peft(generate(server, tokenizer, loras), loras, paths, tokenizer)


def test_refused_rows_get_400_naming_field_or_tensor_and_nothing_loads(server, paths, tokenizer, nan_adapter, bad_adapters):
    refused = [(spec.name, paths[spec.name], named) for spec, named in adapter_rows.REFUSED]
    refused.append(("nan-adapter", nan_adapter, "'base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight' has 1 non-finite"))
    refused += [(name, path, named) for name, (path, named) in bad_adapters.items()]
    # The model has embed_tokens and lm_head, but the pool was built for the start-up adapters' modules.
    refused.append(("emb-head-r8", paths["emb-head-r8"], "restart it with --lora-target-modules including ['embed_tokens', 'lm_head']"))
    for name, path, named in refused:
        with pytest.raises(serving.HTTPStatusError) as answer:
            server("/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        assert answer.value.status == 400, answer.value
        assert repr(name) in answer.value.body and named in answer.value.body, answer.value.body
        assert f'"{name}"' not in answer.value.body.split('"loaded_adapters"')[1], answer.value.body
    # Still serving, with the same numbers; and a refused name was never taken.
    assert_equals_peft(generate(server, tokenizer, ["sql-r8", None]), ["sql-r8", None], paths, tokenizer)
    answer = server("/load_lora_adapter", {"lora_name": "other-hidden", "lora_path": str(paths["v-only"])})
    assert answer["success"], answer
    assert server("/unload_lora_adapter", {"lora_name": "other-hidden"})["success"]


def test_launcher_refuses_bad_adapters_before_loading_the_model(refused_launch, bad_adapters):
    returncode, output = refused_launch()
    assert returncode == 1, output[-3000:]
    assert "'big-r64'" in output and "exceeds --max-lora-rank 32" in output, output[-3000:]
    for name, (_, named) in bad_adapters.items():
        assert repr(name) in output and named in output, (name, output[-3000:])
    assert "Repo id" not in output and "Traceback" not in output, output[-3000:]
    assert "Load weight" not in output, output[-3000:]
