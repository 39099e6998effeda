"""``adapter_config.json`` against PEFT 0.21.2's ``LoraConfig``: every field honoured or refused.

:data:`FIELDS` has one entry per field of ``peft.LoraConfig`` (and its ``PeftConfig`` base) saying
how the plugin serves it; :func:`check_adapter_config` applies it to one adapter and returns the
:class:`AdapterPlan` the tensor stage executes, or raises :class:`~sglang_xpu_lora.adapters.AdapterRejected`
listing every refused field with what to do. It needs no model, so it also runs at argument
validation for ``--lora-paths`` (before the model loads). Pattern keys follow PEFT's
``get_pattern_key`` (``peft/utils/other.py``): key ``k`` applies to module ``m`` when
``re.match(rf"(.*\\.)?({k})$", m)``; regex ``target_modules`` follow ``check_target_module_exists``
(``re.fullmatch`` against the module name).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Iterable, Mapping, Optional

from sglang_xpu_lora.adapters import AdapterRejected
from sglang_xpu_lora.upstream.compat import TESTED_SGLANG

#: ``target_modules`` strings SGLang resolves itself (against the base model).
SGLANG_TARGET_SHORTHANDS = ("all", "all-linear")
#: ``init_lora_weights`` values whose adapters are relative to a base the method modified.
BASE_MODIFYING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


@dataclasses.dataclass(frozen=True)
class FieldRule:
    """How one ``LoraConfig`` field is served. ``verdict`` is ``"honoured"``, ``"ignored"`` (has no
    effect on inference) or ``"refused"`` (refused when ``problem`` says so); ``how`` is the one-line
    explanation (as docs/peft-adapters.md gives it); ``problem(value, config)`` returns the refusal
    (what is wrong and what to do) or None."""

    verdict: str
    how: str
    problem: Callable[[Any, Mapping[str, Any]], Optional[str]] = lambda value, config: None


def _refused_when_set(why: str) -> Callable[[Any, Mapping[str, Any]], Optional[str]]:
    return lambda value, config: why if value else None


def _peft_type(value: Any, config: Mapping[str, Any]) -> Optional[str]:
    if str(value).upper() != "LORA":
        return f"only LoRA adapters are served (got peft_type {value!r})"
    return None


def _bias(value: Any, config: Mapping[str, Any]) -> Optional[str]:
    if value in (None, "none"):
        return None
    return (
        "the adapter carries trained base-layer biases, which multi-LoRA serving cannot apply per "
        "adapter; merge the adapter into the base model (PeftModel.merge_and_unload) and serve that"
    )


def _target_modules(value: Any, config: Mapping[str, Any]) -> Optional[str]:
    if value is None:
        if config.get("target_parameters"):
            return None  # reported under target_parameters
        return "the adapter names no target modules; save it with an explicit target_modules list"
    if isinstance(value, str):
        if value in SGLANG_TARGET_SHORTHANDS:
            return None
        try:
            re.compile(value)
        except re.error as exc:
            return f"{value!r} is not a valid regular expression ({exc})"
        return None
    if not isinstance(value, (list, tuple, set)) or not all(isinstance(v, str) for v in value):
        return f"expected a list of module names or a regular expression, got {value!r}"
    return None


def _rank_pattern(value: Any, config: Mapping[str, Any]) -> Optional[str]:
    if not value:
        return None
    bad = {k: v for k, v in dict(value).items() if not isinstance(v, int) or isinstance(v, bool) or v <= 0}
    return f"ranks must be positive integers, got {bad}" if bad else None


def _alpha_pattern(value: Any, config: Mapping[str, Any]) -> Optional[str]:
    if not value:
        return None
    bad = {k: v for k, v in dict(value).items() if not isinstance(v, (int, float)) or isinstance(v, bool)}
    return f"alphas must be numbers, got {bad}" if bad else None


def _ensure_weight_tying(value: Any, config: Mapping[str, Any]) -> Optional[str]:
    targets = config.get("target_modules") or ()
    if value and not isinstance(targets, str) and {"embed_tokens", "lm_head"} & set(targets):
        return (
            "embed_tokens and lm_head LoRA tied to each other are not served; save the adapter "
            "untied (ensure_weight_tying=False) or merge it into the base model"
        )
    return None


_MERGE = "merge the adapter into the base model (PeftModel.merge_and_unload) and serve that"

#: Every field of PEFT 0.21.2's ``LoraConfig`` (``dataclasses.fields(peft.LoraConfig)``).
FIELDS: dict[str, FieldRule] = {
    # PeftConfig metadata.
    "peft_type": FieldRule("honoured", "must be LORA", _peft_type),
    "task_type": FieldRule("ignored", "metadata (a task head would be in modules_to_save, refused there)"),
    "base_model_name_or_path": FieldRule("ignored", "metadata; the served base is --model-path"),
    "revision": FieldRule("ignored", "metadata"),
    "inference_mode": FieldRule("ignored", "metadata"),
    "auto_mapping": FieldRule("ignored", "metadata"),
    "peft_version": FieldRule("ignored", "metadata"),
    # The LoRA math.
    "r": FieldRule("honoured", "the adapter's rank; must be <= --max-lora-rank"),
    "lora_alpha": FieldRule("honoured", "scale lora_alpha / r"),
    "use_rslora": FieldRule("honoured", "scale lora_alpha / sqrt(r), folded into LoRA-B where it differs"),
    "rank_pattern": FieldRule("honoured", "per-module ranks, zero-padded to the adapter's largest rank", _rank_pattern),
    "alpha_pattern": FieldRule("honoured", "per-module alphas, folded into LoRA-B", _alpha_pattern),
    "target_modules": FieldRule(
        "honoured", "a list of module names, 'all-linear', or a regular expression resolved against the "
        "base model's module names; q/k/v or gate/up slices not targeted are served as zeros", _target_modules,
    ),
    "exclude_modules": FieldRule("honoured", "excluded modules have no tensors, so they are served unchanged"),
    "layers_to_transform": FieldRule("honoured", "layers without tensors are served unchanged"),
    "layers_pattern": FieldRule("honoured", "layers without tensors are served unchanged"),
    "fan_in_fan_out": FieldRule("honoured", "only orients the base weight (GPT-2 Conv1D); LoRA tensors are unchanged"),
    "lora_dropout": FieldRule("ignored", "training only"),
    "init_lora_weights": FieldRule(
        "honoured", "initialisation only; pissa/olora/corda/loftq/lora_ga adapters are relative to the "
        "base model the method wrote (a warning says so)",
    ),
    "eva_config": FieldRule("ignored", "initialisation only"),
    "corda_config": FieldRule("ignored", "initialisation only (see init_lora_weights)"),
    "lora_ga_config": FieldRule("ignored", "initialisation only (see init_lora_weights)"),
    "loftq_config": FieldRule("ignored", "initialisation only (see init_lora_weights)"),
    "velora_config": FieldRule("honoured", "VeLoRA changes only the backward pass"),
    "runtime_config": FieldRule("ignored", "not saved by PEFT"),
    "qalora_group_size": FieldRule("ignored", "used only with use_qalora (refused)"),
    "megatron_core": FieldRule("ignored", "used only with megatron_config (refused)"),
    # Refused: not one low-rank product per module at one scale.
    "bias": FieldRule("refused", "bias 'all'/'lora_only' trains base-layer biases", _bias),
    "lora_bias": FieldRule(
        "refused", "a bias on LoRA-B adds a constant per adapter that the LoRA ops cannot express",
        _refused_when_set("a bias on LoRA-B (lora_bias) is not servable by multi-LoRA; " + _MERGE),
    ),
    "modules_to_save": FieldRule(
        "refused", "full trained copies of modules replace the base module per adapter",
        _refused_when_set("full trained copies of modules (modules_to_save) are not servable by multi-LoRA; " + _MERGE),
    ),
    "trainable_token_indices": FieldRule(
        "refused", "trained embedding rows replace the base rows per adapter",
        _refused_when_set("trained token embeddings (trainable_token_indices) are not servable by multi-LoRA; " + _MERGE),
    ),
    "use_dora": FieldRule(
        "refused", "DoRA rescales the whole weight per adapter",
        _refused_when_set("DoRA (use_dora) is not servable by multi-LoRA; " + _MERGE),
    ),
    "alora_invocation_tokens": FieldRule(
        "refused", "Activated LoRA applies the adapter only after invocation tokens",
        _refused_when_set("Activated LoRA (alora_invocation_tokens) is not served; serve it with a server that supports aLoRA or " + _MERGE),
    ),
    "use_qalora": FieldRule(
        "refused", "QALoRA's LoRA-A reads group-pooled inputs",
        _refused_when_set("QALoRA (use_qalora) is not served; " + _MERGE),
    ),
    "monteclora_config": FieldRule(
        "refused", "MonteCLoRA samples its LoRA factors",
        _refused_when_set("MonteCLoRA (monteclora_config) is not served; " + _MERGE),
    ),
    "use_bdlora": FieldRule(
        "refused", "BD-LoRA's block-diagonal factors are sharded differently under TP",
        _refused_when_set("BD-LoRA (use_bdlora) is not served; " + _MERGE),
    ),
    "arrow_config": FieldRule(
        "refused", "Arrow routes each token among several adapters",
        _refused_when_set("Arrow routing (arrow_config) is not served; load the adapters it routes among separately"),
    ),
    "kasa_config": FieldRule(
        "refused", "KaSA inserts a diagonal between LoRA-A and LoRA-B and truncates the base weight",
        _refused_when_set("KaSA (kasa_config) is not served; " + _MERGE),
    ),
    "layer_replication": FieldRule(
        "refused", "it changes the base model's layer stack",
        _refused_when_set("layer_replication changes the base model's layers; " + _MERGE),
    ),
    "megatron_config": FieldRule(
        "refused", "Megatron-parallel LoRA tensors are saved sharded",
        _refused_when_set("Megatron-parallel LoRA (megatron_config) is not served; export a regular PEFT adapter"),
    ),
    "target_parameters": FieldRule(
        "refused", "LoRA on raw parameters (e.g. fused MoE experts) has no SGLang LoRA layer",
        _refused_when_set("LoRA on parameters (target_parameters) is not served; target modules instead or " + _MERGE),
    ),
    "ensure_weight_tying": FieldRule("honoured", "refused only when it ties embed_tokens and lm_head LoRA", _ensure_weight_tying),
}


@dataclasses.dataclass(frozen=True)
class AdapterPlan:
    """What the tensor stage does for one accepted adapter (all from ``adapter_config.json``).

    ``rank_pattern`` / ``alpha_pattern`` map PEFT pattern keys to per-module ranks / alphas;
    ``target_modules`` is the config's value (a regular expression is resolved later, against the
    model, by :func:`resolve_target_regex`); ``warnings`` are logged at load.
    """

    name: str
    r: int
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: Mapping[str, int] = dataclasses.field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = dataclasses.field(default_factory=dict)
    target_modules: Any = None
    warnings: tuple[str, ...] = ()

    @property
    def served_rank(self) -> int:
        """The rank the adapter is served at: the largest of ``r`` and the ``rank_pattern`` ranks."""
        return max([self.r, *self.rank_pattern.values()])

    @property
    def target_regex(self) -> Optional[str]:
        """``target_modules`` when it is a regular expression (not a list nor 'all'/'all-linear')."""
        value = self.target_modules
        return value if isinstance(value, str) and value not in SGLANG_TARGET_SHORTHANDS else None

    def module_rank(self, module_key: str) -> int:
        """PEFT's rank for ``module_key`` (e.g. ``model.layers.0.self_attn.q_proj``)."""
        key = pattern_key(self.rank_pattern, module_key)
        return self.rank_pattern[key] if key is not None else self.r

    def module_alpha(self, module_key: str) -> float:
        """PEFT's alpha for ``module_key``."""
        key = pattern_key(self.alpha_pattern, module_key)
        return self.alpha_pattern[key] if key is not None else self.lora_alpha


