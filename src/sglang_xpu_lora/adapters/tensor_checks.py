"""Adapter tensors against the base model: finite, the right shape, every fused slice present.

PEFT saves one LoRA-A ``(r_m, in_features)`` and one LoRA-B ``(out_features, r_m)`` per targeted
module, named ``base_model.model.<module key>.lora_A.weight`` (``lora_embedding_A`` for embeddings,
whose A is ``(r_m, vocab)`` and B ``(hidden, r_m)``). The shapes checked are the unsharded ones the
base model's layers were built from (QKV: ``total_num_heads * head_size`` rows for q,
``total_num_kv_heads * head_size`` for k and v; merged and plain linears: their full output and
input sizes). SGLang's TP slicers (``slice_lora_a_weights`` / ``slice_lora_b_weights``) cut exactly
these shapes into each rank's pool buffers, so an adapter that passes fits every rank, and one that
does not is refused at load instead of failing inside the scheduler on its first request.

SGLang's pool fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj`` and expects every
slice of a fused module an adapter targets; :func:`fill_missing_slices` adds the untargeted ones as
zeros (the LoRA update of an untargeted projection is zero, as in PEFT).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable, MutableMapping, Optional

import torch

from sglang_xpu_lora.adapters import AdapterRejected
from sglang_xpu_lora.adapters.config_checks import AdapterPlan
from sglang_xpu_lora.upstream import targets
from sglang_xpu_lora.upstream.compat import resolve

#: Prefix of every tensor name in a PEFT adapter saved from a ``PeftModel``.
PEFT_PREFIX = "base_model.model."
#: Tensor-name suffix -> factor ("A" or "B").
LORA_SUFFIXES = {".lora_A.weight": "A", ".lora_B.weight": "B", ".lora_embedding_A": "A", ".lora_embedding_B": "B"}
#: SGLang fused module -> the Hugging Face modules it stacks, in stacking order.
FUSED_SLICES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_SLICE_OF = {part: (fused, index) for fused, parts in FUSED_SLICES.items() for index, part in enumerate(parts)}

#: ``module key -> (out_features, in_features)`` of the base model, or None when it has no such module.
ModuleDims = Callable[[str], Optional[tuple[int, int]]]


def split_tensor_name(name: str) -> Optional[tuple[str, str]]:
    """``(module key, "A" | "B")`` for a LoRA tensor name, or None for anything else (a bias, a
    ``modules_to_save`` copy, ...). The key is PEFT's module name: ``model.layers.0.self_attn.q_proj``."""
    for suffix, factor in LORA_SUFFIXES.items():
        if name.endswith(suffix):
            key = name[: -len(suffix)]
            return (key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key), factor
    return None


def _is_expert(module_key: str) -> bool:
    return ".experts." in module_key or module_key.endswith(".experts")


