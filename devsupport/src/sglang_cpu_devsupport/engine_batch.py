"""Run one mixed batch through ``sglang.Engine`` in a fresh process and write the results as JSON.

Used by the end-to-end tests so that each configuration (kernel selector, emulated kernel build)
gets its own process: SGLang loads plugins once per process and an emulated build cannot be
swapped out. Usage::

    python -m sglang_cpu_devsupport.engine_batch REQUEST.json RESULT.json

REQUEST: ``{"artifacts": {name: path}, "adapters": [...], "prompts_ids": [[...]], "loras": [...],
"max_new_tokens": n, "vocab_size": v, "engine": {extra Engine kwargs}}``.
RESULT: ``[{"output_ids": [...], "text": str, "first_logprobs": [v floats]}]`` per request.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(request_path: str, result_path: str) -> None:
    import sglang

    from sglang_cpu_devsupport import serving

    request = json.loads(Path(request_path).read_text())
    paths = {name: Path(p) for name, p in request["artifacts"].items()}
    engine = sglang.Engine(**serving.engine_kwargs(paths, request["adapters"], **request.get("engine", {})))
    try:
        outputs = engine.generate(
            input_ids=request["prompts_ids"],
            lora_path=request["loras"],
            sampling_params={"temperature": 0.0, "max_new_tokens": request["max_new_tokens"], "ignore_eos": True},
            return_logprob=True,
            top_logprobs_num=request["vocab_size"],
        )
    finally:
        engine.shutdown()
    results = [
        {
            "output_ids": out["output_ids"],
            "text": out["text"],
            "first_logprobs": serving.first_token_logprobs(out["meta_info"], request["vocab_size"]).tolist(),
        }
        for out in outputs
    ]
    Path(result_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:3])
