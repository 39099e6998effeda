"""A real SGLang engine and server on CPU serving adapters through ``intel_xpu`` (portable kernels),
compared with transformers + PEFT.

float32 end to end with ``--max-lora-rank 32`` above every adapter's rank (4, 8, 16): first-token
log-probs over the whole vocabulary agree within 1e-4 (observed ~3e-6: the same math in another
summation order) and 16 greedy tokens are identical, for the base model and every adapter in one
mixed batch. Without the pool patch the ranks below the maximum would give visibly wrong numbers.
"""

from __future__ import annotations

import os
import socket
import subprocess

import pytest

from sglang_cpu_devsupport import serving, tiny_model

pytestmark = pytest.mark.e2e

LOGPROB_TOLERANCE = 1e-4
MAX_NEW_TOKENS = 16
PROMPTS = ["def main(self):", "import os\nfor path in", "class Foo(object):\n    def"]
ADAPTERS = [spec.name for spec in tiny_model.DEFAULT_ADAPTERS]
LORAS = [None, *ADAPTERS]


@pytest.fixture(scope="module")
def portable_env():
    saved = {k: os.environ.get(k) for k in serving.cpu_env()}
    os.environ.update(serving.cpu_env("torch"))
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def tokenizer(tiny_artifacts):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_artifacts["base"])


@pytest.fixture(scope="module")
def engine_outputs(portable_env, tiny_artifacts, tokenizer):
    """One mixed batch (every prompt x base and every adapter) through one engine."""
    import sglang

    engine = sglang.Engine(**serving.engine_kwargs(tiny_artifacts, ADAPTERS))
    try:
        requests = [(prompt, lora) for prompt in PROMPTS for lora in LORAS]
        outputs = engine.generate(
            input_ids=[tokenizer.encode(prompt) for prompt, _ in requests],
            lora_path=[lora for _, lora in requests],
            sampling_params={"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True},
            return_logprob=True,
            top_logprobs_num=tiny_model.VOCAB_SIZE,
        )
    finally:
        engine.shutdown()
    return dict(zip(requests, outputs))


@pytest.mark.parametrize("lora", LORAS, ids=lambda lora: lora or "base")
@pytest.mark.parametrize("prompt", PROMPTS, ids=["def", "for", "class"])
def test_mixed_batch_matches_transformers_peft(engine_outputs, tiny_artifacts, tokenizer, prompt, lora):
    out = engine_outputs[(prompt, lora)]
    ids = tokenizer.encode(prompt)
    ref_logprobs, ref_tokens = serving.hf_reference(
        tiny_artifacts["base"], tiny_artifacts[lora] if lora else None, ids, MAX_NEW_TOKENS
    )
    got = serving.first_token_logprobs(out["meta_info"], tiny_model.VOCAB_SIZE)
    assert bool((got > float("-inf")).all()), "SGLang returned fewer than vocab_size log-probs"
    delta = float((got - ref_logprobs).abs().max())
    assert delta <= LOGPROB_TOLERANCE, f"max |Δ logprob| {delta:.2e}"
    assert out["output_ids"] == ref_tokens


def test_adapters_change_the_output(engine_outputs):
    """Guards the comparison itself: every adapter (nonzero B) gives tokens unlike the base's."""
    for prompt in PROMPTS:
        base = engine_outputs[(prompt, None)]["output_ids"]
        assert all(engine_outputs[(prompt, lora)]["output_ids"] != base for lora in ADAPTERS)


def port_is_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_http_server_returns_the_engine_tokens(portable_env, engine_outputs, tiny_artifacts, tokenizer, tmp_path):
    port = serving.free_port()
    argv = serving.server_argv(tiny_artifacts, ADAPTERS, port)
    assert argv[argv.index("--lora-backend") + 1] == "intel_xpu"
    prompt = PROMPTS[0]
    ids = tokenizer.encode(prompt)
    params = {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}
    with serving.running_server(argv, port, serving.cpu_env("torch"), tmp_path / "server.log") as proc:
        generated = serving.post_json(
            f"http://127.0.0.1:{port}/generate",
            {"input_ids": [ids] * len(LORAS), "lora_path": LORAS, "sampling_params": params},
        )
        for lora, out in zip(LORAS, generated):
            assert out["output_ids"] == engine_outputs[(prompt, lora)]["output_ids"], lora
        for lora in ADAPTERS:
            completion = serving.post_json(
                f"http://127.0.0.1:{port}/v1/completions",
                {"model": f"tiny-llama:{lora}", "prompt": prompt, "max_tokens": MAX_NEW_TOKENS,
                 "temperature": 0.0, "ignore_eos": True},
            )
            expected = tokenizer.decode(engine_outputs[(prompt, lora)]["output_ids"])
            assert completion["choices"][0]["text"] == expected, lora
    assert proc.returncode is not None
    assert not port_is_open(port)
    leftover = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert leftover == [], f"server processes left behind: {leftover}"


def test_engine_refuses_intel_xpu_on_cpu_without_portable_kernels(tiny_artifacts, monkeypatch):
    import sglang

    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    monkeypatch.delenv("SGLANG_XPU_LORA_KERNELS", raising=False)
    with pytest.raises(ValueError, match="--lora-backend intel_xpu requires --device xpu, got --device cpu"):
        sglang.Engine(**serving.engine_kwargs(tiny_artifacts, ADAPTERS))
