"""Reading an SGLang base model's module shapes for the adapter checks: fused q/k/v and gate/up split
into PEFT's modules at their unsharded sizes, LoRA-wrapped layers read through the wrapper, a tied
lm_head, and PEFT keys whose prefix differs from the serving model's."""

from __future__ import annotations

import torch

from sglang_xpu_lora.adapters.tensor_checks import sglang_module_dims


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
