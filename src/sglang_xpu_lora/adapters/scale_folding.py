"""One scale and one rank per adapter, exactly as PEFT computes each module.

PEFT scales module ``m``'s update by ``s_m = alpha_m / r_m`` (``alpha_m / sqrt(r_m)`` with
``use_rslora``; ``peft/tuners/lora/layer.py``, ``LoraLayer.update_layer``), with ``r_m`` and
``alpha_m`` from ``rank_pattern`` / ``alpha_pattern`` where a key matches and ``r`` / ``lora_alpha``
otherwise. SGLang serves one scale per adapter (``LoRAAdapter.scaling``, applied in the expand /
LoRA-B stage) and one rank (``config.r``). So the adapter is served at

* the scale of its default modules, ``s_0 = lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA), or 1
  when that is 0; every module whose ``s_m`` differs gets ``B_m <- B_m * (s_m / s_0)``
  (computed in float32, stored in B's dtype), so ``s_0 * B'_m A_m x = s_m * B_m A_m x``;
* the largest module rank ``R``; a module of rank ``r_m < R`` gets ``R - r_m`` zero rows in A and
  zero columns in B, which add nothing to ``B A x``.
"""

from __future__ import annotations

import math
from typing import MutableMapping

import torch

from sglang_xpu_lora.adapters.config_checks import AdapterPlan
from sglang_xpu_lora.adapters.tensor_checks import split_tensor_name


def module_scale(plan: AdapterPlan, module_key: str) -> float:
    """PEFT's scale for ``module_key``: ``alpha_m / r_m``, or ``alpha_m / sqrt(r_m)`` with rsLoRA."""
    rank, alpha = plan.module_rank(module_key), plan.module_alpha(module_key)
    return alpha / math.sqrt(rank) if plan.use_rslora else alpha / rank


def served_scale(plan: AdapterPlan) -> float:
    """The one scale the adapter is served at (``LoRAAdapter.scaling``): the default modules'
    scale, or 1.0 when that is 0 (so modules with a nonzero ``alpha_pattern`` can still be folded)."""
    default = plan.lora_alpha / math.sqrt(plan.r) if plan.use_rslora else plan.lora_alpha / plan.r
    return default if default != 0.0 else 1.0


@torch.no_grad()
def fold_and_pad(plan: AdapterPlan, weights: MutableMapping[str, torch.Tensor]) -> list[str]:
    """Rewrite one weight dict of the adapter (a layer's ``weights`` or ``embedding_layers``) in
    place so it is served at :func:`served_scale` and ``plan.served_rank``: fold each module's
    scale ratio into its LoRA-B and zero-pad its rank (A along dim -2, B along dim -1).

    Returns the names of the tensors it changed (a plain adapter changes none).
    """
    scale, rank = served_scale(plan), plan.served_rank
    changed = []
    for name in list(weights):
        parsed = split_tensor_name(name)
        if parsed is None:
            continue
        key, factor = parsed
        tensor = weights[name]
        new = tensor
        ratio = module_scale(plan, key) / scale
        if factor == "B" and ratio != 1.0:
            new = (new.to(torch.float32) * ratio).to(tensor.dtype)
        missing = rank - tensor.shape[-2 if factor == "A" else -1]
        if missing > 0:
            pad = (0, 0, 0, missing) if factor == "A" else (0, missing)
            new = torch.nn.functional.pad(new, pad)
        if new is not tensor:
            weights[name] = new.contiguous()
            changed.append(name)
    return changed
