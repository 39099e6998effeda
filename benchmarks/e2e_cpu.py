"""End to end on CPU: the real engine on the project's tiny model with 8 adapters (and with 1),
decode-heavy and prefill-heavy workloads (fixed seeds, fresh prompts in every repeat so that no
repeat is served from the radix cache, ``ignore_eos``), tokens/s of ``intel_xpu``
(portable kernels) against SGLang's ``torch_native`` LoRA backend, min/median/max over repeats.

    python -m benchmarks.e2e_cpu [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path
from typing import Optional

from benchmarks.common import RESULTS, write

WORKLOADS = {
    # name: (requests, prompt tokens, output tokens)
    "decode-heavy": (32, 8, 128),
    "prefill-heavy": (32, 512, 4),
}


def adapters(count: int):
    from sglang_cpu_devsupport import tiny_model

    return tuple(tiny_model.AdapterSpec(f"bench-r{8 + 8 * (i % 2)}-{i}", rank=8 + 8 * (i % 2), alpha=16, seed=100 + i) for i in range(count))


def run_backend(backend: str, paths, names, workload, repeats, quick) -> list[float]:
    import sglang

    from sglang_cpu_devsupport import leftovers, serving

    requests, prompt_len, output_len = workload
    if quick:
        requests, prompt_len, output_len = 4, min(prompt_len, 64), min(output_len, 8)
    def prompts(seed: int) -> list[list[int]]:  # fresh prompts per repeat: no radix-cache hits
        rng = random.Random(seed)
        return [[rng.randrange(3, 1000) for _ in range(prompt_len)] for _ in range(requests)]

    loras = [names[i % len(names)] for i in range(requests)]
    engine = sglang.Engine(**serving.engine_kwargs(paths, names, lora_backend=backend, max_loras_per_batch=len(names)))
    try:
        params = {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True}
        engine.generate(input_ids=prompts(0)[:2], lora_path=loras[:2], sampling_params=params)  # warm-up
        rates = []
        for repeat in range(repeats):
            batch = prompts(repeat + 1)
            start = time.perf_counter()
            engine.generate(input_ids=batch, lora_path=loras, sampling_params=params)
            elapsed = time.perf_counter() - start
            rates.append(requests * (prompt_len + output_len if output_len < 16 else output_len) / elapsed)
        return rates
    finally:
        leftovers.shutdown_engine(engine)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny workloads, one repeat: the smoke test")
    parser.add_argument("--artifacts", type=Path, default=Path("artifacts"))
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    from sglang_cpu_devsupport import CPU_ENGINE_ENV, tiny_model

    os.environ.update(CPU_ENGINE_ENV, SGLANG_XPU_LORA_KERNELS="torch")
    specs = adapters(2 if args.quick else 8)
    paths = tiny_model.build_all(args.artifacts, adapters=specs)
    repeats = 1 if args.quick else args.repeats
    rows = []
    workloads = {"decode-heavy": WORKLOADS["decode-heavy"]} if args.quick else WORKLOADS
    for count in (len(specs),) if args.quick else (len(specs), 1):
        names = [s.name for s in specs[:count]]
        for workload_name, workload in workloads.items():
            row = {"adapters": count, "workload": workload_name}
            for backend in ("intel_xpu", "torch_native"):
                rates = run_backend(backend, paths, names, workload, repeats, args.quick)
                row[f"{backend}_tok_s"] = statistics.median(rates)
                row[f"{backend}_min_max"] = f"{min(rates):.0f}-{max(rates):.0f}"
            row["ratio"] = row["intel_xpu_tok_s"] / row["torch_native_tok_s"]
            rows.append(row)
            print(row, flush=True)
    write("e2e-cpu" + ("-quick" if args.quick else ""), rows,
          ["adapters", "workload", "intel_xpu_tok_s", "intel_xpu_min_max", "torch_native_tok_s", "torch_native_min_max", "ratio"],
          args.out, extra={"workloads": WORKLOADS, "repeats": repeats})


if __name__ == "__main__":
    main()
