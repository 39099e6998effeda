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
    embedding (Gemma) is dropped silently; a failed load leaves its config behind. A mistyped local
    path is read as a Hub id ("Repo id must be in the form ..."), and a path without weights, a
    target module the model lacks or added tokens in ``--lora-paths`` kill the server after the
    model load.
How: (see :mod:`sglang_xpu_lora.adapters`) for adapters in scope (:mod:`sglang_xpu_lora.adapters.checked_backends`):
    * at argument validation, each ``--lora-paths`` adapter given by a local path is checked (the
      directory, ``adapter_config.json`` and a weights file; config, rank against
      ``--max-lora-rank``; against the base model built on the ``meta`` device: target modules,
      added tokens, finite tensors of the model's shapes), so a refused adapter stops the launcher
      before the model loads;
    * ``_load_lora_adapter`` first checks a local path's files (SGLang reads any path that is not
      a directory as a Hub id), answering a failed load;
    * ``validate_new_adapter`` (before SGLang's own checks and before any tensor is read) checks
      the config, resolves a regular-expression ``target_modules`` against the model, checks the
      target modules against the model and the pool and refuses added tokens, sets ``config.r``
      to the served rank and attaches the :class:`~sglang_xpu_lora.adapters.config_checks.AdapterPlan`;
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

import dataclasses
import itertools
import json
import logging
import re
from pathlib import Path
from typing import Any, Optional

from sglang_xpu_lora.adapters import AdapterRejected, checked_backends
from sglang_xpu_lora.adapters.adapter_files import ADAPTER_CONFIG, check_added_tokens, check_adapter_files, read_added_tokens
from sglang_xpu_lora.adapters.config_checks import (
    AdapterPlan,
    check_adapter_config,
    check_target_modules,
    resolve_target_regex,
)
from sglang_xpu_lora.adapters.model_checks import (
    check_served_modules,
    hf_config_embedding_logits,
    lora_modules,
    served_model_embedding_logits,
)
from sglang_xpu_lora.adapters.scale_folding import fold_and_pad, served_scale
from sglang_xpu_lora.adapters.served_targets import expert_lora_refusal, lora_capable_modules, wraps_experts
from sglang_xpu_lora.adapters.tensor_checks import (
    ModuleDims,
    check_tensors,
    fill_missing_slices,
    hf_local_config,
    hf_meta_model,
    hf_module_dims,
    sglang_module_dims,
)
from sglang_xpu_lora.patches.errors import BackendArgumentError
from sglang_xpu_lora.patches.undo import UndoStack, queue_hook
from sglang_xpu_lora.registry import LoRABackendRegistry
from sglang_xpu_lora.upstream import targets
from sglang_xpu_lora.upstream.compat import resolve

logger = logging.getLogger(__name__)

#: Attribute set on SGLang's ``LoRAConfig`` of an adapter in scope: its ``AdapterPlan``.
PLAN_ATTR = "xpu_lora_plan"


def check_lora_paths(server_args: Any) -> None:
    """Check every ``--lora-paths`` adapter served by a backend in scope, and the LoRA target
    modules the server will serve, before the model loads.

    A local path (see :func:`~sglang_xpu_lora.adapters.adapter_files.is_local_reference`) must be
    a directory with ``adapter_config.json`` and a weights file; its config is checked, and, against
    the base model built from its config on the ``meta`` device, its ``target_modules`` (a regular
    expression resolved against the model as the load resolves it; modules the model has and
    SGLang has a LoRA layer for, within ``--lora-target-modules`` when given; no
    lm_head LoRA for a model that computes its logits from the input embedding), its
    ``added_tokens.json`` and its ``adapter_model.safetensors`` tensors (finite, shaped for the
    model). Then the target modules the server will build its pool for (``--lora-target-modules``,
    else the adapters') must not put LoRA on the model's routed experts where SGLang's MoE-LoRA
    kernels cannot run (:func:`~sglang_xpu_lora.adapters.served_targets.expert_lora_refusal`).

    Adapters named by a Hub id, and the model checks when transformers cannot build the base model
    from its config, are checked when they load.

    Raises:
        BackendArgumentError: one line per refused adapter, or the refused target modules (a
            ``ValueError``; uncaught, the launcher exits with the lines alone).
        ValueError: for an invalid scope setting.
    """
    cfg = resolve(targets.RESOLVING_VIEW)(server_args)
    # applies_to first: an invalid scope setting is reported here, not at the first adapter load.
    if not cfg.enable_lora or not checked_backends.applies_to(cfg.lora_backend):
        return
    problems, local = [], []
    for ref in cfg.lora_paths or ():
        try:
            directory = check_adapter_files(ref.lora_name, ref.lora_path)
        except AdapterRejected as exc:
            problems.append(str(exc))
            continue
        if directory is not None:
            local.append((ref, directory))
    flag = set(cfg.lora_target_modules or ())
    if not local and not wraps_experts(_normalize(flag)):
        if problems:
            raise BackendArgumentError("\n".join(problems))
        return
    hf_config = hf_local_config(cfg.model_path, bool(cfg.trust_remote_code))
    model = hf_meta_model(hf_config, bool(cfg.trust_remote_code))
    embedding_logits = None if hf_config is None else hf_config_embedding_logits(hf_config)
    base = None if model is None else BaseModelFacts.of_hf_model(model, None if "all" in flag or not flag else flag)
    sources = [("--lora-target-modules", sorted(flag), frozenset(_normalize(flag)))] if flag else []
    for ref, directory in local:
        try:
            plan = check_local_adapter(ref.lora_name, directory, cfg.max_lora_rank, base, embedding_logits)
        except AdapterRejected as exc:
            problems.append(str(exc))
            continue
        except ValueError as exc:  # an unreadable file
            problems.append(f"LoRA adapter {ref.lora_name!r}: cannot read {ref.lora_path}: {exc}")
            continue
        given = _given_targets(plan, base)
        if not flag and given is not None:
            label = f"adapter {ref.lora_name!r}"
            sources.append((label, given, frozenset(_normalize_given(given))))
    if not problems and base is not None:
        from sglang_xpu_lora.providers import triton_support  # the ops' modules load lazily

        refusal = expert_lora_refusal(sources, base.module_names, cfg.device, triton_support(cfg.device))
        if refusal:
            problems.append(refusal)
    if problems:
        raise BackendArgumentError("\n".join(problems))


def _given_targets(plan: AdapterPlan, base: Optional["BaseModelFacts"]) -> Any:
    """An adapter's ``target_modules`` as the checks before the model load read them: a regular
    expression resolved against ``base`` (as the load resolves it, see
    :func:`~sglang_xpu_lora.adapters.config_checks.resolve_target_regex`), None without ``base``.

    Raises:
        AdapterRejected: a regular expression that matches no module of ``base``.
    """
    if plan.target_regex is None:
        return plan.target_modules
    return None if base is None else resolve_target_regex(plan, base.module_names)


def _normalize_given(target_modules: Any) -> set[str]:
    """SGLang's names for an adapter's ``target_modules`` list, or ``{"all"}`` for 'all' / 'all-linear'."""
    return _normalize(target_modules) if not isinstance(target_modules, str) else {"all"}


@dataclasses.dataclass(frozen=True)
class BaseModelFacts:
    """What the checks before the model load know of the base model: the :data:`ModuleDims`
    lookup, its module and parameter names, its vocabulary size, and the ``--lora-target-modules``
    the server will build its pool for (None: those of the adapters)."""

    dims: ModuleDims
    module_names: frozenset[str]
    vocab_size: Optional[int]
    served_modules: Optional[frozenset[str]] = None

    @classmethod
    def of_hf_model(cls, model: Any, served_modules: Optional[set[str]] = None) -> "BaseModelFacts":
        """Read a transformers model (built on the ``meta`` device)."""
        names = {name for name, _ in model.named_modules()} | {name for name, _ in model.named_parameters()}
        vocab_size = getattr(model.config.get_text_config(), "vocab_size", None)
        served = None if served_modules is None else frozenset(_normalize(served_modules))
        return cls(hf_module_dims(model), frozenset(names), vocab_size, served)


def naming_the_adapter(lora_ref: Any, message: str) -> str:
    """A failed load's ``message`` naming the adapter and its path: the plugin's refusals do
    already ("LoRA adapter 'name' ..."); SGLang's own errors (an unreadable ``adapter_config.json``
    or weights file) say only what failed."""
    if message.startswith("LoRA adapter "):
        return message
    source = f" from {lora_ref.lora_path}" if lora_ref.lora_path else ""
    return f"LoRA adapter {lora_ref.lora_name!r} cannot be loaded{source}: {message}"


def check_local_adapter(
    name: str,
    path: Path,
    max_lora_rank: Optional[int],
    base: Optional[BaseModelFacts],
    embedding_logits: Optional[str] = None,
) -> AdapterPlan:
    """Check the adapter in directory ``path``: its config; with ``base`` its target modules, added
    tokens and safetensors; with ``embedding_logits`` (the base model's architecture when it
    computes its logits from the input embedding) that it has no lm_head LoRA.

    Returns:
        The adapter's :class:`~sglang_xpu_lora.adapters.config_checks.AdapterPlan`.

    Raises:
        AdapterRejected: see :func:`~sglang_xpu_lora.adapters.config_checks.check_adapter_config`,
            :func:`~sglang_xpu_lora.adapters.config_checks.check_target_modules`,
            :func:`~sglang_xpu_lora.adapters.adapter_files.check_added_tokens`,
            :func:`~sglang_xpu_lora.adapters.tensor_checks.check_tensors` and
            :func:`~sglang_xpu_lora.adapters.model_checks.check_served_modules`.
        ValueError: unreadable JSON or safetensors.
    """
    plan = check_adapter_config(name, json.loads((path / ADAPTER_CONFIG).read_text()), max_lora_rank)
    check_served_modules(name, _targeted_modules(plan), embedding_logits)
    if base is not None:
        check_target_modules(
            name, _given_targets(plan, base), base.module_names, _normalize, lora_capable_modules(),
            base.served_modules,
        )
        check_added_tokens(name, read_added_tokens(path), base.vocab_size)
    weights = path / "adapter_model.safetensors"
    if (base is not None or embedding_logits is not None) and weights.is_file():
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            tensors = load_file(weights)
        except SafetensorError as exc:
            raise ValueError(f"{weights.name} is not a readable safetensors file ({exc})") from exc
        check_served_modules(name, lora_modules(tensors), embedding_logits)
        if base is not None:
            check_tensors(plan, tensors.items(), base.dims, require_known_modules=False)
    return plan


def _targeted_modules(plan: Any) -> list[str]:
    """The module names an adapter's ``target_modules`` names ('all' / 'all-linear' name none); for
    a regular expression, ``lm_head`` when it matches ``lm_head`` itself (the model may have no
    lm_head to resolve it against)."""
    if plan.target_regex:
        return ["lm_head"] if re.fullmatch(plan.target_regex, "lm_head") else []
    target_modules = plan.target_modules
    return [] if target_modules is None or isinstance(target_modules, str) else list(target_modules)


def plan_adapter(manager: Any, lora_config: Any, lora_ref: Any) -> None:
    """Check an adapter's config for ``manager`` and prepare its config for SGLang: a resolved
    ``target_modules`` list, ``r`` = the served rank, and the plan attached as :data:`PLAN_ATTR`.

    Raises:
        AdapterRejected: a refused field, a rank above the memory pool's ``max_lora_rank``, a
            target module the model (or the pool) lacks, tokens added to the vocabulary, or
            ``lm_head`` targeted on a model that computes its logits from the input embedding.
    """
    pool = getattr(manager, "memory_pool", None)
    # Before the pool exists (start-up adapters), the bound is --max-lora-rank when it was given.
    max_lora_rank = pool.max_lora_rank if pool is not None else resolve(targets.GET_LORA)().max_lora_rank
    plan = check_adapter_config(lora_ref.lora_name, lora_config.hf_config, max_lora_rank)
    for warning in plan.warnings:
        logger.warning(warning)
    embedding_logits = served_model_embedding_logits(manager.base_model, manager.base_hf_config)
    check_served_modules(plan.name, _targeted_modules(plan), embedding_logits)
    if plan.target_regex:
        lora_config.target_modules = resolve_target_regex(plan, sglang_module_dims(manager.base_model)[2])
    # LoRA-wrapped modules are no longer found by SGLang's detection; they are the manager's targets.
    # SGLang's detection names the routed experts' targets (gate_up_proj, down_proj of FusedMoE).
    wrapped = set(getattr(manager, "target_modules", None) or ())
    model_modules = (
        {name for name, _ in manager.base_model.named_modules()}
        | resolve(targets.AUTO_DETECT_LORA_TARGET_MODULES)(manager.base_model)
        | wrapped
    )
    served = None if pool is None else wrapped
    check_target_modules(
        lora_ref.lora_name, lora_config.target_modules, model_modules, _normalize, lora_capable_modules(), served
    )
    check_added_tokens(lora_ref.lora_name, lora_config.added_tokens_config, manager.base_hf_config.vocab_size)
    lora_config.r = plan.served_rank
    setattr(lora_config, PLAN_ATTR, plan)


def _normalize(modules: Any) -> set[str]:
    """SGLang's names for LoRA target modules (``q_proj`` -> ``qkv_proj``, ``a.b`` -> ``b``)."""
    return resolve(targets.GET_NORMALIZED_TARGET_MODULES)(list(modules))


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
    embedding_logits = served_model_embedding_logits(adapter.base_model, adapter.base_hf_config)
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

    def around_load_from_path(original, manager, lora_ref, *args, **kwargs):
        if checked_backends.applies_to(manager.lora_backend.name):
            try:  # before SGLang reads a path that is not a directory as a Hub id
                check_adapter_files(lora_ref.lora_name, lora_ref.lora_path)
            except AdapterRejected as exc:
                return manager.create_lora_update_result(success=False, error_message=str(exc))
        return around_load_leaving_nothing(original, manager, lora_ref, *args, **kwargs)

    def around_load_leaving_nothing(original, manager, lora_ref, *args, **kwargs):
        if not checked_backends.applies_to(manager.lora_backend.name):
            return original(manager, lora_ref, *args, **kwargs)
        had_config, had_weights = lora_ref.lora_id in manager.configs, lora_ref.lora_id in manager.loras
        result = original(manager, lora_ref, *args, **kwargs)
        if result.success:
            return result
        if not had_config:  # SGLang keeps the config (and weights) of a failed load
            manager.configs.pop(lora_ref.lora_id, None)
        if not had_weights:
            manager.loras.pop(lora_ref.lora_id, None)
        message = naming_the_adapter(lora_ref, result.error_message)
        return manager.create_lora_update_result(success=False, error_message=message)

    def before_normalize_weights(adapter, *args, **kwargs):
        prepare_weights(adapter)

    queue_hook(targets.CHECK_LORA_SERVER_ARGS, after_check_lora_server_args, "AFTER", undo)
    queue_hook(targets.LORA_MANAGER_VALIDATE_NEW_ADAPTER, around_validate_new_adapter, "AROUND", undo)
    queue_hook(targets.LORA_MANAGER_LOAD_ADAPTER, around_load_from_path, "AROUND", undo)
    queue_hook(targets.LORA_MANAGER_LOAD_ADAPTER_FROM_TENSORS, around_load_leaving_nothing, "AROUND", undo)
    queue_hook(targets.LORA_ADAPTER_NORMALIZE_WEIGHTS, before_normalize_weights, "BEFORE", undo)
