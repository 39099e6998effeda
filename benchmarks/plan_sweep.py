"""Plan sweep: measure every candidate plan of the dense tier per linear, write the winners as a plan
table (:mod:`sglang_xpu_lora.dense.plans`, SGLang's ``plans.json`` schema).

Per point (model shape, linear, pool rank, tokens) it builds one
:class:`~sglang_xpu_lora.dense.runner.DeviceDenseRunner` batch (``--adapters`` adapters of real rank
``--real-rank`` over :data:`benchmarks.ops.MAX_LORAS` slots, distinct scalings, requests spread over
the adapters as :class:`benchmarks.ops.Case` spreads them), then for each candidate plan runs the
linear as SGLang's layers do (``apply``: base GEMM ``F.linear`` + LoRA, overlapped as the plan says),
checks the output against float64 (``--tolerance``, bf16: 2e-2; a candidate over it is dropped and
recorded), and times it: decode points captured in a CUDA/XPU graph (:func:`benchmarks.common.capture`,
then :func:`benchmarks.common.replay_time`), prefill points eagerly. The route is built by the
warm-up and kept (a layer builds it once per forward for all its linears), so each figure is the
linear's own cost. The winner of each point becomes one row: phase, ``max_tokens`` (the point's
tokens: a call takes the row of the smallest measured count at or above its own), ``max_rank``
(the pool rank), and the linear's exact K and N. Calls outside the measured shapes fall through to
SGLang's table (:class:`~sglang_xpu_lora.dense.plans.PlanTable`).

Candidates (:func:`candidates`, ``--candidates``, ``--overlaps``): decode: overlap ``none`` / ``a``
/ ``ab_delta`` x shrink grouped split-K 4/8/16, per-row, all-slots x expand grouped or per-row with
``BLOCK_SIZE_N`` 64/128 (all-slots: per-row expand only), route block 16; and the fused per-row
kernel (:mod:`sglang_xpu_lora.dense.fused`), overlap ``none`` / ``ab_delta`` x ``BLOCK_SIZE_N``
64/128/256 x ``BLOCK_SIZE_K`` 128/256/512 (capped per pool rank: ``shrink_k_tile``) x 4/8 warps (one
stage: offline sm90 compiles had no asynchronous copies to pipeline at 2 or 3); 90 in all. Prefill:
overlap ``none`` / ``a`` x grouped shrink split-K 1/4 x grouped expand ``BLOCK_SIZE_N`` 64/128 x
route block 32/64/128.

    python -m benchmarks.plan_sweep --device cuda                       # H200: writes configs/sm90.plans.json
    python -m benchmarks.plan_sweep --device xpu --out my.plans.json --compile-jobs 8   # an Intel GPU (examples/xpu/measure.sh)
    python -m benchmarks.plan_sweep --quick                             # CPU smoke run (interpreter)
    python -m benchmarks.plan_sweep --quick --device xpu                # the tiny grid on a GPU (the kit's QUICK=1)
    bash benchmarks/run_plan_gpu.sh plan_sweep                          # on the H200: compile in parallel, then time
    python -m benchmarks.plan_sweep --use-sglang-plans decode:16:8 decode:64:1:llama-3.1-8b   # rows where a layer run preferred SGLang's
    python -m benchmarks.plan_sweep --candidates fused --phases decode --tokens 1 8 32 --out /tmp/fused.plans.json
        # the fused kernel alone, ranked in plan-sweep-cuda-fused.json (--overlaps: only some overlaps); then, in
        # whole layers against the shipped table, with the full sweep's ranking merged in:
    python -m benchmarks.plan_refine --tokens 1 8 32 --sweep benchmarks/results/plan-sweep-cuda.json benchmarks/results/plan-sweep-cuda-fused.json

The sweep times each linear alone; a whole layer can prefer other plans (the route a layer builds
once serves several linears). Where the layer benchmark measured SGLang's own plans faster,
``--use-sglang-plans`` writes SGLang's plan into those rows (names ending ``.sglang``).

Triton compiles each kernel specialisation once (seconds each; hundreds here): ``--compile-only
--shard i/n`` runs fill its cache from several processes first, without timing anything;
``--compile-jobs n`` starts those ``n`` runs itself, waits for them, then times (a shard that fails
is reported and the timed sweep compiles what it left). ``--budget-seconds`` covers both.

Writes the table to ``--out`` (default: the shipped table of the device family, written whole from
this sweep's winners: so a sweep of a subset, :func:`partial_sweep`, needs ``--out``, and one the
budget cut short writes ``plan-sweep-<device>-cut-short.plans.json`` under ``--results`` instead)
and every measured candidate to ``plan-sweep-<device>[-quick][-fused|-sglang][-<label> | -cut-short].json``
under ``--results`` (``-cut-short``: no ``--label`` nor ``--out`` and the budget left points out; with those
points, ``points_not_run``, and the compile runs, ``compile_jobs``). A run that swept no point
writes nothing and exits non-zero.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import GRAPH_DEVICES, MODELS, RESULTS, capture, machine, replay_time
from benchmarks.ops import MAX_LORAS, TINY, Case, reference_output

A_TILES = {"BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 8, "num_warps": 4, "num_stages": 3}
B_TILES = {"BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 8, "num_warps": 4, "num_stages": 2}
DECODE_TOKENS = (1, 8, 32, 64, 128, 256)
PREFILL_TOKENS = (512, 2048, 8192)
#: Pool ranks swept (``--max-lora-rank``); adapters run at ``--real-rank`` (at most the pool rank).
POOL_RANKS = (64, 16)


def candidates(phase: str, quick: bool = False, families: str = "all", overlaps=None) -> list[dict]:
    """Plan specs (JSON values) tried at a point of ``phase``: ``DensePlan`` fields (SGLang's
    kernels) and, in decode, the fused per-row kernel's (:class:`~sglang_xpu_lora.dense.fused.FusedPlan`);
    ``families``: ``all``, ``sglang`` or ``fused`` (only those); ``overlaps``: only the plans of
    these overlaps (names; None: every one)."""
    specs = []
    if phase == "decode":
        shrinks = [("grouped", {"SPLIT_K": k}) for k in (4, 8, 16)] + [("per_row", {}), ("all_slots", {})]
        for overlap, (a_family, a_extra), b_family, block_n in itertools.product(
            ("none", "a", "ab_delta"), shrinks, ("grouped", "per_row"), (64, 128)
        ):
            if a_family == "all_slots" and b_family != "per_row":
                continue
            specs.append(dict(
                a_family=a_family, b_family=b_family, overlap=overlap, block_size=16,
                a_tiles={**A_TILES, **a_extra}, b_tiles={**B_TILES, "BLOCK_SIZE_N": block_n},
            ))
    else:
        for overlap, split_k, block_n, block in itertools.product(("none", "a"), (1, 4), (64, 128), (32, 64, 128)):
            specs.append(dict(
                a_family="grouped", b_family="grouped", overlap=overlap, block_size=block,
                a_tiles={**A_TILES, **({"SPLIT_K": split_k} if split_k > 1 else {})},
                b_tiles={**B_TILES, "BLOCK_SIZE_N": block_n, "num_warps": 8},
            ))
    fused = []
    if phase == "decode":
        for overlap, block_n, block_k, warps in itertools.product(("none", "ab_delta"), (64, 128, 256), (128, 256, 512), (4, 8)):
            tiles = {"BLOCK_SIZE_N": block_n, "BLOCK_SIZE_K": block_k, "num_warps": warps, "num_stages": 1}
            fused.append(dict(fused="per_row", tiles=tiles, overlap=overlap))
    if quick:  # the interpreter: small tiles, a few of each family
        small = {"BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 16, "GROUP_SIZE_M": 8, "num_warps": 4, "num_stages": 1}
        specs = [
            {**s, "block_size": 16, "a_tiles": {**small, **{k: v for k, v in s["a_tiles"].items() if k == "SPLIT_K"}}, "b_tiles": small}
            for s in specs[:: max(1, len(specs) // 4)]
        ]
        firsts = [next(spec for spec in fused if spec["overlap"] == overlap) for overlap in ("none", "ab_delta")] if fused else []
        fused = [{**spec, "tiles": {**spec["tiles"], "BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 16}} for spec in firsts]
    chosen = {"all": specs + fused, "sglang": specs, "fused": fused}[families]
    return [spec for spec in chosen if overlaps is None or spec["overlap"] in overlaps]


def spec_label(spec: dict) -> str:
    if "fused" in spec:
        tiles = spec["tiles"]
        return (f"{spec['overlap']}|fused:{spec['fused']}/n{tiles['BLOCK_SIZE_N']}/k{tiles['BLOCK_SIZE_K']}"
                f"/w{tiles['num_warps']}/s{tiles['num_stages']}")
    split = spec["a_tiles"].get("SPLIT_K", 1)
    return (
        f"{spec['overlap']}|A:{spec['a_family']}{f'/sk{split}' if split > 1 else ''}"
        f"|B:{spec['b_family']}/n{spec['b_tiles']['BLOCK_SIZE_N']}|block{spec['block_size']}"
    )


def request_view(case: Case) -> types.SimpleNamespace:
    """SGLang's request view of the case's batch (what the dense tier binds per batch)."""
    lens = torch.tensor(case.request_lens, dtype=torch.int32)
    seg_indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    seg_indptr[1:] = torch.cumsum(lens, 0)
    return types.SimpleNamespace(
        seg_indptr=seg_indptr.to(case.device),
        weight_indices=torch.tensor(case.request_slots, dtype=torch.int32, device=case.device),
        lora_ranks=case.ranks, scalings=case.scalings, max_len=max(case.request_lens),
    )


def sweep_point(case: Case, name: str, phase: str, args) -> dict:
    """Every candidate for linear ``name`` of ``case``'s batch: ``{"point": ..., "candidates":
    [{label, spec, us | failed}], "best": label}``."""
    from sglang.srt.lora.dense.plan import DenseLoraKind
    from sglang.srt.lora.utils import Phase

    from sglang_xpu_lora.dense.plans import PlanRow, PlanTable
    from sglang_xpu_lora.dense.runner import DeviceDenseRunner
    from sglang_xpu_lora.dense.workspace import DeviceLoraWorkspace

    model, pool_rank, tokens, device, dtype = case.model, case.rank, case.tokens, case.device, case.inputs[name].dtype
    a, b, outs = case.weights[name]
    x = case.inputs[name]
    gen = torch.Generator(device="cpu").manual_seed(7)
    weight = (torch.randn(sum(outs), x.shape[1], generator=gen) * x.shape[1] ** -0.5).to(device, dtype)
    ref = x.double() @ weight.double().t() + reference_output(case, name)
    offsets = (0, *itertools.accumulate(outs))
    graph = phase == "decode" and device.type in GRAPH_DEVICES
    point = dict(model=model.name, linear=name, K=x.shape[1], N=offsets[-1], pool_rank=pool_rank,
                 real_rank=case.real_rank, adapters=args.adapters, tokens=tokens, phase=phase)
    results = []
    for spec in candidates(phase, args.quick, args.candidates, args.overlaps):
        label = spec_label(spec)
        runner = DeviceDenseRunner(DeviceLoraWorkspace(), max_loras=MAX_LORAS, device=device)
        runner.plans = PlanTable(device, "default", rows=[PlanRow({"name": label, "spec": spec})])
        if graph:
            runner.allocate_graph_token_slots(tokens, prefill=False)
        runner.begin_lora_batch(request_view(case), requests=len(case.request_lens), num_tokens=tokens,
                                phase=Phase(phase), graph=graph)

        def forward():
            return runner.apply(x, lambda: F.linear(x, weight), runner.plan_for(DenseLoraKind.LINEAR, pool_rank, x.shape[1], offsets[-1], num_tokens=tokens),
                                a=a, b=b, offsets=offsets)

        try:
            out = forward()
            error = float((out.double() - ref).abs().max() / ref.abs().max())
            if not error <= args.tolerance:
                results.append(dict(label=label, spec=spec, failed=f"output error {error:.3g}"))
                continue
            if args.compile_only:
                results.append(dict(label=label, spec=spec, error=error))
                continue
            if graph:
                g, _ = capture(forward, device)
                seconds, spread = replay_time(g.replay, device, calls=args.calls, rounds=args.rounds)
                del g
            else:
                seconds, spread = replay_time(forward, device, calls=max(2, args.calls // 4), rounds=args.rounds)
            results.append(dict(label=label, spec=spec, us=seconds * 1e6, spread=spread, error=error))
        except Exception as exc:  # noqa: BLE001 - recorded per candidate
            results.append(dict(label=label, spec=spec, failed=f"{type(exc).__name__}: {str(exc)[:200]}"))
        del runner
    timed = [r for r in results if "us" in r]
    best = min(timed, key=lambda r: r["us"]) if timed else None
    return dict(point=point, candidates=results, best=None if best is None else best["label"])


def table_rows(points: list[dict]) -> list[dict]:
    """One row per swept point with a winner, ordered so the first match is the point's own: per
    (phase, pool rank, K, N), token bounds ascending; pool ranks ascending (a row admits pools up
    to its rank)."""
    rows = []
    for entry in points:
        if entry["best"] is None:
            continue
        p = entry["point"]
        spec = next(c["spec"] for c in entry["candidates"] if c["label"] == entry["best"])
        rows.append(dict(
            name=f"{p['phase']}.{p['model']}.{p['linear']}.rank_le{p['pool_rank']}.tokens_le{p['tokens']}",
            phase=p["phase"], kinds=["linear"], max_tokens=p["tokens"], max_rank=p["pool_rank"],
            min_in_features=p["K"], max_in_features=p["K"], min_out_features=p["N"], max_out_features=p["N"], spec=spec,
        ))
    rows.sort(key=lambda r: (r["phase"], r["max_rank"], r["min_in_features"], r["min_out_features"], r["max_tokens"]))
    return rows


def spec_of(plan) -> dict:
    """A plan (``DensePlan`` or ``FusedPlan``) as a row's JSON ``spec``."""
    if hasattr(plan, "spec"):
        return plan.spec()
    return dict(a_family=plan.a_family.value, b_family=plan.b_family.value, overlap=plan.overlap.value,
                block_size=plan.block_size, a_tiles=dict(plan.a_tiles), b_tiles=dict(plan.b_tiles))


