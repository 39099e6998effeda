"""Plan refinement: choose the dense tier's plans by timing whole layers, not linears alone.

:mod:`benchmarks.plan_sweep` times each linear alone, with its route built outside the timing; a
layer builds one route per forward for its four linears and runs them back to back, and in a whole
layer some of the sweep's winners lose (docs/performance.md, "Why the graph misses remain"). This
takes the table the sweep wrote and, per group of the layer benchmark's grid of one phase
(``--phase``: graph-captured decode, or prefill, eager on the dense tier; a group is a model shape,
pool rank and token count: the key of a table row), runs coordinate descent over the four linears: for
each linear in turn, each alternative plan (the sweep's ``--top`` fastest for it at the point,
SGLang's own plan, the table's current one) is tried in the whole layer with the other linears'
plans fixed, and kept when the objective (below) falls by more than ``--margin``. The layer is the one
:mod:`benchmarks.layer` measures (its ``Server``, ``Case`` and ``measure_path``, every output
checked against float64), at every configuration of the group in that grid
(real rank 16 and 64 under a pool of 64, 16 under 16; 1, 4 and 8 adapters in decode, 1 and 8 in
prefill). The objective is
what the targets compare (issue 30): where ``triton_v2`` runs, the sum over the configurations of
``intel_xpu``'s LoRA overhead over ``triton_v2``'s (each path's layer time minus the base GEMMs',
both timed once per group before the descent), so that every configuration weighs alike, not
only the slowest ones; elsewhere (``--quick`` on CPU, an Intel GPU) the summed layer time. A
chosen plan that is not the table's becomes that row's spec (name suffixed ``.layer``, or
``.sglang`` for SGLang's plan), where the final re-measurement confirms the objective fell.

    python -m benchmarks.plan_refine --device cuda            # on the H200, after the sweep: rewrites configs/sm90.plans.json
    python -m benchmarks.plan_refine --device cuda --phase prefill --calls 8   # a table's 2048/8192-token prefill rows
                                                              # (the shipped sm90 table has none: SGLang's plans there)
    python -m benchmarks.plan_refine --device cuda --compile-only --shard 0/8   # fill Triton's cache in parallel first
    python -m benchmarks.plan_refine --quick                  # CPU smoke run (interpreter)

Writes ``plan-refine-<device>[-prefill][-quick][-<label> | -cut-short].json`` under ``--results`` (``-cut-short``:
no ``--label`` and the budget left groups out, ``groups_not_run``): per group the configurations'
``intel_xpu`` and ``triton_v2`` layer times before and after, and every evaluation.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
import types
from pathlib import Path
from typing import Optional

import torch

from benchmarks.common import GRAPH_DEVICES, MODELS, RESULTS, machine, use_sglang_triton_kernels
from benchmarks.layer import RANK_POINTS, TOLERANCE, Server, measure_path, reference
from benchmarks.ops import TINY, Case
from benchmarks.plan_sweep import DECODE_TOKENS, candidates, spec_label, spec_of

#: Adapter counts of the layer benchmark's grid per phase (graph decode; prefill).
ADAPTERS = {"decode": (1, 4, 8), "prefill": (1, 8)}
#: Prefill token counts refined by default: those the dense tier serves outside graphs
#: (``EAGER_DENSE_MIN_TOKENS`` and up) among the layer benchmark's.
PREFILL_TOKENS = (2048, 8192)


class ChosenPlans:
    """A plan source for the dense runner: ``chosen[(K, N)]`` where given, else ``table``'s."""

    def __init__(self, table, chosen: dict):
        self.table, self.chosen = table, chosen

    def plan_for(self, kind, phase, tokens, max_rank, in_features, out_features):
        plan = self.chosen.get((in_features, out_features))
        if plan is not None:
            return plan
        return self.table.plan_for(kind, phase, tokens, max_rank, in_features, out_features)