def check_tensors(
    plan: AdapterPlan, tensors: Iterable[tuple[str, torch.Tensor]], dims: ModuleDims, require_known_modules: bool = True
) -> None:
    """Refuse the adapter unless every tensor is a finite LoRA factor of a module the base model
    has, with PEFT's shape for that module's rank (``plan.module_rank``), and A and B come in pairs.

    MoE expert tensors are checked for finiteness and rank only (their layout is SGLang's concern).
    With ``require_known_modules=False`` a module ``dims`` does not know is not refused (for a
    lookup that may name modules differently from the serving model).

    Raises:
        AdapterRejected: naming the adapter, the first offending tensor, its shape and the
            expected shape (or the count of non-finite values).
    """
    factors: dict[str, set[str]] = {}
    for name, tensor in tensors:
        parsed = split_tensor_name(name)
        if parsed is None and _saved_base_embedding(name):
            _check_saved_base_embedding(plan, name, tensor, dims)
            continue
        if parsed is None:
            _reject(plan, f"tensor {name!r} is not a LoRA factor (lora_A / lora_B); it cannot be served by multi-LoRA")
        key, factor = parsed
        if not torch.is_floating_point(tensor):
            _reject(plan, f"tensor {name!r} has dtype {tensor.dtype}; LoRA factors must be floating point")
        finite = torch.isfinite(tensor)
        if not bool(finite.all()):
            bad = int(finite.numel() - finite.sum())
            _reject(plan, f"tensor {name!r} has {bad} non-finite value(s) (NaN or Inf); retrain or repair the adapter")
        factors.setdefault(key, set()).add(factor)
        rank = plan.module_rank(key)
        rank_dim = -2 if factor == "A" else -1
        if tensor.dim() < 2 or tensor.shape[rank_dim] != rank:
            _reject(
                plan,
                f"tensor {name!r} has shape {tuple(tensor.shape)} but rank {rank} for {key} "
                f"(r={plan.r}, rank_pattern={dict(plan.rank_pattern)}); the adapter's config does not match its tensors",
            )
        if _is_expert(key):
            continue
        expected_dims = dims(key)
        if expected_dims is None and not require_known_modules:
            continue
        if expected_dims is None:
            _reject(plan, f"tensor {name!r} is for module {key}, which the base model does not have; check that the adapter was trained for this model")
        out_features, in_features = expected_dims
        expected = (rank, in_features) if factor == "A" else (out_features, rank)
        if tuple(tensor.shape) != expected:
            difference = shape_difference(key, factor, tuple(tensor.shape), expected)
            _reject(plan, f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected} for this base model: {difference}")
    for key, present in factors.items():
        if present != {"A", "B"}:
            missing = ({"A", "B"} - present).pop()
            _reject(plan, f"module {key} has lora_{present.pop()} but no lora_{missing}; the adapter file is incomplete")


#: Module leaf name -> (what its in_features are, what its out_features are), in the words of the
#: model's config (LoRA-A is ``(r, in_features)``, LoRA-B ``(out_features, r)``; an embedding's
#: "in" is the vocabulary, PEFT's ``lora_embedding_A`` being ``(r, vocab)``).
MODULE_DIMENSIONS = {
    "embed_tokens": ("vocabulary size", "hidden size"),
    "lm_head": ("hidden size", "vocabulary size"),
    "q_proj": ("hidden size", "query width (attention heads x head dim)"),
    "k_proj": ("hidden size", "key width (key/value heads x head dim)"),
    "v_proj": ("hidden size", "value width (key/value heads x head dim)"),
    "qkv_proj": ("hidden size", "q/k/v width (attention and key/value heads x head dim)"),
    "o_proj": ("attention width (attention heads x head dim)", "hidden size"),
    "gate_proj": ("hidden size", "intermediate size"),
    "up_proj": ("hidden size", "intermediate size"),
    "gate_up_proj": ("hidden size", "intermediate size (x2, gate and up)"),
    "down_proj": ("intermediate size", "hidden size"),
}


def shape_difference(module_key: str, factor: str, shape: tuple[int, ...], expected: tuple[int, int]) -> str:
    """Which dimension of the model an adapter tensor's wrong ``shape`` disagrees on, in words:
    ``"the vocabulary size differs, 1030 in the adapter and 1024 in the base model; ..."``.

    ``factor`` is ``"A"`` (``expected`` = ``(r, in_features)``) or ``"B"`` (``(out_features, r)``),
    the rank already matching; the dimension is named from :data:`MODULE_DIMENSIONS` by the
    module's last name component (``input size of <module>`` / ``output size of <module>`` for
    modules not listed).
    """
    if len(shape) != len(expected):
        return (
            f"it has {len(shape)} dimensions where a LoRA factor has {len(expected)}; "
            "the adapter file is not a PEFT LoRA adapter for this model"
        )
    leaf = module_key.rpartition(".")[2]
    axis = 1 if factor == "A" else 0
    default = (f"input size of {leaf}", f"output size of {leaf}")
    dimension = MODULE_DIMENSIONS.get(leaf, default)[0 if factor == "A" else 1]
    difference = f"the {dimension} differs, {shape[axis]} in the adapter and {expected[axis]} in the base model"
    if dimension == "vocabulary size":
        return f"{difference}; the adapter was trained with a resized vocabulary (or for another model), which multi-LoRA does not serve"
    return f"{difference}; the adapter was trained for another model"


