"""LoRA math SGLang 0.5.23 runs itself, outside any LoRA backend's ``run_*`` methods.

``IntelXpuLoRABackend`` computes every dense LoRA projection SGLang hands it (attention and MLP
projections, embedding, lm_head) with the provider ``SGLANG_XPU_LORA_KERNELS`` selects. Two kinds
of LoRA never reach it:

* **MoE experts** (``gate_up_proj`` / ``down_proj`` of ``FusedMoE`` layers): ``FusedMoEWithLoRA``
  reads only the batch metadata from the backend and runs SGLang's Triton MoE-LoRA kernels
  (``sglang.kernels.ops.lora.moe``) inside the MoE runner, with LoRA-B pre-scaled in the pool.
* **Absorbed-MLA ``kv_b_proj``** (DeepSeek-V2/V3 style attention): the absorbed path never calls
  ``kv_b_proj.forward``; ``sglang.srt.lora.deepseek_mla_correction`` adds the LoRA delta with
  SGLang's Triton kernels (``kv_b_lora_absorbed``), reading the backend's ``_sgemm_info()``.

Both need Triton (XPU and CUDA builds of PyTorch have it; the CPU does not, unless
``TRITON_INTERPRET=1``). :func:`outside_lora_math` names them for a model and its LoRA targets;
``IntelXpuLoRABackend.validate_lora_targets`` logs them, and refuses them where Triton cannot run
(the routed experts are refused before the model loads already, from the model's config and the
adapters' files: :mod:`sglang_xpu_lora.adapters.served_targets`; this is the check after the load,
for what argument validation could not see, such as adapters named by a Hub id).
"""

from __future__ import annotations

import torch

from sglang_xpu_lora.adapters.served_targets import MOE_TARGETS
from sglang_xpu_lora.upstream import targets
from sglang_xpu_lora.upstream.compat import resolve


def outside_lora_math(base_model: torch.nn.Module, target_modules: set) -> list[str]:
    """What of ``target_modules`` on ``base_model`` SGLang computes outside the LoRA backend.

    :param base_model: the model SGLang wraps (``LoRAManager.base_model``).
    :param target_modules: SGLang's normalised LoRA target names (``qkv_proj``, ``kv_b_proj``...).
    :returns: one sentence per kind found (empty when the backend computes all of it).
    """
    fused_moe = resolve(targets.FUSED_MOE)
    found = []
    modules = list(base_model.modules())
    if all(t in target_modules for t in MOE_TARGETS) and any(isinstance(m, fused_moe) for m in modules):
        found.append(
            "LoRA on MoE experts (SGLang wraps the routed experts of every FusedMoE layer when the target "
            "modules include gate_up_proj and down_proj, whatever modules the adapters trained) runs in "
            "SGLang's Triton MoE-LoRA kernels (sglang.kernels.ops.lora.moe)"
        )
    if "kv_b_proj" in target_modules and any(hasattr(m, "kv_b_proj") and hasattr(m, "w_kc") for m in modules):
        found.append(
            "the absorbed-MLA kv_b_proj LoRA correction runs in SGLang's Triton kernels "
            "(sglang.srt.lora.deepseek_mla_correction)"
        )
    return found
