"""PEFT LoRA adapters served exactly as PEFT computes them, or refused at load with a reason.

SGLang 0.5.23 reads ``r``, ``lora_alpha`` and ``target_modules`` from ``adapter_config.json`` and
ignores the rest. For adapters served by this plugin's backends (and, with
``SGLANG_XPU_LORA_ADAPTER_CHECKS=all``, by SGLang's own), :mod:`sglang_xpu_lora.patches.adapter_checks`
runs, before any memory-pool slot is touched:

* :mod:`.adapter_files`: a local adapter path (not a Hub id) must be a directory with
  ``adapter_config.json`` and weights; tokens added to the vocabulary are refused.
* :mod:`.config_checks`: every field of PEFT's ``LoraConfig`` is honoured or refused, naming the
  adapter, the field and what to do; the result is an :class:`~.config_checks.AdapterPlan`; each
  listed target module must be one the base model has (and the memory pool serves).
* :mod:`.tensor_checks`: each tensor is finite and has the shape the base model expects (the
  unsharded shape SGLang's TP slicers cut per rank); q/k/v or gate/up slices an adapter does not
  target are added as zeros.
* :mod:`.scale_folding`: per-module scale differences (``use_rslora``, ``alpha_pattern``) are folded
  into LoRA-B and per-module ranks (``rank_pattern``) are zero-padded, so the adapter is served
  with one scale and one rank.

Which adapters this covers is decided by :mod:`.checked_backends`. The user-facing summary is
``docs/peft-adapters.md``.
"""

from __future__ import annotations


class AdapterRejected(ValueError):
    """An adapter that cannot be served exactly; the message names the adapter, the field or tensor,
    and what to do. A ``ValueError`` so SGLang reports it as a failed load (HTTP 400) and an
    argument-validation error at start-up."""


__all__ = ["AdapterRejected"]
