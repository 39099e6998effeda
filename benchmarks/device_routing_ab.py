"""A/B of the portable ops' device routing against an earlier revision of the provider, same run.

Measures what a change to the device routing costs: one decoder layer's LoRA work (the cases of
:mod:`benchmarks.ops`: decode with 1 and 8 adapters, prefill), captured in a CUDA graph, with the
current provider and with a baseline module (an earlier ``providers/torch_ops.py``, self-contained
before the split into ``providers/torch_routing``). Also reports each side's peak memory and the
largest relative difference between their outputs (peak: memory allocated during one eager layer,
the case's weights and, for a baseline with mirrors, its LoRA-B mirrors included). Used for the cost of tenant isolation (per-row
selection instead of one-hot products over all slots), against commit 2153fd9::

    git show 2153fd9:src/sglang_xpu_lora/providers/torch_ops.py > /tmp/baseline_torch_ops.py
    python -m benchmarks.device_routing_ab --baseline /tmp/baseline_torch_ops.py

Writes ``benchmarks/results/device-routing-ab-cuda.{json,md}``; ``new/old`` is current graph time /
baseline graph time.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import sys
from pathlib import Path
from typing import Optional

import torch

from benchmarks import ops as op_bench
from benchmarks.common import MODELS, RESULTS, time_call, write


class ProcessCacheBaseline:
    """A baseline whose routing cache is process state (``begin_batch()``, before the per-batch
    ``RoutingCache``), called as the current provider is: each new ``routing`` starts its batch."""

    def __init__(self, module):
        self.module, self._routing = module, None

    def __getattr__(self, op):
        fn = getattr(self.module, op)

        def call(*args, routing=None, **kwargs):
            if routing is not self._routing:
                self._routing = routing
                self.module.begin_batch()
            return fn(*args, **kwargs)

        return call


def load_baseline(path: Path):
    """The baseline provider module (wrapped in :class:`ProcessCacheBaseline` when its routing cache
    is process state); its LoRA-B mirrors on when it has them (as its pool patch did)."""
    spec = importlib.util.spec_from_file_location("baseline_torch_ops", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    if hasattr(module, "keep_weight_mirrors"):
        module.keep_weight_mirrors()
    return ProcessCacheBaseline(module) if hasattr(module, "begin_batch") else module


@contextlib.contextmanager
def provider(module):
    """Run :mod:`benchmarks.ops`' portable calls through ``module``."""
    saved = op_bench.torch_ops
    op_bench.torch_ops = module
    try:
        yield
    finally:
        op_bench.torch_ops = saved


def measure(case, module, device, seconds) -> tuple[float, float, dict]:
    """(graph ms, peak MiB of one eager layer, outputs) of ``case`` through ``module``."""
    with provider(module):
        run = op_bench.layer(case.portable, case)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        case.begin_batch()
        outputs = {name: case.portable(name).float() for name in case.weights}
        peak = torch.cuda.max_memory_allocated() / 2**20
        return time_call(op_bench.graph(run, device), device, min_seconds=seconds) * 1e3, peak, outputs


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="an earlier providers/torch_ops.py")
    parser.add_argument("--seconds", type=float, default=0.25)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    device, dtype = torch.device("cuda"), torch.bfloat16
    baseline = load_baseline(args.baseline)
    current = op_bench.torch_ops
    points = [(m, r, a, t, "decode") for m, r, a, t in itertools.product(MODELS, (16, 64), (1, 8), (1, 16, 64, 256, 1024))]
    points += [(m, r, 8, t, "prefill") for m, r, t in itertools.product(MODELS, (16, 64), (2048, 8192))]
    rows = []
    for model, rank, adapters, tokens, mode in points:
        case = op_bench.Case(MODELS[model], rank, adapters, tokens, mode, dtype, device)
        row = dict(model=model, mode=mode, rank=rank, adapters=adapters, tokens=tokens)
        row["old_graph_ms"], row["old_peak_mib"], old_out = measure(case, baseline, device, args.seconds)
        row["new_graph_ms"], row["new_peak_mib"], new_out = measure(case, current, device, args.seconds)
        row["new/old"] = row["new_graph_ms"] / row["old_graph_ms"]
        row["max_rel_diff"] = max(float((new_out[n] - old_out[n]).abs().max() / old_out[n].abs().max()) for n in old_out)
        rows.append(row)
        print(row, flush=True)
        del case
        torch.cuda.empty_cache()
    columns = ["model", "mode", "rank", "adapters", "tokens", "old_graph_ms", "new_graph_ms", "new/old",
               "old_peak_mib", "new_peak_mib", "max_rel_diff"]
    write("device-routing-ab-cuda", rows, columns, args.out, extra={"baseline": str(args.baseline)})


if __name__ == "__main__":
    main()