def use_sglang_plans(table: Path, architecture: str, where: list[str]) -> int:
    """Rewrite the rows of ``table`` selected by ``where`` with SGLang's own plan for their point
    (``DensePlanTable(architecture, pool rank)`` at the row's token bound, K and N), their names
    suffixed ``.sglang``: for points where the layer benchmark measured SGLang's plans faster in a
    whole layer than the sweep's per-linear winners. Each entry of ``where`` is
    ``phase:pool_rank:tokens[:model]``. Returns the number of rows rewritten."""
    from sglang.srt.lora.dense.plan import DenseLoraKind, DensePlanTable
    from sglang.srt.lora.utils import Phase

    selectors = [entry.split(":") for entry in where]
    rows = json.loads(table.read_text())["rows"]
    changed = 0
    for row in rows:
        for phase, rank, tokens, *model in selectors:
            if (row["phase"], row["max_rank"], row["max_tokens"]) != (phase, int(rank), int(tokens)):
                continue
            if model and f".{model[0]}." not in row["name"]:
                continue
            plan = DensePlanTable(architecture, row["max_rank"]).plan_for(
                DenseLoraKind.LINEAR, Phase(phase), row["max_tokens"], row["min_in_features"], row["min_out_features"])
            row["spec"] = spec_of(plan)
            row["name"] = row["name"].removesuffix(".sglang") + ".sglang"
            changed += 1
    table.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    return changed


