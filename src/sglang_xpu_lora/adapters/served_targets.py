"""What SGLang 0.5.23 wraps for LoRA target modules, decided from the model's config and the
adapters' files before the model loads.

* :func:`lora_capable_modules`: the normalized target modules SGLang's LoRA can serve at all, its
  own ``sglang.srt.lora.utils._KNOWN_LORA_TARGET_MODULES`` (what its memory pool, its hidden-size
  lookup and its layer wrapping handle; ``auto_detect_lora_target_modules`` intersects every model's
  modules, and a model's ``supported_lora_modules``, with it). GPT-2's ``c_attn``, ``c_proj`` and
  ``c_fc`` exist in the model but are not among them.
* :func:`expert_lora_refusal`: SGLang's ``LoRAManager.init_lora_modules`` wraps every ``FusedMoE``
  layer (the routed experts) when its target modules hold both :data:`MOE_TARGETS`, whatever
  modules the adapters trained: a Qwen2-MoE adapter on the dense shared expert only
  (``gate_proj``, ``up_proj``, ``down_proj``) or a Qwen3-MoE adapter whose ``gate_proj`` ...
  matched nothing (the experts are fused parameters in transformers) gets the experts wrapped all
  the same. That MoE LoRA runs in SGLang's Triton kernels (``sglang.kernels.ops.lora.moe``), for
  every LoRA backend, so it cannot run where Triton does not.

The routed experts of a transformers MoE model are its ``experts`` modules (``mlp.experts``, whose
``gate_up_proj`` / ``down_proj`` are parameters), read on the model built on the ``meta`` device.
"""

from __future__ import annotations

import re
from typing import Iterable, Optional, Sequence

from sglang_xpu_lora.upstream import targets
from sglang_xpu_lora.upstream.compat import TESTED_SGLANG, resolve

#: SGLang's normalized target modules that, both present, put LoRA on every ``FusedMoE`` layer.
MOE_TARGETS = ("gate_up_proj", "down_proj")
#: Module names that SGLang normalizes to :data:`MOE_TARGETS`.
MOE_TARGET_NAMES = ("gate_proj", "up_proj", "gate_up_proj", "down_proj")
_LAYER_INDEX = re.compile(r"\.\d+\.")


def lora_capable_modules() -> frozenset[str]:
    """SGLang's ``_KNOWN_LORA_TARGET_MODULES``: the normalized target modules its LoRA serves."""
    return frozenset(resolve(targets.KNOWN_LORA_TARGET_MODULES))


def routed_experts(module_names: Iterable[str]) -> list[str]:
    """The routed-expert modules among a transformers model's module names (``experts`` modules,
    e.g. ``model.layers.0.mlp.experts``), sorted."""
    return sorted(name for name in module_names if name.rpartition(".")[2] == "experts")


def dense_homes(module_names: Iterable[str]) -> list[str]:
    """Where a model's dense modules named as :data:`MOE_TARGET_NAMES` live outside the routed
    experts, per layer (``mlp.shared_expert`` for Qwen2-MoE), sorted; empty for Qwen3-MoE."""
    homes = set()
    for name in module_names:
        parent, _, leaf = name.rpartition(".")
        if leaf in MOE_TARGET_NAMES and ".experts" not in f".{parent}":
            homes.add(_LAYER_INDEX.split(parent)[-1])
    return sorted(homes)


def wraps_experts(normalized: Iterable[str]) -> bool:
    """Whether SGLang wraps the routed experts for these normalized target modules (``all``: SGLang
    resolves it against the model, and an MoE model's modules include :data:`MOE_TARGETS`)."""
    names = set(normalized)
    return "all" in names or set(MOE_TARGETS) <= names


def expert_lora_refusal(
    sources: Sequence[tuple[str, Sequence[str], frozenset[str]]],
    module_names: Iterable[str],
    device: Optional[str],
    triton: tuple[bool, str],
) -> Optional[str]:
    """Why the server's LoRA target modules cannot be served on ``device`` because SGLang would put
    LoRA on the model's routed experts there, or None.

    :param sources: where the server's target modules come from, each ``(label, target_modules as
        given, normalized)``: ``--lora-target-modules`` alone when given (SGLang builds the pool for
        it), else one per adapter (``adapter 'name'``); SGLang serves their union.
    :param module_names: the base model's module and parameter names (transformers, ``meta``).
    :param device: the serving device (``--device``, resolved).
    :param triton: :func:`~sglang_xpu_lora.providers.triton_ops.triton_support` of ``device``.
    """
    names = list(module_names)
    experts = routed_experts(names)
    union = set().union(*(normalized for _, _, normalized in sources))
    if triton[0] or not experts or not wraps_experts(union):
        return None
    named = [
        f"{label} names {given!r}" if isinstance(given, str) else f"{label} names {sorted(given)}"
        for label, given, normalized in sources
        if "all" in normalized or set(MOE_TARGETS) & normalized
    ]
    homes = dense_homes(names)
    trained = (
        f"in this model those names are the dense {', '.join(homes)} modules, which hold the "
        "adapter's weights, "
        if homes else "this model has no such modules outside the routed experts, "
    )
    return (
        f"LoRA on {device} cannot serve these target modules: {'; '.join(named)}. SGLang {TESTED_SGLANG} "
        "reads gate_proj/up_proj (gate_up_proj) and down_proj as LoRA targets of the routed experts "
        f"too and wraps every MoE layer's experts ({experts[0]}, ...) when both are targeted; "
        f"{trained}but the experts are wrapped all the same, and SGLang runs LoRA on experts only in "
        "its Triton MoE-LoRA kernels (sglang.kernels.ops.lora.moe), whatever --lora-backend, while "
        f"{triton[1]}. Serve on a device where Triton runs (--device xpu), leave gate_proj and "
        "up_proj, or down_proj, out of the target modules (--lora-target-modules, or train the "
        "adapter without them), or merge the adapter into the base model "
        "(PeftModel.merge_and_unload) and serve that"
    )