def sweep_ranking(paths: list[Path], phase: str, labels: Optional[set] = None) -> dict:
    """(model, linear, pool rank, tokens) -> the ``phase`` candidates' labels, fastest first, over
    one or more :mod:`benchmarks.plan_sweep` results files (e.g. an earlier full sweep and a sweep
    of new candidates only: their times are merged per point; a label measured twice keeps its
    faster time). With ``labels`` (the candidates this run can try), only those: the others (a
    retired kernel's, e.g. the grouped fused kernel's in ``plan-sweep-cuda-fused.json``) are left
    out, with a note.

    Raises:
        FileNotFoundError: a named results file is missing (a sweep's file not brought back from
            the machine that ran it would otherwise drop its candidates without a word).
    """
    missing = [str(path) for path in paths if not path.exists()]
    if missing:
        raise FileNotFoundError(f"sweep results not found: {', '.join(missing)} (untar the sweep's plan_sweep.tar here first)")
    times: dict = {}
    for path in paths:
        for entry in json.loads(path.read_text())["points"]:
            p = entry["point"]
            if p["phase"] != phase:
                continue
            point = times.setdefault((p["model"], p["linear"], p["pool_rank"], p["tokens"]), {})
            for c in entry["candidates"]:
                if "us" in c:
                    point[c["label"]] = min(c["us"], point.get(c["label"], float("inf")))
    if labels is not None:
        left_out = sorted({label for point in times.values() for label in point} - labels)
        if left_out:
            print(f"note: {len(left_out)} swept candidates are not this run's (retired, or another candidate set's), "
                  f"e.g. {left_out[0]}: not tried", flush=True)
        times = {key: {label: us for label, us in point.items() if label in labels} for key, point in times.items()}
    return {key: sorted(point, key=point.get) for key, point in times.items()}


def alternatives(model, linear: str, pool_rank: int, tokens: int, table, ranking: dict, args) -> list[tuple[str, object]]:
    """``(name, plan)`` (``DensePlan`` or ``FusedPlan``) tried for ``linear`` in a group: the
    table's current plan first, then SGLang's own plan (its table for ``args.architecture``) and
    the sweep's ``args.top`` fastest (by label, among the candidates of ``args.quick``'s set),
    without repeats."""
    from sglang.srt.lora.dense.plan import DenseLoraKind, DensePlanTable
    from sglang.srt.lora.utils import Phase

    from sglang_xpu_lora.dense.plans import plan_from_spec

    in_dim, outs = model.modules()[linear]
    kind, phase = DenseLoraKind.LINEAR, Phase(args.phase)
    found = [("table", table.plan_for(kind, phase, tokens, pool_rank, in_dim, sum(outs)))]
    found.append(("sglang", DensePlanTable(args.architecture, pool_rank).plan_for(kind, phase, tokens, in_dim, sum(outs))))
    by_label = {spec_label(spec): spec for spec in candidates(args.phase, args.quick)}
    for label in ranking.get((model.name, linear, pool_rank, tokens), [])[: args.top]:
        found.append((label, plan_from_spec(by_label[label])))
    unique, seen = [], set()
    for name, plan in found:
        key = json.dumps(spec_of(plan), sort_keys=True)
        if key not in seen:
            seen.add(key)
            unique.append((name, plan))
    return unique


def configurations(model, pool_rank: int, tokens: int, phase: str, device, dtype, quick: bool) -> list[tuple[Case, int]]:
    """The group's configurations of the layer benchmark's grid of ``phase``: ``(case, adapters)``."""
    ranks = [rank for max_rank, rank in RANK_POINTS if max_rank == pool_rank] or [pool_rank]
    return [
        (Case(model, pool_rank, adapters, tokens, phase, dtype, device, real_rank=rank), adapters)
        for rank, adapters in itertools.product(ranks, (2,) if quick else ADAPTERS[phase])
    ]


def layer_times(server: Server, configs: list, plans, args, path: str = "intel_xpu") -> tuple[list[float], list]:
    """Layer time (µs) of ``path`` at each of ``configs`` (inf where it fails) with ``plans`` as
    the dense tier's plan source (``intel_xpu``), and each configuration's result."""
    if path == "intel_xpu":
        server.backends[path].dense.plans = plans
    times, results = [], []
    for case, adapters, ref in configs:
        result = measure_path(server, path, case, args.mode, adapters, ref, args)
        results.append({k.removeprefix(f"{path}_"): v for k, v in result.items()})
        times.append(float("inf") if f"{path}_failed" in result else result[f"{path}_us"])
    return times, results


class Objective:
    """What the descent minimises for one group (module docstring): given ``base`` and ``peer``
    (``triton_v2``) layer times per configuration, the sum of ``(t - base) / (peer - base)``
    (each denominator at least 1 % of the peer's time, against timing noise); without them the
    sum of ``t``."""

    def __init__(self, base: Optional[list[float]] = None, peer: Optional[list[float]] = None):
        self.base, self.peer = base, peer

    def __call__(self, times: list[float]) -> float:
        if self.peer is None:
            return sum(times)
        return sum(
            (t - b) / max(p - b, 0.01 * p) for t, b, p in zip(times, self.base, self.peer)
        )


