"""A real SGLang engine and server on CPU serving adapters through ``intel_xpu``, compared with
transformers + PEFT, for the portable provider and for the native provider over emulated
sgl-kernel-xpu builds.

float32 end to end with ``--max-lora-rank 32`` above every adapter's rank (4, 8, 16): first-token
log-probs over the whole vocabulary agree within 1e-4 (observed ~3e-6: the same math in another
summation order) and 16 greedy tokens are identical, for the base model and every adapter in one
mixed batch. Without the pool patch the ranks below the maximum would give visibly wrong numbers.
A server started with ``sglang serve`` returns the same tokens over HTTP.
Each configuration runs in its own process (``sglang_cpu_devsupport.engine_batch``); with an
emulated build, every kernel call is logged, so the test asserts which ops ran natively.
"""

from __future__ import annotations

import socket
import subprocess

import pytest
import torch

from sglang_cpu_devsupport import kernel_emulator, leftovers, serving, tiny_model

ADAPTERS = list(tiny_model.ADAPTER_NAMES)
MAX_NEW_TOKENS = serving.GREEDY_TOKENS

pytestmark = pytest.mark.e2e

LOGPROB_TOLERANCE = 1e-4
PROMPTS = ["def main(self):", "import os\nfor path in", "class Foo(object):\n    def"]
LORAS = [None, *ADAPTERS]
GEMM_OPS = {"sgemm_lora_a_fwd", "sgemm_lora_b_fwd", "qkv_lora_b_fwd", "gate_up_lora_b_fwd"}
CHUNKED_OPS = {"chunked_sgmv_lora_shrink_fwd", "chunked_sgmv_lora_expand_fwd"}

#: name -> (environment, kernels expected to run natively; None for the portable provider).
CONFIGS = {
    "portable": ({"SGLANG_XPU_LORA_KERNELS": "torch"}, None),
    "native-v0.1.0": ({"SGLANG_XPU_LORA_KERNELS": "auto", kernel_emulator.BUILD_ENV: "v0.1.0"}, {"sgemm_lora_a_fwd"}),
    "native-v0.2.0": (
        {"SGLANG_XPU_LORA_KERNELS": "auto", kernel_emulator.BUILD_ENV: "v0.2.0"},
        {"sgemm_lora_a_fwd", "sgemm_lora_b_fwd", "qkv_lora_b_fwd"},
    ),
    "native-full": ({"SGLANG_XPU_LORA_KERNELS": "native", kernel_emulator.BUILD_ENV: "full"}, GEMM_OPS | CHUNKED_OPS),
    # SGLang's Triton kernels in Triton's interpreter, on SGLang's packed pool with the real ranks.
    "triton": ({"SGLANG_XPU_LORA_KERNELS": "triton", "TRITON_INTERPRET": "1"}, None),
    # The dense tier (SGLang's triton_v2 kernels behind forward_with_base) for every batch's linears.
    "dense": ({"SGLANG_XPU_LORA_KERNELS": "triton", "TRITON_INTERPRET": "1", "SGLANG_XPU_LORA_EAGER_DENSE_MIN_TOKENS": "1"}, None),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def engine_run(request, run_engine):
    """One mixed batch (every prompt x base and every adapter) through one engine per configuration."""
    env, expected_native = CONFIGS[request.param]
    (outputs,), kernels = run_engine(request.param, [[(p, lora) for p in PROMPTS for lora in LORAS]], env)
    return outputs, kernels, expected_native


@pytest.mark.parametrize("lora", LORAS, ids=lambda lora: lora or "base")
@pytest.mark.parametrize("prompt", PROMPTS, ids=["def", "for", "class"])
def test_mixed_batch_matches_transformers_peft(engine_run, hf_reference, prompt, lora):
    outputs, _, _ = engine_run
    out = outputs[(prompt, lora)]
    ref_logprobs, ref_tokens = hf_reference(prompt, lora)
    got = torch.tensor(out["first_logprobs"], dtype=torch.float64)
    assert bool(torch.isfinite(got).all()), "SGLang returned fewer than vocab_size log-probs"
    delta = float((got - ref_logprobs).abs().max())
    assert delta <= LOGPROB_TOLERANCE, f"max |Δ logprob| {delta:.2e}"
    assert out["output_ids"] == ref_tokens


def test_ops_ran_on_the_expected_provider(engine_run):
    """Native kernels ran exactly for the ops the emulated build has; the rest ran portable."""
    _, called, expected_native = engine_run
    assert called == (expected_native or set())


def test_adapters_change_the_output(engine_run):
    """Guards the comparison itself: every adapter (nonzero B) gives tokens unlike the base's."""
    outputs, _, _ = engine_run
    for prompt in PROMPTS:
        base = outputs[(prompt, None)]["output_ids"]
        assert all(outputs[(prompt, lora)]["output_ids"] != base for lora in ADAPTERS)


def port_is_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_sglang_serve_returns_the_engine_tokens(tiny_artifacts, tokenizer, hf_reference, tmp_path):
    """A server started with ``sglang serve`` (portable kernels) returns the tokens the engine and
    transformers + PEFT give, and stops completely; the files it leaves are removed."""
    port = serving.free_port()
    argv = serving.server_argv(tiny_artifacts, ADAPTERS, port)
    assert argv[:2] == [serving.sglang_console_script(), "serve"]
    assert argv[argv.index("--lora-backend") + 1] == "intel_xpu"
    prompt = PROMPTS[0]
    ids = tokenizer.encode(prompt)
    params = {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}
    with serving.running_server(argv, port, serving.cpu_env("torch"), tmp_path / "server.log") as proc:
        mapped = leftovers.server_files(proc.pid)
        assert len(mapped) == 1 and next(iter(mapped)).name.startswith("sglang_loads_"), mapped
        generated = serving.post_json(
            f"http://127.0.0.1:{port}/generate",
            {"input_ids": [ids] * len(LORAS), "lora_path": LORAS, "sampling_params": params},
        )
        for lora, out in zip(LORAS, generated):
            assert out["output_ids"] == hf_reference(prompt, lora)[1], lora
        for lora in ADAPTERS:
            completion = serving.post_json(
                f"http://127.0.0.1:{port}/v1/completions",
                {"model": f"tiny-llama:{lora}", "prompt": prompt, "max_tokens": MAX_NEW_TOKENS,
                 "temperature": 0.0, "ignore_eos": True},
            )
            assert completion["choices"][0]["text"] == tokenizer.decode(hf_reference(prompt, lora)[1]), lora
    assert proc.returncode is not None
    assert not port_is_open(port)
    leftover = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert leftover == [], f"server processes left behind: {leftover}"
    assert not [path for path in mapped if path.exists()], "the server's /dev/shm file is still there"


def test_engine_refuses_intel_xpu_on_cpu_without_portable_kernels(tiny_artifacts, monkeypatch):
    import sglang

    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    monkeypatch.delenv("SGLANG_XPU_LORA_KERNELS", raising=False)
    monkeypatch.delenv(kernel_emulator.BUILD_ENV, raising=False)
    with pytest.raises(ValueError, match="--lora-backend intel_xpu requires --device xpu, got --device cpu"):
        sglang.Engine(**serving.engine_kwargs(tiny_artifacts, ADAPTERS))