def grid(args) -> list[tuple]:
    """``(model, linear, pool rank, tokens, phase)`` of the run."""
    if args.quick:
        return [(TINY, "qkv", 16, 8, "decode"), (TINY, "down", 16, 40, "prefill")]
    models = [MODELS[m] for m in (args.models or MODELS)]
    points = []
    for phase, tokens in (("decode", args.tokens or DECODE_TOKENS), ("prefill", args.prefill_tokens or PREFILL_TOKENS)):
        if args.phases and phase not in args.phases:
            continue
        for model, rank, t in itertools.product(models, args.pool_ranks or POOL_RANKS, tokens):
            points += [(model, name, rank, t, phase) for name in model.modules()]
    return points


def partial_sweep(args) -> list[str]:
    """What makes this run cover less than the shipped table holds (its options naming a subset of
    the candidates or the grid), as option names; empty for a full sweep. The shipped table is
    written whole from one sweep's winners, so only a full sweep may write it."""
    full = dict(models=MODELS, phases=("decode", "prefill"), tokens=DECODE_TOKENS, prefill_tokens=PREFILL_TOKENS,
                pool_ranks=POOL_RANKS, overlaps=("none", "a", "ab_delta"))
    named = [f"--{name.replace('_', '-')}" for name, every in full.items()
             if getattr(args, name) and set(getattr(args, name)) != set(every)]
    if args.candidates != "all":
        named.append(f"--candidates {args.candidates}")
    if args.shard != "0/1":
        named.append(f"--shard {args.shard}")
    return named