def refine_group(model, pool_rank: int, tokens: int, server: Server, table, ranking: dict, args) -> dict:
    """Coordinate descent over the linears of one group (module docstring); returns the group's record."""
    device, dtype = server.device, server.dtype
    configs = [(case, adapters, reference(server, case, adapters))
               for case, adapters in configurations(model, pool_rank, tokens, args.phase, device, dtype, args.quick)]
    options = {name: alternatives(model, name, pool_rank, tokens, table, ranking, args) for name in model.modules()}
    choice = {name: found[0] for name, found in options.items()}
    evaluations = []
    base_us = peer_us = peer = None
    if "triton_v2" in server.backends:
        base_us, _ = layer_times(server, configs, None, args, path="base")
        peer_us, peer = layer_times(server, configs, None, args, path="triton_v2")
    objective = Objective(base_us, peer_us) if peer_us is not None and all(t < float("inf") for t in peer_us) else Objective()

    def plans_of(trial: dict) -> ChosenPlans:
        return ChosenPlans(table, {
            (model.modules()[name][0], sum(model.modules()[name][1])): plan for name, (_, plan) in trial.items()
        })

    def evaluate(trial: dict) -> float:
        value = objective(layer_times(server, configs, plans_of(trial), args)[0])
        evaluations.append(dict(plans={name: label for name, (label, _) in trial.items()}, objective=value))
        return value

    first = best = evaluate(choice)
    for name in model.modules():
        for alternative in options[name][1:]:
            trial = {**choice, name: alternative}
            value = evaluate(trial)
            if value < best * (1 - args.margin):
                choice, best = trial, value
    after_us, after = layer_times(server, configs, plans_of(choice), args)
    before_us, before_rows = layer_times(server, configs, ChosenPlans(table, {}), args)
    return dict(
        model=model.name, phase=args.phase, pool_rank=pool_rank, tokens=tokens, configs=[(c.real_rank, a) for c, a, _ in configs],
        chosen={name: label for name, (label, _) in choice.items()},
        specs={name: spec_of(plan) for name, (label, plan) in choice.items() if label != "table"},
        objective="overhead over triton_v2's" if objective.peer is not None else "layer time",
        before_objective=objective(before_us), after_objective=objective(after_us), first_objective=first,
        before_us=sum(before_us), after_us=sum(after_us), base_us=base_us, triton_v2_us=peer_us,
        before=before_rows, after=after, triton_v2=peer, evaluations=evaluations,
    )


