"""Reading an SGLang base model's module shapes for the adapter checks: fused q/k/v and gate/up split
into PEFT's modules at their unsharded sizes, LoRA-wrapped layers read through the wrapper, a tied
lm_head, and PEFT keys whose prefix differs from the serving model's; a wrong-shaped tensor refused
naming the model dimension that differs."""

from __future__ import annotations

import pytest
import torch

from sglang_xpu_lora.adapters import AdapterRejected
from sglang_xpu_lora.adapters.config_checks import check_adapter_config
from sglang_xpu_lora.adapters.tensor_checks import check_tensors, sglang_module_dims


class Layer(torch.nn.Module):
    """A stand-in for an SGLang linear layer: only the size attributes the checks read."""

    def __init__(self, **sizes):
        super().__init__()
        self.__dict__.update(sizes)


class LoRAWrapper(torch.nn.Module):
    def __init__(self, base_layer):
        super().__init__()
        self.base_layer = base_layer


def vocab_embedding(vocab, hidden):
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding

    embedding = VocabParallelEmbedding.__new__(VocabParallelEmbedding)
    torch.nn.Module.__init__(embedding)
    embedding.org_vocab_size, embedding.embedding_dim = vocab, hidden
    return embedding


def tiny_vl_model():
    """``language_model.model.layers.0`` with a TP-4 style QKV (per-rank ``output_sizes`` that do not
    add up to the full K/V width when KV heads are replicated), wrapped o_proj, tied lm_head."""
    root, lm, inner = torch.nn.Module(), torch.nn.Module(), torch.nn.Module()
    layer, attn, mlp = torch.nn.Module(), torch.nn.Module(), torch.nn.Module()
    attn.qkv_proj = Layer(total_num_heads=8, total_num_kv_heads=2, head_size=16, v_head_size=16, hidden_size=128, output_sizes=[128, 64, 64])
    attn.o_proj = LoRAWrapper(Layer(input_size=128, output_size=128))
    mlp.gate_up_proj = Layer(output_sizes=[256, 256], input_size=128)
    layer.self_attn, layer.mlp = attn, mlp
    inner.embed_tokens, inner.layers = vocab_embedding(1024, 128), torch.nn.ModuleList([layer])
    lm.model = inner
    root.language_model, root.lm_head = lm, inner.embed_tokens
    return root


def test_fused_modules_split_at_unsharded_sizes_and_prefixes_fall_back():
    dims, fused, keys = sglang_module_dims(tiny_vl_model())
    assert fused == {"qkv_proj", "gate_up_proj"}
    assert dims("language_model.model.layers.0.self_attn.q_proj") == (128, 128)
    assert dims("model.language_model.layers.0.self_attn.k_proj") == (32, 128)  # total KV heads, not per-rank sizes
    assert dims("model.layers.0.self_attn.qkv_proj") == (192, 128)  # an adapter saved already stacked
    assert dims("model.layers.0.mlp.up_proj") == (256, 128)
    assert dims("model.layers.0.self_attn.o_proj") == (128, 128)  # through the LoRA wrapper
    assert dims("model.embed_tokens") == (128, 1024)  # A (r, vocab), B (hidden, r)
    assert dims("lm_head") == (1024, 128)  # tied to embed_tokens
    assert dims("model.layers.1.self_attn.q_proj") is None and dims("model.layers.0.self_attn.w_proj") is None
    assert "language_model.model.layers.0.self_attn.v_proj" in keys and not any(k.endswith(("qkv_proj", "base_layer")) for k in keys)


# The base model of the refusal tests: hidden 128, 4 heads and 2 key/value heads of 32, intermediate
# 256, vocabulary 1024 (module key -> (out_features, in_features), as sglang_module_dims reads them).
BASE_DIMS = {
    "model.embed_tokens": (128, 1024),
    "lm_head": (1024, 128),
    "model.layers.0.self_attn.q_proj": (128, 128),
    "model.layers.0.self_attn.k_proj": (64, 128),
    "model.layers.0.self_attn.o_proj": (128, 128),
    "model.layers.0.mlp.gate_proj": (256, 128),
    "model.layers.0.mlp.down_proj": (128, 256),
    "model.layers.0.mixer.in_proj": (512, 128),
}


