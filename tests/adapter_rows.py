"""The PEFT adapters of issue 12's table, built on the tiny Llama: those served exactly
(``SERVED``), those refused at load with the field or tensor to name (``REFUSED``), and the rank-64
adapter refused at start-up with ``--max-lora-rank 32`` (``TOO_BIG``); and issue 18's adapters
refused for their files, target modules or added tokens (:func:`build_broken`)."""

from __future__ import annotations

from sglang_cpu_devsupport.tiny_model import AdapterSpec

QV = ("q_proj", "v_proj")

#: Served exactly as PEFT computes them.
SERVED = (
    AdapterSpec("rslora-r16", rank=16, alpha=32, target_modules=QV, seed=11, lora_options={"use_rslora": True}),
    AdapterSpec("alpha-pattern", rank=8, alpha=16, target_modules=QV, seed=12, lora_options={"alpha_pattern": {"v_proj": 64}}),
    AdapterSpec("rank-pattern", rank=8, alpha=16, target_modules=QV, seed=13, lora_options={"rank_pattern": {"q_proj": 4}}),
    AdapterSpec(
        "rslora-patterns", rank=8, alpha=16, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"), seed=14,
        lora_options={"use_rslora": True, "rank_pattern": {"k_proj": 4, "o_proj": 12}, "alpha_pattern": {"v_proj": 8}},
    ),
    AdapterSpec("kv-only", rank=8, alpha=16, target_modules=("k_proj", "v_proj"), seed=15),
    AdapterSpec("v-only", rank=8, alpha=16, target_modules=("v_proj",), seed=16),
    AdapterSpec("qk-only", rank=8, alpha=16, target_modules=("q_proj", "k_proj"), seed=17),
    # A regular expression: layer 1 only, and up_proj without gate_proj.
    AdapterSpec("regex-targets", rank=8, alpha=16, target_modules=r"model\.layers\.1\..*\.(q_proj|up_proj)", seed=18),
)

#: Refused at load: (adapter, what the message must name).
REFUSED = (
    (AdapterSpec("modules-to-save", rank=8, alpha=16, target_modules=QV, seed=21, lora_options={"modules_to_save": ["embed_tokens"]}), "modules_to_save"),
    (AdapterSpec("lora-bias", rank=8, alpha=16, target_modules=QV, seed=22, lora_options={"lora_bias": True}), "lora_bias"),
    (AdapterSpec("bias-all", rank=8, alpha=16, target_modules=QV, seed=23, lora_options={"bias": "all"}), "'bias'"),
    (AdapterSpec("dora", rank=8, alpha=16, target_modules=QV, seed=24, lora_options={"use_dora": True}), "use_dora"),
    # Trained on a base with hidden size 64 (same module names): refused naming a tensor and shapes.
    (
        AdapterSpec("other-hidden", rank=8, alpha=16, target_modules=QV, seed=25, base_overrides={"hidden_size": 64, "head_dim": 16}),
        "expected (8, 128)",
    ),
)

#: Above ``--max-lora-rank 32``.
TOO_BIG = AdapterSpec("big-r64", rank=64, alpha=64, target_modules=QV, seed=26)

ALL = (*SERVED, *(spec for spec, _ in REFUSED), TOO_BIG)


def build(tiny_artifacts) -> dict:
    """Build (or reuse) every adapter above next to the session's tiny model; returns name -> path,
    with "base" the served base model."""
    from sglang_cpu_devsupport import tiny_model

    return tiny_model.build_all(tiny_artifacts["base"].parent, adapters=ALL)


def build_broken(good_adapter, root, vocab_size: int) -> dict:
    """Copies of ``good_adapter`` (a PEFT adapter directory for the tiny Llama) under ``root``, each
    broken one way, and a path that does not exist: name -> (path, what the refusal must say)."""
    import json
    import shutil

    def copy(name, drop=None, extra_targets=(), files=None, raw=None):
        out = root / name
        shutil.copytree(good_adapter, out)
        if drop:
            (out / drop).unlink()
        if extra_targets:
            config = json.loads((out / "adapter_config.json").read_text())
            config["target_modules"] = [*config["target_modules"], *extra_targets]
            (out / "adapter_config.json").write_text(json.dumps(config))
        for file, content in (files or {}).items():
            (out / file).write_text(json.dumps(content))
        for file, transform in (raw or {}).items():  # file -> bytes from its current bytes (b"" if none)
            (out / file).write_bytes(transform((out / file).read_bytes() if (out / file).exists() else b""))
        return out

    missing = root / "no-such-adapter"
    return {
        "missing-path": (missing, f"{missing}: the path does not exist"),
        "no-config": (copy("no-config", drop="adapter_config.json"), "has no adapter_config.json"),
        "no-weights": (copy("no-weights", drop="adapter_model.safetensors"), "has no adapter weights (adapter_model.safetensors"),
        "training-files-only": (  # SGLang's loader skips these; they are not weights
            copy("training-files-only", drop="adapter_model.safetensors",
                 raw={"training_args.bin": lambda _: b"not weights", "optimizer.pt": lambda _: b"not weights"}),
            "has no adapter weights (adapter_model.safetensors",
        ),
        "corrupt-weights": (
            copy("corrupt-weights", raw={"adapter_model.safetensors": lambda data: data[:1000]}),
            "Error while deserializing header",
        ),
        "invalid-config-json": (
            copy("invalid-config-json", raw={"adapter_config.json": lambda data: b"{" + data}),
            "Expecting property name enclosed in double quotes",
        ),
        "foreign-target": (
            copy("foreign-target", extra_targets=["query_key_value"]),
            "names ['query_key_value'], which the base model does not have",
        ),
        "added-tokens": (
            copy("added-tokens", files={"added_tokens.json": {"<s>": 1, "<sql>": vocab_size, "<end>": vocab_size + 1}}),
            f"adds 2 token(s) ('<sql>', '<end>') to the base model's vocabulary of {vocab_size}",
        ),
    }
