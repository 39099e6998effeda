"""Embedding and lm_head LoRA through the real engine (issue 17 items 2 and 3; intel_xpu, portable
kernels, CPU, float32).

A tiny Gemma (tied word embeddings: SGLang's Gemma hands ``embed_tokens`` to the logits processor as
its lm_head) serving an ``embed_tokens`` adapter next to a q/v adapter and the base model: every
request's first-token log-probs within 1e-5 of transformers + PEFT and 16 identical greedy tokens
(the engine died on its first batch before); an lm_head adapter is refused at load naming the
architecture and the module, and the engine keeps serving, an embedding adapter from bfloat16 files
included.

Half-precision files: PEFT saves a copy of the base ``embed_tokens`` / ``lm_head`` next to their
LoRA factors (``save_embedding_layers``) in the file's dtype, and loads that copy over the base
model's own weights. The engine serves the base model's weights (multi-LoRA shares one base), so the
reference for fp16/bf16 adapters is PEFT on the same factors with the base model's own embedding and
lm_head: within 1e-5. PEFT with the rounded copies differs by more than 1e-4 (the cause issue 17
item 3 measured, documented in docs/peft-adapters.md).
"""

from __future__ import annotations

import functools
import shutil

import pytest

from sglang_cpu_devsupport import serving, tiny_model

pytestmark = pytest.mark.e2e

TOLERANCE = 1e-5
PROMPT = "def main(self):"
GEMMA_ADAPTERS = (
    tiny_model.AdapterSpec("gemma-emb", rank=8, alpha=16, target_modules=("embed_tokens", "q_proj", "v_proj"), seed=31),
    tiny_model.AdapterSpec("gemma-qv", rank=8, alpha=16, target_modules=("q_proj", "v_proj"), seed=32),
    tiny_model.AdapterSpec("gemma-head", rank=8, alpha=16, target_modules=("lm_head", "q_proj"), seed=33),
)
EMB = tiny_model.EMBEDDING_ADAPTER.name


def half_precision_copy(source, out, dtype):
    """``source``'s adapter with every tensor (factors and the saved base copies) stored in ``dtype``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, out)
    tensors = load_file(out / "adapter_model.safetensors")
    save_file({name: tensor.to(dtype) for name, tensor in tensors.items()}, out / "adapter_model.safetensors")
    return out


def without_base_copies(source, out):
    """``source``'s adapter without the base ``embed_tokens`` / ``lm_head`` copies PEFT saved, so
    PEFT keeps the base model's own weights (what the engine serves)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, out)
    tensors = load_file(out / "adapter_model.safetensors")
    save_file({n: t for n, t in tensors.items() if not n.endswith("base_layer.weight")}, out / "adapter_model.safetensors")
    return out


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """The tiny Gemma, its adapters, and gemma-emb in bfloat16 (``gemma-emb-bf16``) with its
    reference copy (``gemma-emb-bf16-ref``)."""
    import torch

    root = tmp_path_factory.mktemp("gemma")
    paths = tiny_model.build_all(root, adapters=GEMMA_ADAPTERS, architecture="gemma")
    paths["gemma-emb-bf16"] = half_precision_copy(paths["gemma-emb"], root / "gemma-emb-bf16", torch.bfloat16)
    paths["gemma-emb-bf16-ref"] = without_base_copies(paths["gemma-emb-bf16"], root / "gemma-emb-bf16-ref")
    return paths


@pytest.fixture(scope="module")
def half_precision(tiny_artifacts, tmp_path_factory):
    """emb-head-r8 (embed_tokens, lm_head, q/v) in float16 and bfloat16, with reference copies."""
    import torch

    root = tmp_path_factory.mktemp("half")
    paths = dict(tiny_artifacts)
    for dtype in ("float16", "bfloat16"):
        name = f"{EMB}-{dtype}"
        paths[name] = half_precision_copy(tiny_artifacts[EMB], root / name, getattr(torch, dtype))
        paths[f"{name}-ref"] = without_base_copies(paths[name], root / f"{name}-ref")
    return paths


