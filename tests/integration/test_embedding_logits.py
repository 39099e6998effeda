"""Models that compute their logits from the input embedding (issue 17 item 2): the table of them
(``targets.EMBEDDING_AS_LM_HEAD``) is what SGLang 0.5.23's model sources say, read by AST; LoRA on
``lm_head`` is refused for them, at argument validation too (the tiny Gemma's ``config.json``),
naming the architecture and the module, and served for the others. Served numbers through the real
engine: tests/e2e/test_embedding_lora_engine.py."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest
import torch

from sglang_cpu_devsupport import tiny_model
from sglang_xpu_lora.adapters import AdapterRejected
from sglang_xpu_lora.adapters.model_checks import (
    check_served_modules,
    embedding_logits_architecture,
    hf_config_embedding_logits,
    lora_modules,
)
from sglang_xpu_lora.adapters.tensor_checks import hf_local_config
from sglang_xpu_lora.patches.adapter_checks import check_local_adapter
from sglang_xpu_lora.upstream import targets

#: A PEFT adapter with LoRA on the tiny Gemma's lm_head (and q_proj).
GEMMA_HEAD = tiny_model.AdapterSpec("gemma-head-r8", rank=8, alpha=16, target_modules=("lm_head", "q_proj"), seed=33)


def _mentions_embedding(node: ast.AST, names: set[str]) -> bool:
    return any(
        (isinstance(n, ast.Attribute) and n.attr == "embed_tokens") or (isinstance(n, ast.Name) and n.id in names)
        for n in ast.walk(node)
    )


def _embedding_heads(cls: ast.ClassDef):
    """For each ``*.logits_processor(...)`` call in ``cls`` whose lm_head is built from
    ``embed_tokens``: whether it is ``embed_tokens`` itself (always) rather than a local name or a
    conditional (sometimes)."""
    for function in (f for f in cls.body if isinstance(f, ast.FunctionDef)):
        nodes = list(ast.walk(function))
        local = {
            n.targets[0].id
            for n in nodes
            if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
            and _mentions_embedding(n.value, set())
        }
        for call in nodes:
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "logits_processor":
                head = call.args[2] if len(call.args) > 2 else next((k.value for k in call.keywords if k.arg == "lm_head"), None)
                if head is not None and _mentions_embedding(head, local):
                    yield isinstance(head, ast.Attribute) and head.attr == "embed_tokens"


def scan_sglang_models() -> dict[str, bool]:
    """SGLang model classes whose logits processor gets the input embedding as lm_head -> whether
    only sometimes (the argument chooses: a local name or a conditional; else always). A class
    counts when one of its methods calls ``*.logits_processor(...)`` with an lm_head built from
    ``embed_tokens``, when it derives from such a class and keeps its forward (or calls
    ``super().forward``), or when it constructs one (a wrapper around a language model). Only
    files that name what is looked for are parsed."""
    root = Path(importlib.util.find_spec("sglang.srt.models").submodule_search_locations[0])
    texts = {path: path.read_text(encoding="utf-8") for path in sorted(root.rglob("*.py"))}
    trees: dict[Path, list[ast.ClassDef]] = {}

    def classes(path):
        if path not in trees:
            trees[path] = [n for n in ast.parse(texts[path]).body if isinstance(n, ast.ClassDef)]
        return trees[path]

    found: dict[str, bool] = {}
    for path, text in texts.items():
        if "logits_processor(" in text and "embed_tokens" in text:
            for cls in classes(path):
                heads = list(_embedding_heads(cls))
                if heads:
                    found[cls.name] = not all(heads)
    while True:
        added = {}
        for path, text in texts.items():
            if not any(name in text for name in found):
                continue
            for cls in classes(path):
                if cls.name in found or cls.name in added:
                    continue
                forward = next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "forward"), None)
                keeps_forward = forward is None or "super().forward" in ast.unparse(forward)
                bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in cls.bases] if keeps_forward else []
                built = [n.func.id for n in ast.walk(cls) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
                source = next((name for name in bases + built if name in found), None)
                if source is not None:
                    added[cls.name] = found[source]
        if not added:
            return found
        found.update(added)


def test_the_table_is_what_sglangs_model_sources_say():
    """Every SGLang 0.5.23 model that hands embed_tokens to its logits processor is in the table,
    with whether that depends on tied embeddings; a new one in an SGLang upgrade fails here."""
    assert scan_sglang_models() == targets.EMBEDDING_AS_LM_HEAD


@pytest.mark.parametrize(
    "architectures, tied, expected",
    [
        (["GemmaForCausalLM"], True, "GemmaForCausalLM"),
        (["Gemma3ForConditionalGeneration"], True, "Gemma3ForConditionalGeneration"),
        (["MiniCPMForCausalLM"], True, "MiniCPMForCausalLM"),
        (["MiniCPMForCausalLM"], False, None),  # its own lm_head: LoRA on it is served
        (["LlamaForCausalLM"], True, None),  # a tied Llama's logits processor gets a ParallelLMHead
        ([], True, None),
    ],
)
def test_which_models_compute_logits_from_the_embedding(architectures, tied, expected):
    assert embedding_logits_architecture(architectures, tied) == expected


def test_lm_head_lora_is_refused_naming_architecture_and_module():
    names = ["base_model.model.model.embed_tokens.lora_embedding_A", "base_model.model.lm_head.lora_A.weight"]
    assert lora_modules(names) == ["model.embed_tokens", "lm_head"]
    for modules in (lora_modules(names), ["embed_tokens", "lm_head"]):  # from tensors, from target_modules
        with pytest.raises(AdapterRejected) as refused:
            check_served_modules("head", modules, "GemmaForCausalLM")
        message = str(refused.value)
        assert "'head'" in message and "LoRA on lm_head" in message and "GemmaForCausalLM computes its logits from its input embedding" in message
    check_served_modules("head", lora_modules(names), None)  # another model: served
    check_served_modules("emb", lora_modules(names[:1]), "GemmaForCausalLM")  # embed_tokens alone: served


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return tiny_model.build_all(
        tmp_path_factory.mktemp("gemma"), adapters=(GEMMA_HEAD, *tiny_model.DEFAULT_ADAPTERS[2:]), architecture="gemma"
    )


def test_argument_validation_refuses_lm_head_lora_on_the_tiny_gemma(gemma, tiny_artifacts):
    """As ``--lora-paths`` are checked before the model loads: from the base's config.json."""
    architecture = hf_config_embedding_logits(hf_local_config(str(gemma["base"])))
    assert architecture == "GemmaForCausalLM"
    with pytest.raises(AdapterRejected, match=r"'gemma-head-r8' cannot be served: it has LoRA on lm_head, but GemmaForCausalLM"):
        check_local_adapter("gemma-head-r8", gemma[GEMMA_HEAD.name], 32, None, architecture)
    check_local_adapter("qv-r4", gemma["qv-r4"], 32, None, architecture)
    assert hf_config_embedding_logits(hf_local_config(str(tiny_artifacts["base"]))) is None  # the tiny Llama: untied
    check_local_adapter("emb-head-r8", tiny_artifacts["emb-head-r8"], 32, None, None)


