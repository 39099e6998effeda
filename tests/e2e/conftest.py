"""Shared end-to-end machinery: the tokenizer, a cached transformers + PEFT reference, a runner that
serves batches through a real engine in a fresh process, and runs that must leave nothing behind."""

from __future__ import annotations

import functools
import json
import os
import sys

import pytest
from sandbox import run_leaving_nothing

from sglang_cpu_devsupport import kernel_emulator, serving, tiny_model

MAX_NEW_TOKENS = serving.GREEDY_TOKENS
ADAPTERS = list(tiny_model.ADAPTER_NAMES)


@pytest.fixture(scope="session")
def tokenizer(tiny_artifacts):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_artifacts["base"])


@pytest.fixture(scope="session")
def hf_reference(tiny_artifacts, tokenizer):
    """``reference(prompt, adapter_name_or_None)`` -> (first-token log-probs over the vocabulary,
    float64; MAX_NEW_TOKENS greedy ids), cached."""

    @functools.lru_cache(maxsize=None)
    def reference(prompt, lora):
        adapter = tiny_artifacts[lora] if lora else None
        return serving.hf_reference(tiny_artifacts["base"], adapter, tokenizer.encode(prompt), MAX_NEW_TOKENS)

    return reference


@pytest.fixture(scope="session")
def run_engine(tiny_artifacts, tokenizer, tmp_path_factory):
    """``run(name, rounds, env, engine=None, adapters=ADAPTERS, tp_size=1, artifacts=None)`` serves
    each round in order through one engine in a fresh process, at ``--tp-size tp_size`` (with the CPU
    engine's TP settings, ``serving.cpu_env(tp_size=...)``), on ``artifacts`` (``{"base": ...,
    <adapter>: ...}``, the session's tiny Llama by default; the tokenizer is the same for every tiny
    base). A round is a list of ``(prompt, lora)``, a ``{"may_fail": [(prompt, lora), ...]}`` batch
    that ``Engine.generate`` may refuse, or a ``{"load": {...}}`` / ``{"unload": {...}}`` action (see
    ``sglang_cpu_devsupport.engine_batch``).

    Returns ``(results, kernels)``: per round, a dict ``(prompt, lora) -> output`` (the action's
    response for an action, ``{"error": message}`` for a refused ``may_fail`` batch); and the set
    of emulated sgl-kernel-xpu kernels that ran. Every run is checked to leave nothing in
    ``/dev/shm`` or its ``$TMPDIR`` (see :func:`run_leaving_nothing`).
    """

    def encode(batch):
        return {"prompts_ids": [tokenizer.encode(p) for p, _ in batch], "loras": [lora for _, lora in batch]}

    def request_of(batch):
        if isinstance(batch, list):
            return encode(batch)
        return {**encode(batch["may_fail"]), "may_fail": True} if "may_fail" in batch else batch

    def result_of(batch, out):
        if isinstance(batch, list):
            return dict(zip(batch, out))
        return dict(zip(batch["may_fail"], out)) if "may_fail" in batch and isinstance(out, list) else out

    def run(name, rounds, env, engine=None, adapters=ADAPTERS, tp_size=1, artifacts=None):
        work = tmp_path_factory.mktemp(name)
        spec = {
            "artifacts": {key: str(path) for key, path in (artifacts or tiny_artifacts).items()},
            "adapters": list(adapters),
            "rounds": [request_of(batch) for batch in rounds],
            "max_new_tokens": MAX_NEW_TOKENS,
            "vocab_size": tiny_model.VOCAB_SIZE,
            "engine": {**(engine or {}), **({"tp_size": tp_size} if tp_size > 1 else {})},
        }
        (work / "request.json").write_text(json.dumps(spec))
        log = work / "kernel_calls.log"
        child_env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_XPU_LORA")}
        child_env.update(serving.cpu_env(tp_size=tp_size), **env, **{kernel_emulator.LOG_ENV: str(log)})
        result, left = run_leaving_nothing(
            [sys.executable, "-m", "sglang_cpu_devsupport.engine_batch", str(work / "request.json"), str(work / "result.json")],
            child_env, work / "tmp", timeout=900,
        )
        assert result.returncode == 0, result.stdout[-4000:]
        assert left == [], f"the engine run left {left} behind"
        outputs = json.loads((work / "result.json").read_text())
        kernels = set(log.read_text().split()) if log.exists() else set()
        results = [result_of(batch, out) for batch, out in zip(rounds, outputs)]
        return results, kernels

    return run
