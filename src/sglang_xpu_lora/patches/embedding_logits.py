"""Target: sglang.srt.layers.logits_processor.LogitsProcessor.forward (AROUND)
Why: Gemma, Gemma 2/3/3n/4, Cohere (Command R), Cohere2-MoE and MiniCPM (1 and 3, tied) compute
    their logits from the input embedding: their ``forward`` hands ``model.embed_tokens`` to the
    logits processor as the lm_head (:data:`~sglang_xpu_lora.upstream.targets.EMBEDDING_AS_LM_HEAD`).
    Once an adapter targets ``embed_tokens``, LoRA wraps that module, and the logits processor calls
    the wrapper (it has ``set_lora``/``apply_lora``) on the hidden states: an embedding lookup of
    floats, ``IndexError: index out of range`` in ``F.embedding``, and the scheduler dies on its
    first batch, whoever the batch's tenants are (sglang #7554).
How: when the lm_head handed to the logits processor is an input embedding's LoRA wrapper
    (``VocabParallelEmbeddingWithLoRA``) of a backend the adapter checks cover
    (:mod:`sglang_xpu_lora.adapters.checked_backends`), the processor gets the wrapped base
    embedding instead. That is PEFT's computation: a tied lm_head reads the base embedding weight,
    and the embedding's LoRA applies to the input lookup only (PEFT wraps ``embed_tokens`` and
    leaves the tied ``lm_head`` a plain linear layer on the same weight). LoRA on ``lm_head`` of
    these models is refused at load (:mod:`sglang_xpu_lora.adapters.model_checks`): SGLang never
    applies it there.
Checked against: SGLang 0.5.23 (``LogitsProcessor.forward(input_ids, hidden_states, lm_head, ...)``;
    the compat guard checks the parameter).
Remove when: SGLang keeps the base embedding as the logits head of a model with tied embeddings when
    LoRA wraps ``embed_tokens`` (sglang #7554).
"""

from __future__ import annotations

from typing import Any

from sglang_xpu_lora.adapters import checked_backends
from sglang_xpu_lora.patches.undo import UndoStack, queue_hook
from sglang_xpu_lora.registry import LoRABackendRegistry
from sglang_xpu_lora.upstream import targets
from sglang_xpu_lora.upstream.compat import resolve

#: Position of ``lm_head`` in ``LogitsProcessor.forward(self, input_ids, hidden_states, lm_head, ...)``.
_LM_HEAD_POSITION = 3


def logits_head(lm_head: Any) -> Any:
    """The module the logits processor computes the logits with: ``lm_head``, or, when it is an
    input embedding's LoRA wrapper of a backend in scope, the embedding it wraps."""
    wrapper = resolve(targets.VOCAB_PARALLEL_EMBEDDING_WITH_LORA)
    if isinstance(lm_head, wrapper) and checked_backends.applies_to(lm_head.lora_backend.name):
        return lm_head.base_layer
    return lm_head


def apply(registry: LoRABackendRegistry, undo: UndoStack) -> None:
    def around_logits_forward(original, *args, **kwargs):
        if "lm_head" in kwargs:
            kwargs["lm_head"] = logits_head(kwargs["lm_head"])
        elif len(args) > _LM_HEAD_POSITION:
            args = (*args[:_LM_HEAD_POSITION], logits_head(args[_LM_HEAD_POSITION]), *args[_LM_HEAD_POSITION + 1:])
        return original(*args, **kwargs)

    queue_hook(targets.LOGITS_PROCESSOR_FORWARD, around_logits_forward, "AROUND", undo)
