"""Layer profile: where a layer's time goes on the device, per path, from the profiler's kernels.

The layer benchmark (:mod:`benchmarks.layer`) gives one figure per path and point; this script
shows what makes it: for each point and path, the same layer made ready as the benchmark makes it
(:func:`benchmarks.layer.ready_path`: its graph replayed, or its eager layer called), ``--calls``
calls back to back under ``torch.profiler`` (CUDA or XPU kernels), and per call in steady state
(the first call dropped):

* ``period_us``: from one call's first kernel start to the next call's (what a server pays per
  layer, gaps included; median over the calls);
* ``kernel_us``: the kernels' summed time per call (kernels on a side stream overlap others, so
  this can exceed the period);
* ``kernels``: per kernel name, launches and time per call.

Used to tell a kernel difference from a measurement one: at 8192 prefill tokens on an H200 the
benchmark reads ``intel_xpu`` at 1.01-1.07x ``triton_v2``, while this profile shows both launching
the same kernels, with periods that differ between the paths by as much as between two profiles
of one path (``benchmarks/results/layer-profile-cuda*.json``, docs/performance.md).

    python -m benchmarks.layer_profile --device cuda        # the default points
    python -m benchmarks.layer_profile --device cuda --points llama-3.1-8b:graph:64:16:8:256

A point is ``model:mode:max_rank:rank:adapters:tokens`` (modes as the layer benchmark's). Writes
``layer-profile-<device>.{json,md}`` under ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import types
from pathlib import Path
from typing import Optional

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import MODELS, RESULTS, synchronize, write
from benchmarks.layer import Server, ready_path
from benchmarks.ops import Case

DEFAULT_POINTS = (
    "llama-3.1-8b:graph:64:16:8:1",
    "llama-3.1-8b:graph:64:16:8:32",
    "llama-3.1-8b:graph:64:16:8:256",
    "llama-3.1-8b:graph:64:64:8:256",
    "llama-3.3-70b-tp8:prefill:64:16:8:8192",
    "llama-3.3-70b-tp8:prefill:64:64:8:8192",
)
PATHS = ("base", "triton_v2", "intel_xpu")


def kernel_spans(prof) -> list[tuple[float, float, str]]:
    """``(start_us, end_us, name)`` of each device kernel ``prof`` recorded, by start time."""
    return sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type in (DeviceType.CUDA, DeviceType.XPU)
    )


def per_call(spans: list[tuple[float, float, str]], calls: int) -> dict:
    """Steady-state figures per call of ``calls`` calls that launched the same kernels each (module
    docstring), the first call dropped.

    Raises:
        ValueError: no kernels, kernels that do not split evenly into ``calls`` calls, or fewer
            than 3 calls.
    """
    if calls < 3 or not spans or len(spans) % calls:
        raise ValueError(f"{len(spans)} kernels do not split into {calls} calls of the same kernels")
    size = len(spans) // calls
    groups = [spans[i * size:(i + 1) * size] for i in range(1, calls)]
    periods = [later[0][0] - earlier[0][0] for earlier, later in zip(groups, groups[1:])]
    kernels: dict = collections.defaultdict(lambda: [0, 0.0])
    for group in groups:
        for start, end, name in group:
            kernels[name][0] += 1
            kernels[name][1] += end - start
    steady = len(groups)
    return {
        "period_us": statistics.median(periods),
        "kernel_us": sum(end - start for g in groups for start, end, _ in g) / steady,
        "kernels": {
            name: {"launches": count / steady, "us": total / steady}
            for name, (count, total) in sorted(kernels.items(), key=lambda kv: -kv[1][1])
        },
    }


def profile_point(server: Server, path: str, case: Case, mode: str, adapters: int, calls: int) -> dict:
    """:func:`per_call` of ``path`` at one point."""
    call, _ = ready_path(server, path, case, mode, adapters)
    call()
    synchronize(server.device)
    activity = ProfilerActivity.XPU if server.device.type == "xpu" else ProfilerActivity.CUDA
    with profile(activities=[activity]) as prof:
        for _ in range(calls):
            call()
        synchronize(server.device)
    return per_call(kernel_spans(prof), calls)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--points", default=",".join(DEFAULT_POINTS))
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    paths = args.paths.split(",")
    server_args = types.SimpleNamespace(modes=["graph", "prefill", "eager"], emulated_build=None)
    rows, servers = [], {}
    for point in args.points.split(","):
        model, mode, max_rank, rank, adapters, tokens = point.split(":")
        max_rank, rank, adapters, tokens = int(max_rank), int(rank), int(adapters), int(tokens)
        if (model, max_rank) not in servers:
            servers.clear()
            servers[(model, max_rank)] = Server(MODELS[model], max_rank, paths, torch.bfloat16, device, server_args)
        server = servers[(model, max_rank)]
        case = Case(server.model, max_rank, max(adapters, 1), tokens, "prefill" if mode == "prefill" else "decode",
                    torch.bfloat16, device, real_rank=rank or max_rank)
        for path in paths:
            row = dict(model=model, mode=mode, max_rank=max_rank, rank=rank, adapters=adapters, tokens=tokens, path=path)
            try:
                row.update(profile_point(server, path, case, mode, adapters, args.calls))
            except Exception as exc:
                row["failed"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            rows.append(row)
            print(point, path, {k: round(v, 1) for k, v in row.items() if k.endswith("_us")}, row.get("failed", ""), flush=True)
    columns = ["model", "mode", "max_rank", "rank", "adapters", "tokens", "path", "period_us", "kernel_us", "failed"]
    print(write(f"layer-profile-{device.type}", rows, columns, args.out, {"calls": args.calls}))


if __name__ == "__main__":
    main()