def _saved_base_embedding(name: str) -> Optional[str]:
    """The module key of a base ``embed_tokens`` / ``lm_head`` weight PEFT saves next to the LoRA
    factors (``save_embedding_layers``, on by default when they are targeted), or None."""
    for suffix in (".base_layer.weight", ".weight"):
        if name.endswith(suffix):
            key = name[: -len(suffix)]
            key = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
            if key.rpartition(".")[2] in ("embed_tokens", "lm_head"):
                return key
    return None


def _check_saved_base_embedding(plan: AdapterPlan, name: str, tensor: torch.Tensor, dims: ModuleDims) -> None:
    """A saved base embedding or lm_head is not served (the base model's own is), so it must be
    the base's shape ``(vocab, hidden)``: a resized vocabulary would be served wrongly."""
    key = _saved_base_embedding(name)
    module_dims = dims(key)
    if module_dims is None:
        return
    vocab_hidden = module_dims[::-1] if key.endswith("embed_tokens") else module_dims
    if tuple(tensor.shape) != vocab_hidden:
        _reject(
            plan,
            f"tensor {name!r} is a saved {key} of shape {tuple(tensor.shape)}, but the base model's is "
            f"{vocab_hidden}; the adapter was trained with a resized vocabulary, which multi-LoRA does not serve",
        )


def fill_missing_slices(weights: MutableMapping[str, torch.Tensor], dims: ModuleDims, fused_modules: set[str]) -> list[str]:
    """Add zero LoRA factors for the q/k/v (gate/up) slices an adapter leaves out of a module the
    base model fuses (``fused_modules``: e.g. ``{"qkv_proj"}``), so SGLang can stack them. A zero
    slice adds nothing, which is PEFT's output for an untargeted projection.

    ``weights`` maps SGLang's weight names (PEFT names as loaded) to tensors of one layer; the
    added A is ``(r, in_features)``, B ``(out_features, r)`` with ``r`` the present slices' rank,
    in their dtype. Returns the added names.
    """
    added = []
    for name in list(weights):
        parsed = split_tensor_name(name)
        if parsed is None or parsed[1] != "A":
            continue
        key = parsed[0]
        prefix, _, leaf = key.rpartition(".")
        if leaf not in _SLICE_OF or _SLICE_OF[leaf][0] not in fused_modules:
            continue
        present_a = weights[name]
        for sibling in FUSED_SLICES[_SLICE_OF[leaf][0]]:
            sibling_key = f"{prefix}.{sibling}"
            a_name, b_name = (name.replace(f".{leaf}.lora_A.", f".{sibling}.lora_{f}.") for f in "AB")
            if a_name in weights:
                continue
            sibling_dims = dims(sibling_key)
            if sibling_dims is None:
                continue
            out_features, in_features = sibling_dims
            weights[a_name] = present_a.new_zeros(present_a.shape[-2], in_features)
            weights[b_name] = present_a.new_zeros(out_features, present_a.shape[-2])
            added += [a_name, b_name]
    return added


