"""Tile candidates of the eager linears' compiled-handle launches, in batches with long segments.

:class:`~sglang_xpu_lora.providers.triton_launch.TritonLinearLaunches` launches SGLang's legacy
Triton LoRA kernels with SGLang's tiles, except in batches whose longest segment has
``long_segment_rows`` rows or more (prefill), where it uses ``long_segment_tiles``. This measures
``intel_xpu``'s layer (the layer benchmark's ``Server``, ``Case`` and ``measure_path``: base GEMMs
plus LoRA, every output checked against float64) at the layer benchmark's prefill points below the
dense tier's threshold, once per candidate, and writes each candidate's layer time per point and
its ratio to SGLang's tiles (``sglang``, the first candidate).

    python -m benchmarks.launch_tiles --device cuda       # on the H200: launch-tiles-cuda.json
    python -m benchmarks.launch_tiles --quick             # CPU smoke run (interpreter, tiny layer)
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import types
from pathlib import Path

import torch

from benchmarks.common import MODELS, RESULTS, machine, use_sglang_triton_kernels
from benchmarks.layer import RANK_POINTS, TOLERANCE, Server, measure_path, reference
from benchmarks.ops import TINY, Case

#: name -> (Tiles fields: rows, shrink, expand_one, expand_bands; from how many segment rows).
CANDIDATES = {
    "sglang": ((16, (16, 256), (256, 16), (64, 16)), 1 << 30),
    "r64-s32x128-o128-b64": ((64, (32, 128), (128, 16), (64, 16)), 64),
    "r32-s32x128-o128-b64": ((32, (32, 128), (128, 16), (64, 16)), 32),
    "r64-s64x64-o64x32-b64x32": ((64, (64, 64), (64, 32), (64, 32)), 64),
    "r128-s32x128-o128-b128": ((128, (32, 128), (128, 16), (128, 16)), 64),
    "r64-s16x256-o256-b128": ((64, (16, 256), (256, 16), (128, 16)), 64),
    "r64-s64x128-o128-b128": ((64, (64, 128), (128, 16), (128, 16)), 64),
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: a tiny layer, two candidates")
    parser.add_argument("--tokens", nargs="*", type=int, default=[512, 2048])
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--results", default=str(RESULTS))
    args = parser.parse_args(argv)
    if args.quick:
        args.device = "cpu"
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    use_sglang_triton_kernels(device)
    from sglang_xpu_lora.providers.triton_launch import Tiles

    measure_args = types.SimpleNamespace(
        calls=args.calls, rounds=args.rounds, prefill_calls=args.calls, prefill_rounds=args.rounds,
        tolerance=TOLERANCE[dtype],
    )
    layer_args = types.SimpleNamespace(modes=["prefill"], emulated_build=None)
    models = [TINY] if args.quick else list(MODELS.values())
    candidates = dict(itertools.islice(CANDIDATES.items(), 2)) if args.quick else CANDIDATES
    tokens = [80] if args.quick else args.tokens
    points, times = [], {name: {} for name in candidates}
    for model, (max_rank, rank) in itertools.product(models, [(16, 8)] if args.quick else RANK_POINTS[:2]):
        server = Server(model, max_rank, ["intel_xpu"], dtype, device, layer_args)
        launches = server.backends["intel_xpu"].triton_launches
        for adapters, count in itertools.product((1, 8), tokens):
            case = Case(model, max_rank, adapters, count, "prefill", dtype, device, real_rank=rank)
            ref = reference(server, case, adapters)
            point = f"{model.name}|{max_rank}|{rank}|{adapters}|{count}"
            points.append(point)
            for name, (fields, rows) in candidates.items():
                launches.long_segment_tiles, launches.long_segment_rows = Tiles(*fields), rows
                result = measure_path(server, "intel_xpu", case, "prefill", adapters, ref, measure_args)
                times[name][point] = result.get("intel_xpu_us") if "intel_xpu_failed" not in result else None
                print(f"{point} {name}: {times[name][point]}", flush=True)
    summary = {}
    for name in candidates:
        ratios = [times[name][p] / times["sglang"][p] for p in points if times[name][p] and times["sglang"][p]]
        summary[name] = dict(median=statistics.median(ratios), min=min(ratios), max=max(ratios),
                             failed=[p for p in points if times[name][p] is None])
        print(f"{name}: layer time / SGLang's tiles median {summary[name]['median']:.3f} "
              f"({summary[name]['min']:.3f}-{summary[name]['max']:.3f})", flush=True)
    out = Path(args.results) / f"launch-tiles-{device.type}{'-quick' if args.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(machine=machine(), args=vars(args), candidates=candidates, points=points,
                                   us=times, summary=summary), indent=1, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
