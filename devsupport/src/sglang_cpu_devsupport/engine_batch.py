"""Run batches through ``sglang.Engine`` in a fresh process and write the results as JSON.

Used by the end-to-end tests so that each configuration (kernel selector, emulated kernel build,
engine flags) gets its own process: SGLang loads plugins once per process and an emulated build
cannot be swapped out. Usage::

    python -m sglang_cpu_devsupport.engine_batch REQUEST.json RESULT.json

REQUEST: ``{"artifacts": {name: path}, "adapters": [...], "rounds": [{"prompts_ids": [[...]],
"loras": [...], "may_fail": bool} | {"load": {"lora_name": ..., "lora_path": ...}} | {"unload":
{"lora_name": ...}} | {"generate": {Engine.generate kwargs}, "async": bool}, ...], "max_new_tokens": n,
"vocab_size": v, "engine": {Engine kwargs overrides}}``.
Rounds run one after another (so a small ``max_loras_per_batch`` forces evictions between them);
``load``/``unload`` rounds call ``Engine.load_lora_adapter`` / ``unload_lora_adapter``; a
``generate`` round calls ``Engine.generate`` (``async_generate`` with ``"async": true``) with its
keyword arguments as given (greedy sampling unless they say otherwise) and may fail.
RESULT: one entry per round: for a batch, a list of ``{"output_ids": [...], "text": str,
"first_logprobs": [v floats]}``, or ``{"error": str}`` when ``Engine.generate`` raised in a batch
marked ``may_fail`` or in a ``generate`` round (elsewhere the run fails); for a ``generate`` round that
succeeded, ``{"output_ids": [[...] per prompt]}``; for load/unload, ``{"success": bool, "error": str,
"loaded": [the names SGLang reports loaded after it, sorted]}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(request_path: str, result_path: str) -> None:
    import sglang

    from sglang_cpu_devsupport import leftovers, serving

    request = json.loads(Path(request_path).read_text())
    paths = {name: Path(p) for name, p in request["artifacts"].items()}
    engine = sglang.Engine(**serving.engine_kwargs(paths, request["adapters"], **request.get("engine", {})))
    results = []
    try:
        for batch in request["rounds"]:
            if "load" in batch or "unload" in batch:
                action = engine.load_lora_adapter if "load" in batch else engine.unload_lora_adapter
                response = action(**(batch.get("load") or batch["unload"]))
                loaded = sorted(response.loaded_adapters or {})
                results.append({"success": bool(response.success), "error": response.error_message or "", "loaded": loaded})
                continue
            if "generate" in batch:
                results.append(generate_as_given(engine, batch, request["max_new_tokens"]))
                continue
            try:
                outputs = engine.generate(
                    input_ids=batch["prompts_ids"],
                    lora_path=batch["loras"],
                    sampling_params={"temperature": 0.0, "max_new_tokens": request["max_new_tokens"], "ignore_eos": True},
                    return_logprob=True,
                    top_logprobs_num=request["vocab_size"],
                )
            except Exception as exc:
                if not batch.get("may_fail"):
                    raise
                results.append({"error": str(exc)})
                continue
            results.append(
                [
                    {
                        "output_ids": out["output_ids"],
                        "text": out["text"],
                        "first_logprobs": serving.first_token_logprobs(out["meta_info"], request["vocab_size"]).tolist(),
                    }
                    for out in outputs
                ]
            )
    finally:
        leftovers.shutdown_engine(engine)
    Path(result_path).write_text(json.dumps(results))


def generate_as_given(engine, batch: dict, max_new_tokens: int) -> dict:
    """One ``generate`` round: ``{"output_ids": [[...] per prompt]}``, or ``{"error": message}``
    when the engine raised."""
    greedy = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    kwargs = {"sampling_params": greedy, **batch["generate"]}
    try:
        if batch.get("async"):
            outputs = engine.loop.run_until_complete(engine.async_generate(**kwargs))
        else:
            outputs = engine.generate(**kwargs)
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        return {"error": f"{type(exc).__name__}: {exc}"}
    outputs = outputs if isinstance(outputs, list) else [outputs]
    return {"output_ids": [out["output_ids"] for out in outputs]}


if __name__ == "__main__":
    main(*sys.argv[1:3])
