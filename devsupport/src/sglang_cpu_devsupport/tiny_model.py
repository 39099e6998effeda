"""Build a tiny Llama (or Gemma) model, its tokenizer and PEFT LoRA adapters locally (no hub access).

Everything is deterministic (fixed seeds, a sorted training corpus from the running interpreter's
standard library), so the tests and the example always see the same weights.
"""

from __future__ import annotations

import dataclasses
import json
import sysconfig
from pathlib import Path
from typing import Any, Optional, Sequence, Union

VOCAB_SIZE = 1024
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class AdapterSpec:
    """One PEFT LoRA adapter to build: ``name`` (directory and served name), rank, alpha, targets
    (module names, or a regular expression as PEFT accepts); ``lora_options``: further
    ``peft.LoraConfig`` arguments (``use_rslora``, ``alpha_pattern``, ...); ``base_overrides``:
    ``LlamaConfig`` changes of the base the adapter is trained on (an adapter for another model)."""

    name: str
    rank: int
    alpha: int
    target_modules: Union[Sequence[str], str] = ALL_LINEAR
    seed: int = 0
    lora_options: Optional[dict[str, Any]] = None
    base_overrides: Optional[dict[str, Any]] = None


DEFAULT_ADAPTERS = (
    AdapterSpec("sql-r8", rank=8, alpha=16, seed=1),
    AdapterSpec("doc-r16", rank=16, alpha=32, seed=2),
    AdapterSpec("qv-r4", rank=4, alpha=8, target_modules=("q_proj", "v_proj"), seed=3),
)
ADAPTER_NAMES = tuple(spec.name for spec in DEFAULT_ADAPTERS)
#: An adapter on the input embedding and the lm_head (plus q/v), rank below the pool's maximum.
EMBEDDING_ADAPTER = AdapterSpec("emb-head-r8", rank=8, alpha=16, target_modules=("embed_tokens", "lm_head", "q_proj", "v_proj"), seed=4)

#: The tiny base models by architecture: transformers' config and model class names and the settings
#: that differ from the shared ones. Gemma computes its logits from its ``embed_tokens`` (tied
#: word embeddings), which SGLang's Gemma hands to the logits processor as the lm_head. Its MLP uses
#: the exact GELU: SGLang 0.5.23's Gemma computes that whatever the config says, and transformers
#: reads "gelu" as the tanh form, "gelu_python" as the exact one.
#: The MoE models (routed experts in 4 experts of width 64, 2 per token; Qwen2-MoE adds a dense shared
#: expert of width 128) and GPT-2 (Conv1D c_attn, c_proj, c_fc; one key/value head per head) are the
#: models of the start-up refusals (SGLang's LoRA on routed experts, modules it has no LoRA layer for).
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": False}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"tie_word_embeddings": True, "hidden_act": "gelu_python"}),
    "qwen2_moe": (
        "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 128},
    ),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
}


def _train_tokenizer(out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = sorted(p for p in stdlib.glob("*.py"))[:80]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(p) for p in corpus], trainer)
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    ).save_pretrained(out_dir)


def _build_base(out_dir: Path, seed: int, architecture: str = "llama", **overrides: Any) -> None:
    import torch
    import transformers

    config_class, model_class, architecture_settings = ARCHITECTURES[architecture]
    settings = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        dtype="float32",
    )
    config = getattr(transformers, config_class)(**{**settings, **architecture_settings, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.08)
    model.save_pretrained(out_dir, safe_serialization=True)


def _build_adapter(base_dir: Path, out_dir: Path, spec: AdapterSpec) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    targets = spec.target_modules if isinstance(spec.target_modules, str) else list(spec.target_modules)
    options = {"lora_dropout": 0.0, "bias": "none", **(spec.lora_options or {})}
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=targets, task_type="CAUSAL_LM", **options)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:  # lora_A/lora_B and, for embeddings, lora_embedding_A/B
                # Nonzero B (PEFT initialises it to zero), so every adapter changes the output.
                std = 0.05 if "_B" in name else 0.1
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    peft_model.save_pretrained(out_dir, safe_serialization=True)


def build_all(
    root: Path,
    adapters: Sequence[AdapterSpec] = DEFAULT_ADAPTERS,
    seed: int = 0,
    progress: Optional[callable] = None,
    architecture: str = "llama",
) -> dict[str, Path]:
    """Build (or reuse) the tokenizer, base model (one of :data:`ARCHITECTURES`) and adapters under
    ``root``.

    Returns ``{"base": path, <adapter name>: path, ...}``. A directory is reused when its
    ``build.json`` matches the requested spec, so repeated runs cost nothing.
    """
    report = progress or (lambda message: None)
    root = Path(root)
    base_dir = root / f"tiny-{architecture}"
    paths = {"base": base_dir}
    base_key = {"seed": seed, "vocab": VOCAB_SIZE, "version": 1, "architecture": architecture}
    if not _is_built(base_dir, base_key):
        report("training the byte-level BPE tokenizer on the local standard library")
        base_dir.mkdir(parents=True, exist_ok=True)
        _train_tokenizer(base_dir)
        report(f"building the tiny {ARCHITECTURES[architecture][1]} base model (2 layers, hidden 128)")
        _build_base(base_dir, seed, architecture)
        _mark_built(base_dir, base_key)
    for spec in adapters:
        out = root / spec.name
        targets = spec.target_modules if isinstance(spec.target_modules, str) else list(spec.target_modules)
        key = {"base": base_key, **dataclasses.asdict(spec), "target_modules": targets}
        if not _is_built(out, key):
            trained_on = base_dir
            if spec.base_overrides:
                trained_on = root / f"{spec.name}-base"
                trained_on.mkdir(parents=True, exist_ok=True)
                _build_base(trained_on, seed, architecture, **spec.base_overrides)
            report(f"building PEFT LoRA adapter {spec.name} (rank {spec.rank}, target modules {targets})")
            _build_adapter(trained_on, out, spec)
            _mark_built(out, key)
        paths[spec.name] = out
    return paths


def _is_built(path: Path, key: dict) -> bool:
    stamp = path / "build.json"
    return stamp.exists() and json.loads(stamp.read_text()) == key


def _mark_built(path: Path, key: dict) -> None:
    (path / "build.json").write_text(json.dumps(key, sort_keys=True))
