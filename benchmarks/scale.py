"""Many adapters over few slots: K adapters loaded in one ``sglang serve``, S adapter slots per
batch (``--max-loras-per-batch``), C requests in flight (issue 31).

For each LoRA backend (``intel_xpu`` and SGLang's ``torch_native`` on CPU; also ``triton``, ``csgmv``
and ``triton_v2`` on a CUDA GPU, ``triton`` and ``csgmv`` on an Intel GPU, where SGLang 0.5.23's
``triton_v2`` fails), one server is started with the first adapter and the others are
loaded through ``/load_lora_adapter``, up to each K in turn (the server stays up, so K grows). At
each K, for each C, N streamed ``/generate`` requests (fresh random prompts, greedy, ``ignore_eos``,
``--new-tokens`` tokens each), spread over the K adapters (N distinct adapters at most), are sent
with C in flight, after one untimed round (the largest C, as many requests, over the first K's
adapters) that leaves one-time costs out of the timings. Recorded per (backend, K, C):

* time to first token (the first streamed event with a token), p50 and p95, and the slowest
  request's latency (send to last event), in seconds;
* tokens per second: N x new tokens over the wall time of the N requests;
* with ``--churn SECONDS``, reloads during every timed workload: ``--churn-first`` seconds after
  the workload starts (default 0.1 s, while its first prefills run), then every SECONDS, one more
  adapter (``scale-churn``, named by no workload request, so none of them is refused) is unloaded,
  loaded again through ``/load_lora_adapter`` and sent one request (its first use, copied into a
  slot). A first reload only after SECONDS (as before ``--churn-first``) put reloads only in the
  workloads that lasted longer, the slow ones, and read as a cost of the reload;
  those requests count in the slowest latency and in ``latency_p99_s`` (the 99th percentile of all
  latencies), ``reloads`` counts the rounds, and ``tail_s`` = slowest - p99 (the issue's target: at
  most 1 s, in 5 repeated runs); ``--churn-no-reload`` sends the same requests to ``scale-churn``
  left loaded (``reloads`` 0, ``churn_requests`` the rounds), which tells what a reload costs from
  what one more adapter in the batches costs;
* the machine's 1-minute load average when the row's workload ended (``load_1m``; the run's
  load averages before and after go into the JSON);
* the time of each ``/load_lora_adapter`` (median and max, ms, of the loads that took K to its
  value) and the server's resident memory per adapter (all its processes, ``/proc``: the growth
  across the loads alone, not the workloads between them, over the adapters loaded after the
  first; on a GPU also the device memory per adapter, from the device's free memory, which should
  stay flat: SGLang keeps adapters in host memory and copies them into the slots it allocated at
  start);
* a sample of the requests' greedy tokens (``--check`` per backend, across the runs) against
  transformers + PEFT in float32 (``sglang_cpu_devsupport.serving.hf_reference``): ``exact`` counts
  the equal ones.

The adapters are one PEFT adapter built by ``sglang_cpu_devsupport.tiny_model`` (all linear
modules of the tiny Llama, rank ``--rank``) and K - 1 copies of its files with fresh random weights
(seeded by index), each a PEFT adapter that transformers + PEFT loads. ``--max-lora-rank`` is the
adapters' rank. The JSON, Markdown and plot (:func:`plot`) go to
``benchmarks/results/scale-<device>.json`` / ``.md`` / ``.png`` (``--out`` elsewhere; ``--quick``: a few seconds of serving, ``-quick`` in the name, the suite's
smoke run ``tests/integration/test_benchmarks_smoke.py``).

The issue's workload, on the CPU engine (about 10 minutes per backend on a quiet 2-core machine)::

    python -m benchmarks.scale --adapters 8 32 1000 --slots 8 --in-flight 16 64 --requests 64

The issue's target run, with reloads (``benchmarks/results/scale-cpu-runs/``, docs/sizing.md;
about 2 minutes for both backends)::

    python -m benchmarks.scale --slots 64 --adapters 8 1000 --in-flight 64 --requests 64 --churn 1

On a GPU: ``--device cuda`` or ``--device xpu`` (the XPU kit, ``examples/xpu/measure.sh``, runs
the issue's target run there), ``--set attention_backend=triton`` and other ``sglang serve``
settings as ``KEY=VALUE`` (by default the servers run the tiny Llama as the CPU engine does: float32,
``torch_native`` attention, no decode graphs). A backend whose server fails (to start, or in a
request) is recorded in the JSON's ``failed`` with the error and the run goes on with the next;
the exit status is 1 when no backend ran. The client needs ``sglang_cpu_devsupport`` (the tiny
model, the server helpers): from this checkout's ``devsupport/src`` when it is not installed, put
after every installed package so that its ``sgl_kernel`` stub never shadows a real build (the
servers never see it). Measured figures come from a quiet machine; none is asserted anywhere.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import shutil
import os
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Optional

from benchmarks.common import RESULTS, headless_pyplot, write

#: Backends run by default: those that run on the device type.
BACKENDS = {
    "cpu": ("intel_xpu", "torch_native"),
    "cuda": ("intel_xpu", "torch_native", "triton", "csgmv", "triton_v2"),
    "xpu": ("intel_xpu", "torch_native", "triton", "csgmv"),
}
#: This checkout's development shims (``sglang_cpu_devsupport``), for a client where they are not installed.
DEVSUPPORT = Path(__file__).resolve().parents[1] / "devsupport" / "src"
TEMPLATE = "scale-template"
CHURNED = "scale-churn"
COLUMNS = [
    "backend", "adapters", "slots", "in_flight", "requests", "ttft_p50_s", "ttft_p95_s", "latency_p99_s", "latency_max_s",
    "tail_s", "reloads", "tok_s", "load_ms_median", "load_ms_max", "rss_mib_per_adapter", "checked", "exact", "load_1m",
]


def adapter_name(index: int) -> str:
    return f"scale-{index:04d}"


def build_adapters(root: Path, count: int, rank: int) -> dict[str, Path]:
    """The tiny Llama and ``count`` PEFT adapters under ``root``: ``{"base": dir, name: dir}``, and
    :data:`CHURNED`, the reloaded one (a copy of ``scale-0000``'s directory).

    ``scale-0000`` is a copy of a PEFT-built template (``tiny_model.build_all``: all linear modules,
    ``rank``, alpha 2 x rank); ``scale-i`` (i >= 1) has the template's config and tensor names and
    shapes with weights drawn from ``torch.Generator().manual_seed(1000 + i)`` (normal, std 0.1 for
    LoRA-A, 0.05 for LoRA-B: nonzero B, so every adapter changes the output). Directories made
    for the same template and rank are reused.
    """
    import torch
    from safetensors.torch import load_file, save_file

    from sglang_cpu_devsupport import tiny_model

    spec = tiny_model.AdapterSpec(TEMPLATE, rank=rank, alpha=2 * rank, seed=1000)
    paths = tiny_model.build_all(root, adapters=(spec,))
    template = paths[TEMPLATE]
    tensors = load_file(template / "adapter_model.safetensors")
    stamp = json.dumps({"template": json.loads((template / "build.json").read_text()), "version": 1})
    out = {"base": paths["base"]}
    for index in range(count):
        target = root / "scale-adapters" / adapter_name(index)
        if not (target / "build.json").exists() or (target / "build.json").read_text() != stamp:
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy(template / "adapter_config.json", target / "adapter_config.json")
            if index == 0:
                shutil.copy(template / "adapter_model.safetensors", target / "adapter_model.safetensors")
            else:
                generator = torch.Generator().manual_seed(1000 + index)
                fresh = {
                    key: torch.randn(value.shape, generator=generator) * (0.05 if "lora_B" in key else 0.1)
                    for key, value in sorted(tensors.items())
                }
                save_file(fresh, target / "adapter_model.safetensors")
            (target / "build.json").write_text(stamp)
        out[adapter_name(index)] = target
    out[CHURNED] = out[adapter_name(0)]
    return out


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, linearly interpolated (numpy's default)."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def streamed_generate(url: str, input_ids: list[int], lora: str, new_tokens: int) -> dict:
    """One streamed ``/generate``: ``{"ttft": s, "latency": s, "output_ids": [...]}`` (seconds from
    sending; the first event with a token; the last event, whose ``output_ids`` are all of them:
    SGLang streams them cumulatively unless ``--incremental-streaming-output``)."""
    payload = {
        "input_ids": input_ids, "lora_path": lora, "stream": True,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True},
    }
    request = urllib.request.Request(
        f"{url}/generate", data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    ttft, output_ids = None, []
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise RuntimeError(f"{lora}: {event['error']}")
            if event.get("output_ids"):
                output_ids = event["output_ids"]
                if ttft is None:
                    ttft = time.perf_counter() - start
    if len(output_ids) != new_tokens:
        raise RuntimeError(f"{lora}: {len(output_ids)} tokens streamed, expected {new_tokens}")
    return {"ttft": ttft, "latency": time.perf_counter() - start, "output_ids": output_ids}


def churn(
    url: str, path: Path, every: float, stop: threading.Event, prompt_len: int, new_tokens: int, first: float,
    reload: bool = True,
) -> list[float]:
    """Until ``stop`` is set: ``first`` seconds after the call, then every ``every`` seconds, unload
    :data:`CHURNED`, load it again from ``path`` (``reload`` False: neither, it stays loaded) and
    send it one streamed request. Returns those requests' latencies (seconds)."""
    from sglang_cpu_devsupport import serving

    latencies, wait = [], first
    while not stop.wait(wait):
        if reload:
            serving.post_json(f"{url}/unload_lora_adapter", {"lora_name": CHURNED}, timeout=600)
            serving.post_json(f"{url}/load_lora_adapter", {"lora_name": CHURNED, "lora_path": str(path)}, timeout=600)
        latencies.append(streamed_generate(url, [5] * prompt_len, CHURNED, new_tokens)["latency"])
        wait = every
    return latencies


def run_workload(
    url: str, loaded: int, in_flight: int, requests: int, prompt_len: int, new_tokens: int, seed: int,
    churn_every: float = 0.0, churn_path: Optional[Path] = None, churn_first: float = 0.1, churn_reload: bool = True,
) -> dict:
    """N = ``requests`` streamed requests over the first ``loaded`` adapters (a seeded random
    choice of min(N, loaded) distinct ones, cycled), ``in_flight`` at a time; with
    ``churn_every`` > 0, :func:`churn` of :data:`CHURNED` (loaded from ``churn_path``) meanwhile,
    its first reload ``churn_first`` seconds after the workload starts (``churn_reload`` False:
    its requests alone, the adapter left loaded).
    Returns the row's timings and ``samples``: ``(input ids, adapter, output ids)`` per request."""
    rng = random.Random(seed)
    chosen = rng.sample(range(loaded), min(requests, loaded))
    work = [
        ([rng.randrange(3, 1000) for _ in range(prompt_len)], adapter_name(chosen[i % len(chosen)]))
        for i in range(requests)
    ]
    stop = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(max_workers=in_flight + 1) as pool:
        churned = (
            pool.submit(churn, url, churn_path, churn_every, stop, prompt_len, new_tokens, churn_first, churn_reload)
            if churn_every > 0 else None
        )
        start = time.perf_counter()
        results = list(pool.map(lambda item: streamed_generate(url, item[0], item[1], new_tokens), work))
        wall = time.perf_counter() - start
        stop.set()
        reloaded = churned.result() if churned is not None else []
    ttfts = [r["ttft"] for r in results]
    latencies = [r["latency"] for r in results] + reloaded
    return {
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p95_s": percentile(ttfts, 0.95),
        "latency_p99_s": percentile(latencies, 0.99),
        "latency_max_s": max(latencies),
        "tail_s": max(latencies) - percentile(latencies, 0.99),
        "reloads": len(reloaded) if churn_reload else 0,
        "churn_requests": len(reloaded),
        "tok_s": requests * new_tokens / wall,
        "samples": [(ids, lora, r["output_ids"]) for (ids, lora), r in zip(work, results)],
    }


def device_free_bytes(device: str) -> Optional[int]:
    """Free memory of the GPU (``cuda`` / ``xpu``), device-wide; None on CPU, or where this torch
    cannot tell (a ``torch.xpu`` without ``mem_get_info``: no device memory per adapter then)."""
    if device == "cpu":
        return None
    import torch

    mem_get_info = getattr(getattr(torch, device), "mem_get_info", None)
    return None if mem_get_info is None else mem_get_info()[0]


def run_backend(backend: str, paths: dict, args, env: dict, reference) -> list[dict]:
    """One server on ``backend``: the loads up to each K, the workloads at each C, the sample
    checked against ``reference(input_ids, adapter) -> greedy tokens``. Returns its rows."""
    from sglang_cpu_devsupport import serving

    first = adapter_name(0)
    overrides = {
        **dict(lora_backend=backend, max_loras_per_batch=args.slots, max_lora_rank=args.rank, log_level="warning"),
        **args.set,
    }
    if args.device != "cpu":
        overrides["device"] = args.device
    port = serving.free_port()
    url = f"http://127.0.0.1:{port}"
    argv = serving.server_argv(paths, [first], port, **overrides)
    log = Path(args.log_dir) / f"scale-{backend}.log"
    rows, samples = [], []
    with serving.running_server(argv, port, env, log) as server:
        warm = [1] * args.prompt_len
        serving.post_json(f"{url}/generate", {"input_ids": warm, "lora_path": first, "sampling_params": {"max_new_tokens": 2}})
        if args.churn:
            serving.post_json(f"{url}/load_lora_adapter", {"lora_name": CHURNED, "lora_path": str(paths[CHURNED])})
        loaded, rss_growth, device_growth = 1, 0, 0
        for k in sorted(args.adapters):
            load_ms = []
            rss_before, free_before = serving.process_group_rss(server.pid), device_free_bytes(args.device)
            for index in range(loaded, k):
                name = adapter_name(index)
                begin = time.perf_counter()
                serving.post_json(f"{url}/load_lora_adapter", {"lora_name": name, "lora_path": str(paths[name])}, timeout=600)
                load_ms.append((time.perf_counter() - begin) * 1e3)
            loaded = max(loaded, k)
            extra = loaded - 1
            rss_growth += serving.process_group_rss(server.pid) - rss_before  # the loads', not the workloads'
            free = device_free_bytes(args.device)
            if free is not None and free_before is not None:
                device_growth += free_before - free
            if k == min(args.adapters):  # warm-up, untimed: the largest C over the first K's adapters
                busiest = max(args.in_flight)
                run_workload(url, loaded, busiest, busiest, args.prompt_len, args.new_tokens, seed=0)
            for c in args.in_flight:
                timings = run_workload(
                    url, loaded, c, args.requests, args.prompt_len, args.new_tokens, seed=1000 * k + c,
                    churn_every=args.churn, churn_path=paths[CHURNED], churn_first=args.churn_first,
                    churn_reload=not args.churn_no_reload,
                )
                samples += [(backend, loaded, c, *sample) for sample in timings.pop("samples")]
                row = {
                    "backend": backend, "adapters": loaded, "slots": args.slots, "in_flight": c,
                    "requests": args.requests, **timings,
                    "load_ms_median": statistics.median(load_ms) if load_ms else None,
                    "load_ms_max": max(load_ms) if load_ms else None,
                    "rss_mib_per_adapter": rss_growth / extra / 2**20 if extra else None,
                    "load_1m": os.getloadavg()[0],
                }
                if free is not None:
                    row["device_mib_per_adapter"] = device_growth / extra / 2**20 if extra else None
                rows.append(row)
                print(row, flush=True)
    # The sample: spread over the runs, the same picks for every backend (same seeds, same order).
    picks = random.Random(7).sample(range(len(samples)), min(args.check, len(samples)))
    for pick in picks:
        _, k, c, input_ids, lora, output_ids = samples[pick]
        row = next(r for r in rows if r["adapters"] == k and r["in_flight"] == c)
        row["checked"] = row.get("checked", 0) + 1
        row["exact"] = row.get("exact", 0) + int(output_ids == reference(tuple(input_ids), lora))
    for row in rows:
        row.setdefault("checked", 0)
        row.setdefault("exact", 0)
    return rows


def import_devsupport() -> None:
    """Make ``sglang_cpu_devsupport`` importable in this process: installed, or else from
    :data:`DEVSUPPORT`, appended to ``sys.path`` (after every installed package: a real
    ``sgl_kernel`` build is found before the folder's stub; this client imports neither)."""
    import importlib.util

    if importlib.util.find_spec("sglang_cpu_devsupport") is None:
        sys.path.append(str(DEVSUPPORT))


def plot(rows: list[dict], path: Path) -> None:
    """Time to first token (p50, log scale) and tokens per second against K, one line per backend
    and C (in flight), the slot count S marked: the step just past S is the admission wait
    (docs/sizing.md). Written to ``path`` (PNG); skipped where matplotlib is missing."""
    plt = headless_pyplot()
    if plt is None:
        return

    fig, (ttft, rate) = plt.subplots(1, 2, figsize=(12, 4.5))
    lines = sorted({(r["backend"], r["in_flight"], r["slots"]) for r in rows})
    for backend, in_flight, slots in lines:
        chosen = sorted((r for r in rows if (r["backend"], r["in_flight"], r["slots"]) == (backend, in_flight, slots)), key=lambda r: r["adapters"])
        ks = [r["adapters"] for r in chosen]
        label = f"{backend}, {in_flight} in flight, {slots} slots"
        ttft.plot(ks, [r["ttft_p50_s"] for r in chosen], "o-", label=label)
        rate.plot(ks, [r["tok_s"] for r in chosen], "o-", label=label)
    for slots in sorted({r["slots"] for r in rows}):
        for ax in (ttft, rate):
            ax.axvline(slots, color="0.6", ls="--", lw=1)
    for ax, title in ((ttft, "time to first token, p50 (s)"), (rate, "tokens per second")):
        ax.set_xscale("log")
        ax.set_xlabel("adapters loaded (K); dashed: the slot count S")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    ttft.set_yscale("log")
    rate.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, nargs="+", default=[8, 32, 1000], help="K values, loaded in turn")
    parser.add_argument("--slots", type=int, default=8, help="--max-loras-per-batch (the base model counts as one)")
    parser.add_argument("--in-flight", type=int, nargs="+", default=[16, 64], help="C values")
    parser.add_argument("--requests", type=int, default=64, help="N requests per (K, C)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--rank", type=int, default=8, help="the adapters' rank, and --max-lora-rank")
    parser.add_argument("--check", type=int, default=16, help="sampled requests per backend checked against transformers + PEFT")
    parser.add_argument("--backends", nargs="+", help="default: " + "; ".join(f"{d}: {' '.join(b)}" for d, b in BACKENDS.items()))
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda", "xpu"])
    parser.add_argument("--churn", type=float, default=0.0, metavar="SECONDS",
                        help=f"unload, load and use {CHURNED} every SECONDS during the timed workloads (0: off)")
    parser.add_argument("--churn-first", type=float, default=0.1, metavar="SECONDS",
                        help="with --churn: the first reload this long after each workload starts (default 0.1)")
    parser.add_argument("--churn-no-reload", action="store_true",
                        help=f"with --churn: send {CHURNED} its requests without unloading and loading it (it stays "
                        "loaded): what one more adapter in the batches costs, apart from the reload")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="further sglang serve settings (Engine argument names)")
    parser.add_argument("--artifacts", type=Path, default=Path("artifacts"))
    parser.add_argument("--log-dir", type=Path, default=None, help="the servers' logs (default: ARTIFACTS/scale-logs)")
    parser.add_argument("--quick", action="store_true", help="K 2 and 3 over 2 slots, C 2, 4 requests of 4 tokens: the smoke run")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--plot-only", type=Path, metavar="RESULT_JSON", help="redraw the plot of an existing result")
    args = parser.parse_args(argv)
    if args.churn_no_reload and not args.churn:
        parser.error("--churn-no-reload needs --churn SECONDS (how often the churned adapter gets its request)")
    if args.plot_only:
        plot(json.loads(args.plot_only.read_text())["rows"], args.plot_only.with_suffix(".png"))
        return
    args.set = dict(item.split("=", 1) for item in args.set)
    if args.quick:
        args.adapters, args.slots, args.in_flight, args.requests = [2, 3], 2, [2], 4
        args.new_tokens, args.prompt_len, args.check = 4, 8, min(args.check, 2)
    args.log_dir = Path(args.log_dir or args.artifacts / "scale-logs")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    backends = args.backends or BACKENDS.get(args.device, ("intel_xpu", "torch_native"))

    import_devsupport()
    from sglang_cpu_devsupport import serving

    paths = build_adapters(args.artifacts, max(args.adapters), args.rank)
    env = serving.cpu_env() if args.device == "cpu" else {}
    references: dict = {}

    def reference(input_ids: tuple, lora: str) -> list[int]:
        if (input_ids, lora) not in references:
            references[input_ids, lora] = serving.hf_reference(paths["base"], paths[lora], input_ids, args.new_tokens)[1]
        return references[input_ids, lora]

    load_before = os.getloadavg()
    rows, failed = [], {}
    for backend in backends:
        try:
            rows += run_backend(backend, paths, args, env, reference)
        except Exception as exc:  # noqa: BLE001 - recorded; the other backends still run
            failed[backend] = f"{type(exc).__name__}: {exc}"[:2000]
            print(f"[scale] {backend} failed (its server log: {args.log_dir / f'scale-{backend}.log'}): {failed[backend]}", flush=True)
    name = f"scale-{args.device}" + ("-quick" if args.quick else "")
    settings = {key: value for key, value in vars(args).items() if key not in ("artifacts", "log_dir", "out")}
    columns = COLUMNS + (["device_mib_per_adapter"] if args.device != "cpu" else [])
    extra = {"settings": {**settings, "backends": list(backends)}, "load_average": {"before": load_before, "after": os.getloadavg()},
             "failed": failed}
    write(name, rows, columns, args.out, extra=extra)
    if rows:
        plot(rows, Path(args.out) / f"{name}.png")
    if not rows:
        sys.exit(f"[scale] no backend ran: {failed}")


if __name__ == "__main__":
    main()