def sglang_module_dims(base_model: torch.nn.Module) -> tuple[ModuleDims, set[str], list[str]]:
    """Read an SGLang base model (LoRA-wrapped or not).

    Returns ``(dims, fused_modules, module_keys)``: the :data:`ModuleDims` lookup by PEFT module
    key (a fused module answers both for its slices and, for adapters saved already stacked, for
    itself), the fused module names the model has (``{"qkv_proj", "gate_up_proj"}`` for Llama),
    and the model's LoRA-able modules named as in the Hugging Face model (fused modules split into
    their slices), for resolving a regular-expression ``target_modules``.
    """
    VocabParallelEmbedding, ParallelLMHead = resolve(targets.VOCAB_PARALLEL_EMBEDDING), resolve(targets.PARALLEL_LM_HEAD)
    table: dict[str, tuple[int, int]] = {}
    fused: set[str] = set()
    for name, module in base_model.named_modules():
        if name.endswith(".base_layer"):  # the layer a LoRA wrapper holds; read through the wrapper
            continue
        layer = getattr(module, "base_layer", module)
        prefix, _, leaf = name.rpartition(".")
        if isinstance(layer, VocabParallelEmbedding):
            vocab, hidden = layer.org_vocab_size, layer.embedding_dim
            table[name] = (vocab, hidden) if isinstance(layer, ParallelLMHead) else (hidden, vocab)
        elif hasattr(layer, "total_num_kv_heads") and leaf in FUSED_SLICES:  # QKVParallelLinear
            kv = layer.total_num_kv_heads
            sizes = (layer.total_num_heads * layer.head_size, kv * layer.head_size, kv * layer.v_head_size)
            for part, size in zip(FUSED_SLICES[leaf], sizes):
                table[f"{prefix}.{part}"] = (size, layer.hidden_size)
            table[name] = (sum(sizes), layer.hidden_size)  # adapters saved already stacked
            fused.add(leaf)
        elif hasattr(layer, "output_sizes") and leaf in FUSED_SLICES:  # MergedColumnParallelLinear
            for part, size in zip(FUSED_SLICES[leaf], layer.output_sizes):
                table[f"{prefix}.{part}"] = (size, layer.input_size)
            table[name] = (sum(layer.output_sizes), layer.input_size)
            fused.add(leaf)
        elif hasattr(layer, "input_size") and hasattr(layer, "output_size"):  # LinearBase
            table[name] = (layer.output_size, layer.input_size)
    lm_head = getattr(base_model, "lm_head", None)
    lm_head = getattr(lm_head, "base_layer", lm_head)
    if "lm_head" not in table and isinstance(lm_head, VocabParallelEmbedding):  # tied to embed_tokens
        table["lm_head"] = (lm_head.org_vocab_size, lm_head.embedding_dim)
    hf_keys = [key for key in table if key.rpartition(".")[2] not in fused]
    return _lookup(table), fused, sorted(hf_keys)


def _lookup(table: dict[str, tuple[int, int]]) -> ModuleDims:
    """``table.get``, falling back to the layer index and the name after ``layers.<i>.`` (the leaf
    for modules outside the layers), so a PEFT key whose prefix differs from the serving model's
    (``model.language_model.layers.0...`` against ``language_model.model.layers.0...``) is found."""
    by_position: dict[tuple, tuple[int, int]] = {}
    for name, dims in table.items():
        by_position.setdefault(_position(name), dims)
    return lambda key: table.get(key) or by_position.get(_position(key))


def _position(module_key: str) -> tuple:
    match = re.search(r"(?:^|\.)layers\.(\d+)\.(.+)$", module_key)
    return (int(match.group(1)), match.group(2)) if match else (None, module_key.rpartition(".")[2])


def hf_module_dims(model: torch.nn.Module) -> ModuleDims:
    """The :data:`ModuleDims` of a transformers model (on any device, ``meta`` included): its
    module names are PEFT's module keys."""
    table = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            table[name] = (module.out_features, module.in_features)
        elif isinstance(module, torch.nn.Embedding):
            table[name] = (module.embedding_dim, module.num_embeddings)
    return table.get


def hf_local_config(model_path: str, trust_remote_code: bool = False) -> Optional[Any]:
    """``model_path``'s transformers config, read from local files only (at argument validation,
    before SGLang loads the model), or None when transformers cannot read it (a hub id offline, an
    architecture it lacks): the adapters are then checked against the model when they load."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code, local_files_only=True)
    except Exception:  # noqa: BLE001 - best effort: never block a model SGLang can load; load-time checks still run
        return None


def hf_meta_model(config: Optional[Any], trust_remote_code: bool = False) -> Optional[torch.nn.Module]:
    """The transformers causal-LM of ``config`` (:func:`hf_local_config`) built on the ``meta``
    device (no weights are read), or None when there is no config or transformers cannot build it:
    the adapters are then checked against the model when they load."""
    from transformers import AutoModelForCausalLM

    if config is None:
        return None
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - best effort: never block a model SGLang can load; load-time checks still run
        return None


def hf_meta_dims(model_path: str, trust_remote_code: bool = False) -> Optional[ModuleDims]:
    """The :data:`ModuleDims` of :func:`hf_meta_model`, or None when it cannot be built."""
    model = hf_meta_model(hf_local_config(model_path, trust_remote_code), trust_remote_code)
    return None if model is None else hf_module_dims(model)


def _reject(plan: AdapterPlan, problem: str) -> None:
    raise AdapterRejected(f"LoRA adapter {plan.name!r} cannot be served: {problem}")