#: (module key, factor, wrong shape, what the refusal must say).
WRONG_SHAPES = [
    ("model.embed_tokens", "A", (8, 1030), "the vocabulary size differs, 1030 in the adapter and 1024 in the base model; the adapter was trained with a resized vocabulary"),
    ("lm_head", "B", (1030, 8), "the vocabulary size differs, 1030 in the adapter and 1024 in the base model; the adapter was trained with a resized vocabulary"),
    ("model.embed_tokens", "B", (64, 8), "the hidden size differs, 64 in the adapter and 128 in the base model; the adapter was trained for another model"),
    ("lm_head", "A", (8, 64), "the hidden size differs, 64 in the adapter and 128"),
    ("model.layers.0.self_attn.q_proj", "A", (8, 64), "the hidden size differs, 64 in the adapter and 128"),
    ("model.layers.0.self_attn.q_proj", "B", (256, 8), "the query width (attention heads x head dim) differs, 256 in the adapter and 128"),
    ("model.layers.0.self_attn.k_proj", "B", (32, 8), "the key width (key/value heads x head dim) differs, 32 in the adapter and 64"),
    ("model.layers.0.self_attn.o_proj", "A", (8, 256), "the attention width (attention heads x head dim) differs, 256 in the adapter and 128"),
    ("model.layers.0.mlp.gate_proj", "B", (512, 8), "the intermediate size differs, 512 in the adapter and 256"),
    ("model.layers.0.mlp.down_proj", "A", (8, 512), "the intermediate size differs, 512 in the adapter and 256"),
    ("model.layers.0.mlp.down_proj", "B", (64, 8), "the hidden size differs, 64 in the adapter and 128"),
    ("model.layers.0.mixer.in_proj", "B", (256, 8), "the output size of in_proj differs, 256 in the adapter and 512"),
    ("model.layers.0.self_attn.q_proj", "A", (2, 8, 128), "it has 3 dimensions where a LoRA factor has 2"),
]


@pytest.mark.parametrize("key, factor, shape, named", WRONG_SHAPES, ids=[f"{k.rpartition('.')[2]}-{f}" for k, f, _, _ in WRONG_SHAPES])
def test_shape_refusal_names_the_dimension_that_differs(key, factor, shape, named):
    """A wrong-shaped factor is refused naming the tensor, both shapes and the model dimension
    that differs (not "hidden size or head count" for a vocabulary)."""
    tensors = {f"base_model.model.{key}.{'lora_embedding_' + factor if key.endswith('embed_tokens') else 'lora_' + factor + '.weight'}": torch.zeros(shape)}
    partner = "B" if factor == "A" else "A"
    out_features, in_features = BASE_DIMS[key]
    good = torch.zeros(8, in_features) if partner == "A" else torch.zeros(out_features, 8)
    tensors[next(iter(tensors)).replace(f"_{factor}", f"_{partner}")] = good
    plan = check_adapter_config("resized", {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": [key.rpartition(".")[2]]})
    with pytest.raises(AdapterRejected) as refused:
        check_tensors(plan, tensors.items(), BASE_DIMS.get)
    message = str(refused.value)
    assert f"{next(iter(tensors))!r} has shape {shape}" in message, message
    assert named in message, message
    assert "head count differ" not in message


def test_lora_tensors_of_the_base_shape_pass():
    tensors = {"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 128), "base_model.model.lm_head.lora_B.weight": torch.zeros(1024, 8)}
    plan = check_adapter_config("fits", {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["lm_head"]})
    check_tensors(plan, tensors.items(), BASE_DIMS.get)