def rewrite_table(path: Path, groups: list[dict], models: dict) -> int:
    """Write each group's chosen non-table plans into the table's rows of their phase and point, only
    where the final re-measurement confirmed the objective fell; returns the rows rewritten."""
    payload = json.loads(path.read_text())
    rows, changed = payload["rows"], 0
    for group in groups:
        if not group["specs"] or not group["after_objective"] < group["before_objective"]:
            continue
        model = models[group["model"]]
        for name, spec in group["specs"].items():
            in_dim, outs = model.modules()[name]
            suffix = ".sglang" if group["chosen"][name] == "sglang" else ".layer"
            for row in rows:
                if (row["phase"], row["max_rank"], row["max_tokens"], row["min_in_features"], row["min_out_features"]) == (
                    group["phase"], group["pool_rank"], group["tokens"], in_dim, sum(outs)
                ):
                    row["spec"] = spec
                    row["name"] = row["name"].removesuffix(".sglang").removesuffix(".layer") + suffix
                    changed += 1
    path.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    return changed


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: a tiny layer, one group")
    parser.add_argument("--models", nargs="*", choices=list(MODELS))
    parser.add_argument("--phase", choices=("decode", "prefill"), default="decode",
                        help="the rows refined: decode (graph-captured layers) or prefill (eager layers, the dense tier)")
    parser.add_argument("--tokens", nargs="*", type=int,
                        help=f"token counts (default: decode {DECODE_TOKENS}, prefill {PREFILL_TOKENS})")
    parser.add_argument("--pool-ranks", nargs="*", type=int, help="pool ranks (default: decode 64 16, prefill 64)")
    parser.add_argument("--top", type=int, default=3, help="the sweep's fastest plans tried per linear")
    parser.add_argument("--margin", type=float, default=0.005, help="a change is kept when the objective falls by this fraction")
    parser.add_argument("--calls", type=int, default=30, help="back-to-back calls per timed round (prefill: try 8)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compile-only", action="store_true", help="run every alternative once outside graphs, no timing")
    parser.add_argument("--shard", default="0/1", help="i/n: only every n-th group from the i-th (parallel compile runs)")
    parser.add_argument("--budget-seconds", type=float, default=float("inf"), help="stop starting groups after this")
    parser.add_argument("--table", help="the plan table to refine (default: the shipped table of the device family)")
    parser.add_argument("--sweep", nargs="+", default=[str(RESULTS / "plan-sweep-cuda.json")],
                        help="the sweep's results (its rankings); several are merged per point")
    parser.add_argument("--results", default=str(RESULTS))
    parser.add_argument("--label", help="names this refinement's results file (so it does not replace an earlier one's)")
    args = parser.parse_args(argv)
    try:  # before anything is built or measured
        ranking = sweep_ranking([Path(f) for f in args.sweep], args.phase,
                                {spec_label(spec) for spec in candidates(args.phase, args.quick)})
    except FileNotFoundError as exc:
        parser.error(str(exc))
    if args.quick:
        args.device = "cpu"
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    use_sglang_triton_kernels(device)  # the linears on the dense tier (no native ops)
    from sglang_xpu_lora.dense.plans import CONFIG_DIR, PlanTable, device_family, sglang_architecture

    table_path = Path(args.table) if args.table else CONFIG_DIR / f"{device_family(device)}.plans.json"
    if args.quick and not args.table:
        table_path = Path(args.results) / "plan-refine-quick.plans.json"
        table_path.parent.mkdir(parents=True, exist_ok=True)
        table_path.write_text(json.dumps({"rows": []}) + "\n")
    os.environ["SGLANG_XPU_LORA_PLANS"] = str(table_path)  # the backend's own table is the one refined
    args.architecture = sglang_architecture(device)
    if args.phase == "prefill":
        args.mode = "prefill"
    else:
        args.mode = "graph" if device.type in GRAPH_DEVICES and not args.compile_only else "eager"
    if args.compile_only:
        args.calls = args.rounds = 1
    args.prefill_calls, args.prefill_rounds = args.calls, args.rounds
    args.tolerance = TOLERANCE[dtype]
    layer_args = types.SimpleNamespace(modes=[args.mode], emulated_build=None)
    models = {TINY.name: TINY} if args.quick else {m: MODELS[m] for m in (args.models or MODELS)}
    groups = [
        (model, rank, tokens)
        for model in models.values()
        for rank in ((16,) if args.quick else (args.pool_ranks or ((64,) if args.phase == "prefill" else (64, 16))))
        for tokens in ((8,) if args.quick else (args.tokens or (PREFILL_TOKENS if args.phase == "prefill" else DECODE_TOKENS)))
    ]
    shard, shards = (int(v) for v in args.shard.split("/"))
    records, started, not_run = [], time.perf_counter(), 0
    server = None
    todo = groups[shard::shards]
    for index, (model, rank, tokens) in enumerate(todo):
        if time.perf_counter() - started > args.budget_seconds:
            not_run = len(todo) - index
            print(f"budget spent: stopped before {model.name} rank {rank} tokens {tokens} ({not_run} groups not run)", flush=True)
            break
        if server is None or (server.model, server.max_rank) != (model, rank):
            server = None
            server = Server(model, rank, ["intel_xpu"] if args.quick else ["intel_xpu", "triton_v2"], dtype, device, layer_args)
            if args.mode != "graph":
                server.backends["intel_xpu"].eager_dense_min_tokens = 1  # the dense tier outside graphs too
        table = PlanTable(device, args.architecture)
        record = refine_group(model, rank, tokens, server, table, ranking, args)
        records.append(record)
        print(f"{model.name} rank {rank} tokens {tokens}: {record['objective']} {record['before_objective']:.3f} -> "
              f"{record['after_objective']:.3f}, layer {record['before_us']:.1f} -> {record['after_us']:.1f} us "
              f"({', '.join(f'{k}={v}' for k, v in record['chosen'].items())})", flush=True)
    if args.compile_only:
        return
    if not records:
        sys.exit(f"no group refined (budget {args.budget_seconds} s): nothing written")
    changed = rewrite_table(table_path, records, models)
    phase = "-prefill" if args.phase == "prefill" else ""
    label = f"-{args.label}" if args.label else ("-cut-short" if not_run else "")
    results = Path(args.results) / f"plan-refine-{device.type}{phase}{'-quick' if args.quick else ''}{label}.json"
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(dict(machine=machine(), args=vars(args), groups=records, groups_not_run=not_run),
                                  indent=1, default=str))
    print(f"{changed} rows of {table_path} rewritten; wrote {results}")


if __name__ == "__main__":
    main()