def compile_in_parallel(argv: list[str], jobs: int, budget: float) -> list[dict]:
    """Fill Triton's cache from ``jobs`` processes at once: this run's arguments ``argv`` with
    ``--compile-only --shard i/jobs`` (each starting no point after ``budget`` seconds), as
    ``benchmarks/run_plan_gpu.sh plan_sweep`` starts them. Their output goes to temporary files; the
    last lines of each are printed. Returns one record per shard: ``shard``, ``returncode``,
    ``seconds``. Never raises for a failing shard: the timed sweep compiles what it left."""
    started, records = time.perf_counter(), []
    with tempfile.TemporaryDirectory(prefix="plan-sweep-compile-") as logs:
        runs = []
        for shard in range(jobs):
            log = open(Path(logs) / f"{shard}.log", "w+")
            command = [sys.executable, "-m", "benchmarks.plan_sweep", *argv, "--compile-jobs", "0", "--compile-only",
                       "--shard", f"{shard}/{jobs}", "--budget-seconds", f"{budget:g}"]
            runs.append((shard, log, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)))
        for shard, log, process in runs:
            returncode = process.wait()
            log.seek(0)
            tail = log.read().splitlines()[-(2 if returncode == 0 else 15):]
            log.close()
            records.append(dict(shard=f"{shard}/{jobs}", returncode=returncode, seconds=time.perf_counter() - started))
            print(f"[compile {shard}/{jobs}] exit status {returncode}" + "".join(f"\n  {line}" for line in tail), flush=True)
    print(f"compiled in {jobs} processes in {time.perf_counter() - started:.0f} s", flush=True)
    return records


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", help="cuda, xpu or cpu (default: cuda where there is one, else cpu; --quick: cpu)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: a tiny layer, a few candidates with small tiles (on CPU, the interpreter, unless --device)")
    parser.add_argument("--models", nargs="*", choices=list(MODELS))
    parser.add_argument("--phases", nargs="*", choices=["decode", "prefill"])
    parser.add_argument("--tokens", nargs="*", type=int, help=f"decode token counts (default {DECODE_TOKENS})")
    parser.add_argument("--prefill-tokens", nargs="*", type=int, help=f"prefill token counts (default {PREFILL_TOKENS})")
    parser.add_argument("--pool-ranks", nargs="*", type=int, help=f"pool ranks (default {POOL_RANKS})")
    parser.add_argument("--candidates", choices=("all", "sglang", "fused"), default="all",
                        help="which plans to try: every family, SGLang's kernels only, or the fused per-row kernel only (decode)")
    parser.add_argument("--overlaps", nargs="+", choices=("none", "a", "ab_delta"),
                        help="only the candidates of these overlaps (default: every one)")
    parser.add_argument("--real-rank", type=int, default=16, help="the adapters' rank (capped at the pool rank)")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tolerance", type=float, default=None, help="relative to float64 (bf16: 2e-2, fp32: 1e-4)")
    parser.add_argument("--compile-only", action="store_true",
                        help="run and check each candidate once, no timing (fills Triton's cache; run shards of it in parallel)")
    parser.add_argument("--shard", default="0/1", help="i/n: only every n-th point from the i-th (parallel compile runs)")
    parser.add_argument("--compile-jobs", type=int, default=0,
                        help="first run --compile-only in this many processes at once (shards 0/n .. n-1/n), then time "
                             "(0 or 1: compile while timing)")
    parser.add_argument("--budget-seconds", type=float, default=float("inf"), help="stop starting points after this")
    parser.add_argument("--out", help="the plan table to write (default: the shipped table of the device family)")
    parser.add_argument("--use-sglang-plans", nargs="+", metavar="PHASE:POOL_RANK:TOKENS[:MODEL]",
                        help="rewrite these rows of --out with SGLang's plans (of --architecture) and exit: the points where "
                             "the layer benchmark measured SGLang's plans faster in a whole layer")
    parser.add_argument("--architecture", default="sm90", help="SGLang's table for --use-sglang-plans")
    parser.add_argument("--results", default=str(RESULTS))
    parser.add_argument("--label", help="names this sweep's results file (so it does not replace an earlier one's)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.use_sglang_plans:
        from sglang_xpu_lora.dense.plans import CONFIG_DIR

        table = Path(args.out) if args.out else CONFIG_DIR / f"{args.architecture}.plans.json"
        print(f"{use_sglang_plans(table, args.architecture, args.use_sglang_plans)} rows of {table} now SGLang's plans")
        return
    subset = partial_sweep(args)
    if subset and not (args.out or args.quick or args.compile_only):
        parser.error(f"{' '.join(subset)}: a partial sweep would replace the shipped plan table with its winners "
                     "alone; give --out (plan_refine --sweep ranks its results with a full sweep's)")
    args.device = args.device or ("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    args.tolerance = args.tolerance or (1e-4 if dtype == torch.float32 else 2e-2)
    if device.type == "cpu":  # Triton's interpreter, set before SGLang's kernels are defined
        os.environ.setdefault("TRITON_INTERPRET", "1")
        from sglang_cpu_devsupport import pin_memory

        pin_memory.register()
    from sglang_xpu_lora.dense.plans import CONFIG_DIR, device_family

    started, points, case, not_run, compiled = time.perf_counter(), [], None, 0, []
    if args.compile_jobs > 1 and not args.compile_only:
        compiled = compile_in_parallel(argv, args.compile_jobs, args.budget_seconds)
    shard, shards = (int(v) for v in args.shard.split("/"))
    todo = grid(args)[shard::shards]
    for index, (model, name, rank, tokens, phase) in enumerate(todo):
        if time.perf_counter() - started > args.budget_seconds:
            not_run = len(todo) - index
            print(f"budget spent: {not_run} points not run", flush=True)
            break
        if case is None or (case.model, case.rank, case.tokens, case.mode) != (model, rank, tokens, phase):
            case = None  # one batch's weights at a time
            case = Case(model, rank, args.adapters, tokens, phase, dtype, device, real_rank=min(args.real_rank, rank))
        entry = sweep_point(case, name, phase, args)
        points.append(entry)
        print(f"{phase} {model.name} {name} rank {rank} tokens {tokens}: best {entry['best']} "
              f"({min((c['us'] for c in entry['candidates'] if 'us' in c), default=float('nan')):.1f} us; "
              f"{sum('failed' in c for c in entry['candidates'])} failed)", flush=True)
    if args.compile_only:
        print(f"compiled and checked {sum(len(p['candidates']) for p in points)} candidates", flush=True)
        return
    if not points:
        sys.exit(f"no point swept (budget {args.budget_seconds} s): nothing written")
    suffix = ("-quick" if args.quick else "") + ("" if args.candidates == "all" else f"-{args.candidates}")
    suffix += f"-{args.label}" if args.label else ("-cut-short" if not_run and not args.out else "")
    results = Path(args.results) / f"plan-sweep-{device.type}{suffix}.json"
    results.parent.mkdir(parents=True, exist_ok=True)
    out = Path(args.out) if args.out else CONFIG_DIR / f"{device_family(device)}.plans.json"
    if args.quick and not args.out:
        out = Path(args.results) / "plan-sweep-quick.plans.json"
    elif not_run and not args.out:  # cut short by the budget: its rows would replace the whole table
        out = Path(args.results) / f"plan-sweep-{device.type}-cut-short.plans.json"
        print(f"{not_run} points not run: the table goes to {out}, not the shipped one", flush=True)
    rows = table_rows(points)
    out.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    for entry in points:  # the winners' specs are in the table: the results keep labels and figures
        for candidate in entry["candidates"]:
            candidate.pop("spec")
    results.write_text(json.dumps(dict(machine=machine(), args={k: v for k, v in vars(args).items() if k != "models"}, points=points,
                                       points_not_run=not_run, compile_jobs=compiled, table=str(out), rows=len(rows)),
                                  separators=(",", ":"), default=str))
    print(f"wrote {out} ({len(rows)} rows) and {results}")


if __name__ == "__main__":
    main()