@functools.lru_cache(maxsize=None)
def reference(base, adapter, ids):
    return serving.hf_reference(base, adapter, ids, serving.GREEDY_TOKENS)


def assert_equals_peft(outputs, paths, reference_of=lambda lora: lora):
    """Each ``(prompt, lora) -> output`` against transformers + PEFT (``reference_of(lora)``'s files)."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(paths["base"])
    for (prompt, lora), out in outputs.items():
        ref_logprobs, ref_tokens = reference(paths["base"], paths[reference_of(lora)] if lora else None, tuple(tokenizer.encode(prompt)))
        delta = float((torch.tensor(out["first_logprobs"], dtype=torch.float64) - ref_logprobs).abs().max())
        assert delta <= TOLERANCE, f"{lora or 'base'}: max |Δ logprob| {delta:.2e}"
        assert out["output_ids"] == ref_tokens, lora or "base"


@pytest.fixture(scope="module")
def gemma_run(run_engine, gemma):
    batch = [(PROMPT, None), (PROMPT, "gemma-qv"), (PROMPT, "gemma-emb")]
    rounds = [
        batch,
        {"load": {"lora_name": "gemma-head", "lora_path": str(gemma["gemma-head"])}},
        {"load": {"lora_name": "gemma-emb-bf16", "lora_path": str(gemma["gemma-emb-bf16"])}},
        [(PROMPT, "gemma-emb-bf16"), (PROMPT, "gemma-emb"), (PROMPT, None)],
    ]
    results, _ = run_engine("gemma-embedding", rounds, serving.cpu_env("torch"), adapters=["gemma-emb", "gemma-qv"], artifacts=gemma)
    return results


def test_gemma_serves_an_embed_tokens_adapter_as_peft(gemma_run, gemma):
    """The first batch, base and q/v tenants included, is answered (it killed the engine before)."""
    assert_equals_peft(gemma_run[0], gemma)


def test_gemma_refuses_lm_head_lora_at_load_and_keeps_serving(gemma_run, gemma):
    refused, loaded, after = gemma_run[1:]
    assert not refused["success"]
    assert "'gemma-head'" in refused["error"] and "LoRA on lm_head, but GemmaForCausalLM computes its logits" in refused["error"], refused
    assert loaded["success"], loaded
    assert_equals_peft(after, gemma, reference_of=lambda lora: "gemma-emb-bf16-ref" if lora == "gemma-emb-bf16" else lora)


@pytest.fixture(scope="module")
def half_precision_run(run_engine, half_precision):
    names = [f"{EMB}-float16", f"{EMB}-bfloat16"]
    (outputs,), _ = run_engine(
        "half-precision-embeddings", [[(PROMPT, names[0]), (PROMPT, names[1]), (PROMPT, None)]],
        serving.cpu_env("torch"), adapters=names, artifacts=half_precision,
    )
    return outputs


def test_half_precision_embedding_and_lm_head_lora_at_the_float32_tolerance(half_precision_run, half_precision):
    assert_equals_peft(half_precision_run, half_precision, reference_of=lambda lora: f"{lora}-ref")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_peft_loads_the_rounded_base_copies_over_the_base_model(dtype, half_precision_run, half_precision):
    """Why PEFT's own numbers differ for these files: the base embedding and lm_head PEFT computes
    with are the adapter file's half-precision copies, not the base model's."""
    import torch
    from transformers import AutoTokenizer

    name = f"{EMB}-{dtype}"
    ids = tuple(AutoTokenizer.from_pretrained(half_precision["base"]).encode(PROMPT))
    with_copies, _ = reference(half_precision["base"], half_precision[name], ids)
    served = torch.tensor(half_precision_run[(PROMPT, name)]["first_logprobs"], dtype=torch.float64)
    assert float((served - with_copies).abs().max()) > 1e-4
