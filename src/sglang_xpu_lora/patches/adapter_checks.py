"""Targets: sglang.srt.arg_groups.lora_hook.check_lora_server_args (AFTER),
    sglang.srt.lora.lora_manager.LoRAManager.validate_new_adapter (AROUND),
    sglang.srt.lora.lora_manager.LoRAManager._load_lora_adapter and
    ``_load_lora_adapter_from_tensors`` (AROUND), and
    sglang.srt.lora.lora.LoRAAdapter._normalize_weights (BEFORE)
Why: SGLang reads only ``r``, ``lora_alpha`` and ``target_modules`` of ``adapter_config.json``:
    rsLoRA, ``alpha_pattern`` and ``rank_pattern`` adapters are served with wrong numbers or
    refused with a bare tensor error; ``modules_to_save``, biases and DoRA-like variants are
    silently ignored; adapters for another hidden size, with only some of q/k/v, with NaN/Inf
    tensors, or above ``--max-lora-rank`` in ``--lora-paths`` load and then kill the server on
    their first request; LoRA on ``lm_head`` of a model that computes its logits from its input
    embedding (Gemma) is dropped silently; a failed load leaves its config behind.
How: (see :mod:`sglang_xpu_lora.adapters`) for adapters in scope (:mod:`sglang_xpu_lora.adapters.checked_backends`):
    * at argument validation, each local ``--lora-paths`` adapter is checked (config, rank
      against ``--max-lora-rank``, finite tensors shaped for the base model's config), so a
      refused adapter stops the launcher before the model loads;
    * ``validate_new_adapter`` (before SGLang's own checks and before any tensor is read) checks
      the config, resolves a regular-expression ``target_modules`` against the model, sets
      ``config.r`` to the served rank and attaches the :class:`~sglang_xpu_lora.adapters.config_checks.AdapterPlan`;
    * ``_normalize_weights`` (after the tensors are read into CPU memory, before SGLang stacks
      q/k/v and gate/up and before any pool slot is written) checks each tensor (and refuses LoRA
      on ``lm_head`` of a model that computes its logits from the input embedding, where SGLang
      would drop it), folds scales, pads ranks, adds zero slices and sets the adapter's ``scaling``;
    * a failed ``_load_lora_adapter*`` removes the config and weights it left in the manager, so
      a refused adapter leaves nothing behind (HTTP 400; the server keeps serving).
Checked against: SGLang 0.5.23 (the compat guard checks the parameters and source anchors).
Remove when: SGLang validates and honours every ``LoraConfig`` field itself.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
from pathlib import Path
from typing import Any, Optional

from sglang_xpu_lora.adapters import AdapterRejected, checked_backends
from sglang_xpu_lora.adapters.config_checks import check_adapter_config, resolve_target_regex
from sglang_xpu_lora.adapters.model_checks import (
    check_served_modules,
    embedding_logits_architecture,
    hf_model_embedding_logits,
    lora_modules,
)
from sglang_xpu_lora.adapters.scale_folding import fold_and_pad, served_scale
from sglang_xpu_lora.adapters.tensor_checks import (
    ModuleDims,
    check_tensors,
    fill_missing_slices,
    hf_meta_dims,
    sglang_module_dims,
)
from sglang_xpu_lora.patches.undo import UndoStack, queue_hook
from sglang_xpu_lora.registry import LoRABackendRegistry
from sglang_xpu_lora.upstream import targets
from sglang_xpu_lora.upstream.compat import resolve

logger = logging.getLogger(__name__)

#: Attribute set on SGLang's ``LoRAConfig`` of an adapter in scope: its ``AdapterPlan``.
PLAN_ATTR = "xpu_lora_plan"


def check_lora_paths(server_args: Any) -> None:
    """Check every local ``--lora-paths`` adapter served by a backend in scope, before the model
    loads: its config, and its ``adapter_model.safetensors`` tensors (finite; shaped for the base
    model's config, built on the ``meta`` device; no lm_head LoRA for a model that computes its
    logits from the input embedding).

    Adapters named by a hub id (no local ``adapter_config.json``), and tensors when transformers
    cannot build the base model from its config, are checked when they load.

    Raises:
        ValueError: one line per refused adapter (and for an invalid scope setting).
    """
    cfg = resolve(targets.RESOLVING_VIEW)(server_args)
    # applies_to first: an invalid scope setting is reported here, not at the first adapter load.
    if not cfg.enable_lora or not checked_backends.applies_to(cfg.lora_backend) or not cfg.lora_paths:
        return
    local = [ref for ref in cfg.lora_paths if (Path(ref.lora_path) / "adapter_config.json").is_file()]
    dims = hf_meta_dims(cfg.model_path, bool(cfg.trust_remote_code)) if local else None
    embedding_logits = hf_model_embedding_logits(cfg.model_path, bool(cfg.trust_remote_code)) if local else None
    problems = []
    for ref in local:
        try:
            check_local_adapter(ref.lora_name, Path(ref.lora_path), cfg.max_lora_rank, dims, embedding_logits)
        except AdapterRejected as exc:
            problems.append(str(exc))
        except ValueError as exc:  # an unreadable file
            problems.append(f"LoRA adapter {ref.lora_name!r}: cannot read {ref.lora_path}: {exc}")
    if problems:
        raise ValueError("\n".join(problems))


def check_local_adapter(
    name: str, path: Path, max_lora_rank: Optional[int], dims: Optional[ModuleDims], embedding_logits: Optional[str] = None
) -> None:
    """Check the adapter in directory ``path``: its config, and its safetensors with ``dims`` (the
    base model's module shapes) and ``embedding_logits`` (the base model's architecture when it
    computes its logits from the input embedding).

    Raises:
        AdapterRejected: see :func:`~sglang_xpu_lora.adapters.config_checks.check_adapter_config`,
            :func:`~sglang_xpu_lora.adapters.tensor_checks.check_tensors` and
            :func:`~sglang_xpu_lora.adapters.model_checks.check_served_modules`.
        ValueError: unreadable JSON or safetensors.
    """
    plan = check_adapter_config(name, json.loads((path / "adapter_config.json").read_text()), max_lora_rank)
    if not plan.target_regex:
        check_served_modules(name, _target_names(plan.target_modules), embedding_logits)
    weights = path / "adapter_model.safetensors"
    if (dims is not None or embedding_logits is not None) and weights.is_file():
        from safetensors.torch import load_file

        tensors = load_file(weights)
        check_served_modules(name, lora_modules(tensors), embedding_logits)
        if dims is not None:
            check_tensors(plan, tensors.items(), dims, require_known_modules=False)


def _target_names(target_modules: Any) -> list[str]:
    """``target_modules`` as a list of names ('all' / 'all-linear' name no module)."""
    return [] if target_modules is None or isinstance(target_modules, str) else list(target_modules)


def _embedding_logits(base_model: Any, text_config: Any) -> Optional[str]:
    """The served model's architecture when it computes its logits from the input embedding (see
    :func:`~sglang_xpu_lora.adapters.model_checks.embedding_logits_architecture`), else None."""
    return embedding_logits_architecture([type(base_model).__name__], bool(getattr(text_config, "tie_word_embeddings", True)))


def plan_adapter(manager: Any, lora_config: Any, lora_ref: Any) -> None:
    """Check an adapter's config for ``manager`` and prepare its config for SGLang: a resolved
    ``target_modules`` list, ``r`` = the served rank, and the plan attached as :data:`PLAN_ATTR`.

    Raises:
        AdapterRejected: a refused field, a rank above the memory pool's ``max_lora_rank``, or
            ``lm_head`` targeted on a model that computes its logits from the input embedding.
    """
    pool = getattr(manager, "memory_pool", None)
    # Before the pool exists (start-up adapters), the bound is --max-lora-rank when it was given.
    max_lora_rank = pool.max_lora_rank if pool is not None else resolve(targets.GET_LORA)().max_lora_rank
    plan = check_adapter_config(lora_ref.lora_name, lora_config.hf_config, max_lora_rank)
    for warning in plan.warnings:
        logger.warning(warning)
    # A regular expression is matched against "lm_head" itself: the model may have no lm_head to resolve it against.
    targeted = ["lm_head"] if plan.target_regex and re.fullmatch(plan.target_regex, "lm_head") else _target_names(plan.target_modules)
    check_served_modules(plan.name, targeted, _embedding_logits(manager.base_model, manager.base_hf_config))
    if plan.target_regex:
        lora_config.target_modules = resolve_target_regex(plan, sglang_module_dims(manager.base_model)[2])
    lora_config.r = plan.served_rank
    setattr(lora_config, PLAN_ATTR, plan)


def prepare_weights(adapter: Any) -> None:
    """Check, fold and pad the CPU tensors of a planned adapter (a no-op for others); see
    :mod:`sglang_xpu_lora.adapters`.

    Raises:
        AdapterRejected: a non-finite tensor, a wrong shape, a module the model lacks, or LoRA on
            ``lm_head`` of a model that computes its logits from the input embedding.
    """
    plan = getattr(adapter.config, PLAN_ATTR, None)
    if plan is None:
        return
    embedding_logits = _embedding_logits(adapter.base_model, adapter.base_hf_config)
    check_served_modules(plan.name, lora_modules(adapter.embedding_layers), embedding_logits)
    dims, fused, _ = sglang_module_dims(adapter.base_model)
    layer_weights = [layer.weights for layer in adapter.layers]
    check_tensors(plan, itertools.chain(*(w.items() for w in layer_weights), adapter.embedding_layers.items()), dims)
    for weights in layer_weights:
        fold_and_pad(plan, weights)
        fill_missing_slices(weights, dims, fused)
    fold_and_pad(plan, adapter.embedding_layers)
    adapter.scaling = served_scale(plan)


def apply(registry: LoRABackendRegistry, undo: UndoStack) -> None:

    def after_check_lora_server_args(result, server_args, *args, **kwargs):
        check_lora_paths(server_args)
        return result

    def around_validate_new_adapter(original, manager, lora_config, lora_ref, *args, **kwargs):
        if checked_backends.applies_to(manager.lora_backend.name):
            plan_adapter(manager, lora_config, lora_ref)
        return original(manager, lora_config, lora_ref, *args, **kwargs)

    def around_load_lora_adapter(original, manager, lora_ref, *args, **kwargs):
        if not checked_backends.applies_to(manager.lora_backend.name):
            return original(manager, lora_ref, *args, **kwargs)
        had_config, had_weights = lora_ref.lora_id in manager.configs, lora_ref.lora_id in manager.loras
        result = original(manager, lora_ref, *args, **kwargs)
        if not result.success:  # SGLang keeps the config (and weights) of a failed load
            if not had_config:
                manager.configs.pop(lora_ref.lora_id, None)
            if not had_weights:
                manager.loras.pop(lora_ref.lora_id, None)
        return result

    def before_normalize_weights(adapter, *args, **kwargs):
        prepare_weights(adapter)

    queue_hook(targets.CHECK_LORA_SERVER_ARGS, after_check_lora_server_args, "AFTER", undo)
    queue_hook(targets.LORA_MANAGER_VALIDATE_NEW_ADAPTER, around_validate_new_adapter, "AROUND", undo)
    queue_hook(targets.LORA_MANAGER_LOAD_ADAPTER, around_load_lora_adapter, "AROUND", undo)
    queue_hook(targets.LORA_MANAGER_LOAD_ADAPTER_FROM_TENSORS, around_load_lora_adapter, "AROUND", undo)
    queue_hook(targets.LORA_ADAPTER_NORMALIZE_WEIGHTS, before_normalize_weights, "BEFORE", undo)
