"""Adapter modules the served model does not apply LoRA to, refused at load naming the model and
the module.

Models that compute their logits from the input embedding (Gemma and the others of
:data:`~sglang_xpu_lora.upstream.targets.EMBEDDING_AS_LM_HEAD`) hand ``model.embed_tokens`` to
SGLang's logits processor as the lm_head. An ``embed_tokens`` adapter is served as PEFT computes it
(:mod:`sglang_xpu_lora.patches.embedding_logits` keeps the logits on the base embedding, as PEFT's
tied lm_head does). LoRA on ``lm_head`` is not: SGLang's LoRA ``lm_head`` layer is never the module
these models compute their logits with (Gemma has no ``lm_head`` for SGLang to wrap; Gemma 3 gets
one that its forward does not use), so it would be dropped silently while PEFT applies it.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

from sglang_xpu_lora.adapters import AdapterRejected
from sglang_xpu_lora.adapters.tensor_checks import split_tensor_name
from sglang_xpu_lora.upstream import targets


def embedding_logits_architecture(architectures: Iterable[str], tie_word_embeddings: bool) -> Optional[str]:
    """The first of ``architectures`` (SGLang model class names, as ``config.json`` lists them) that
    computes its logits from the input embedding with these ``tie_word_embeddings``, or None."""
    for architecture in architectures:
        tied_only = targets.EMBEDDING_AS_LM_HEAD.get(architecture)
        if tied_only is not None and (tie_word_embeddings or not tied_only):
            return architecture
    return None


def _ties_word_embeddings(config: Any) -> bool:
    """The ``tie_word_embeddings`` of a transformers config's text config, which SGLang's models
    read (True when unset, transformers' default)."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text_config, "tie_word_embeddings", True))


def hf_config_embedding_logits(config: Any) -> Optional[str]:
    """:func:`embedding_logits_architecture` for a transformers config (``architectures`` and the
    text config's ``tie_word_embeddings``)."""
    return embedding_logits_architecture(config.architectures or (), _ties_word_embeddings(config))


def served_model_embedding_logits(base_model: Any, hf_config: Any) -> Optional[str]:
    """:func:`embedding_logits_architecture` for a model SGLang serves: its class (the architecture
    SGLang serves it as) and its transformers config ``hf_config`` (tied or not as its text config
    says)."""
    return embedding_logits_architecture([type(base_model).__name__], _ties_word_embeddings(hf_config))


def check_served_modules(adapter_name: str, modules: Iterable[str], embedding_logits: Optional[str]) -> None:
    """Refuse LoRA on ``lm_head`` for a model that computes its logits from the input embedding.

    ``modules``: the modules the adapter targets (``target_modules`` names, or PEFT module keys
    such as ``lm_head``; see :func:`lora_modules` for tensor names); ``embedding_logits``: the
    model's architecture when it computes its logits from the input embedding (see
    :func:`embedding_logits_architecture`), else None (nothing is refused).

    Raises:
        AdapterRejected: naming the adapter, the module and the architecture.
    """
    if embedding_logits is None:
        return
    for module in modules:
        if module.rpartition(".")[2] == "lm_head":
            raise AdapterRejected(
                f"LoRA adapter {adapter_name!r} cannot be served: it has LoRA on {module}, but {embedding_logits} "
                "computes its logits from its input embedding (embed_tokens, tied), where SGLang applies no lm_head "
                "LoRA; train the adapter without lm_head in target_modules (LoRA on embed_tokens is served), or "
                "merge it into the base model (PeftModel.merge_and_unload) and serve that"
            )


def lora_modules(tensor_names: Iterable[str]) -> list[str]:
    """The PEFT module keys that ``tensor_names`` hold LoRA factors for (``lm_head``,
    ``model.layers.0.self_attn.q_proj``, ...)."""
    return [parsed[0] for parsed in map(split_tensor_name, tensor_names) if parsed is not None]