@pytest.mark.parametrize(
    "backend, checks, unwrapped",
    [("intel_xpu", "plugin", True), ("torch_native", "plugin", False), ("torch_native", "all", True)],
)
def test_the_logits_head_is_the_base_embedding_for_backends_in_scope(backend, checks, unwrapped, sglang_plugins_loaded, monkeypatch):
    """The logits processor gets the base embedding instead of its LoRA wrapper where the adapter
    checks apply (SGLang's own backends keep upstream behaviour unless opted in)."""
    import types

    from sglang.srt.lora.layers import VocabParallelEmbeddingWithLoRA

    from sglang_xpu_lora.patches.embedding_logits import logits_head
    from sglang_xpu_lora.settings import ADAPTER_CHECKS_ENV

    wrapper = VocabParallelEmbeddingWithLoRA.__new__(VocabParallelEmbeddingWithLoRA)
    torch.nn.Module.__init__(wrapper)
    wrapper.base_layer, wrapper.lora_backend = torch.nn.Identity(), types.SimpleNamespace(name=backend)
    monkeypatch.setenv(ADAPTER_CHECKS_ENV, checks)
    assert (logits_head(wrapper) is wrapper.base_layer) is unwrapped
    assert logits_head(wrapper.base_layer) is wrapper.base_layer


@pytest.mark.parametrize("target_modules", [["lm_head", "q_proj"], r"(lm_head|.*\.q_proj)"])
def test_lm_head_lora_is_refused_when_it_loads_on_gemma(target_modules):
    """At run time, before any tensor is read: from the target list, and from a regular expression
    that selects lm_head (Gemma has no lm_head module to resolve it against)."""
    import types

    from sglang_xpu_lora.patches.adapter_checks import plan_adapter

    class GemmaForCausalLM(torch.nn.Module):  # only the class name and no lm_head matter here
        pass

    manager = types.SimpleNamespace(
        base_model=GemmaForCausalLM(), base_hf_config=types.SimpleNamespace(tie_word_embeddings=True),
        memory_pool=types.SimpleNamespace(max_lora_rank=32),
    )
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": target_modules}
    lora_config = types.SimpleNamespace(hf_config=config, target_modules=target_modules, r=8)
    with pytest.raises(AdapterRejected, match=r"'head' cannot be served: it has LoRA on lm_head, but GemmaForCausalLM"):
        plan_adapter(manager, lora_config, types.SimpleNamespace(lora_name="head"))