def pattern_key(patterns: Iterable[str], module_key: str) -> Optional[str]:
    """The first pattern key that applies to ``module_key`` as PEFT's ``get_pattern_key`` decides
    (``re.match(rf"(.*\\.)?({key})$", module_key)``), or None."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module_key):
            return key
    return None


def check_adapter_config(name: str, config: Mapping[str, Any], max_lora_rank: Optional[int] = None) -> AdapterPlan:
    """Check ``config`` (a parsed ``adapter_config.json``) of adapter ``name`` field by field.

    ``max_lora_rank`` (``--max-lora-rank``), when given, bounds the served rank. Fields unknown to
    PEFT 0.21.2 are accepted only at a default-like value (None, False, empty).

    Raises:
        AdapterRejected: naming the adapter and, for each refused field, the field, its value, why
            and what to do.
    """
    problems = []
    for field, value in config.items():
        rule = FIELDS.get(field)
        if rule is None:
            if value:
                problems.append(
                    f"field {field!r}={value!r} is unknown to PEFT 0.21.2's LoraConfig, so it cannot be "
                    "honoured; remove it if it does not change the adapter's output"
                )
            continue
        problem = rule.problem(value, config)
        if problem:
            problems.append(f"field {field!r}={_short(value)}: {problem}")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        problems.append(f"field 'r'={r!r}: the rank must be a positive integer")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        problems.append(f"field 'lora_alpha'={alpha!r}: must be a number")
    if problems:
        raise AdapterRejected(_rejection(name, problems))
    plan = AdapterPlan(
        name=name,
        r=r,
        lora_alpha=float(alpha),
        use_rslora=bool(config.get("use_rslora")),
        rank_pattern=dict(config.get("rank_pattern") or {}),
        alpha_pattern={k: float(v) for k, v in (config.get("alpha_pattern") or {}).items()},
        target_modules=config.get("target_modules"),
        warnings=_warnings(name, config),
    )
    if max_lora_rank is not None and plan.served_rank > max_lora_rank:
        source = "r" if plan.served_rank == r else "rank_pattern"
        raise AdapterRejected(
            _rejection(
                name,
                [
                    f"field {source!r}: rank {plan.served_rank} exceeds --max-lora-rank {max_lora_rank}; "
                    f"start the server with --max-lora-rank {plan.served_rank} or more"
                ],
            )
        )
    return plan


def resolve_target_regex(plan: AdapterPlan, module_keys: Iterable[str]) -> list[str]:
    """The module names (last component) a regular-expression ``target_modules`` selects among
    ``module_keys`` (the base model's modules named as in the Hugging Face model, e.g.
    ``model.layers.0.self_attn.q_proj``), as PEFT selects them (``re.fullmatch``).

    Raises:
        AdapterRejected: when the expression selects no module.
    """
    pattern = re.compile(plan.target_regex)
    names = sorted({key.rsplit(".", 1)[-1] for key in module_keys if pattern.fullmatch(key)})
    if not names:
        raise AdapterRejected(
            _rejection(
                plan.name,
                [
                    f"field 'target_modules'={plan.target_regex!r}: the regular expression matches no module "
                    "of the base model; check that the adapter was trained for this model"
                ],
            )
        )
    return names


def check_target_modules(
    name: str,
    target_modules: Any,
    model_modules: Iterable[str],
    normalize: Callable[[Iterable[str]], set[str]],
    lora_capable: Iterable[str],
    served_modules: Optional[Iterable[str]] = None,
) -> None:
    """Refuse adapter ``name`` when its list ``target_modules`` names a module the base model does
    not have, one SGLang has no LoRA layer for, or (with ``served_modules``) one the server's LoRA
    memory pool has no buffers for; checked in that order, the first failing check is reported.

    ``normalize`` maps module names to the names SGLang serves them under (SGLang's
    ``get_normalized_target_modules``: ``q_proj`` -> ``qkv_proj``, a dotted name -> its last part);
    ``model_modules`` are the base model's module names (full or last part), ``lora_capable`` the
    normalized names SGLang's LoRA can serve at all (its ``_KNOWN_LORA_TARGET_MODULES``: GPT-2's
    ``c_attn`` is not one), ``served_modules`` the pool's normalized target modules. A regular
    expression or ``all``/``all-linear`` is resolved against the model and is not checked here.

    Raises:
        AdapterRejected: naming the adapter, the target modules at fault and what to do.
    """
    if not isinstance(target_modules, (list, tuple, set)):
        return
    known = normalize({module.rpartition(".")[2] for module in model_modules})
    capable = set(lora_capable)
    checks = [
        (known, lambda bad: (
            f"names {bad}, which the base model does not have; the adapter was trained for another "
            "model (or, if it has no tensors for them, remove them from target_modules in adapter_config.json)"
        )),
        (capable, lambda bad: (
            f"names {bad}: the base model has them, but SGLang {TESTED_SGLANG} has no LoRA layer for them (it "
            f"serves LoRA on {sorted(capable)} only, as SGLang names them); merge the adapter into the "
            "base model (PeftModel.merge_and_unload) and serve that"
        )),
    ]
    if served_modules is not None:
        served = set(served_modules)
        checks.append((served, lambda bad: (
            f"names {bad}, but the server was started with LoRA on {sorted(served)} only; restart it "
            f"with --lora-target-modules including {sorted(normalize(bad))} (or all)"
        )))
    for allowed, why in checks:
        bad = [module for module in target_modules if not normalize([module]) <= allowed]
        if bad:
            raise AdapterRejected(_rejection(name, [f"field 'target_modules' {why(bad)}"]))


def _warnings(name: str, config: Mapping[str, Any]) -> tuple[str, ...]:
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.startswith(BASE_MODIFYING_INITS):
        return (
            f"LoRA adapter {name!r}: init_lora_weights={init!r} adapters are relative to the base model "
            "that method wrote; serve that base, or convert the adapter with PEFT's "
            "path_initial_model_for_weight_conversion",
        )
    return ()


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _rejection(name: str, problems: list[str]) -> str:
    return f"LoRA adapter {name!r} cannot be served exactly: " + "; ".join(problems)
