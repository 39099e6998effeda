"""Shared pieces of the benchmarks: model shapes, timing, and JSON/Markdown output."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

import torch

RESULTS = Path(__file__).parent / "results"


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """Projection sizes of one decoder layer (per TP rank)."""

    name: str
    hidden: int
    q: int
    kv: int
    intermediate: int

    def modules(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """module -> (input dim, output slice widths), as SGLang's LoRA layers see them."""
        return {
            "qkv": (self.hidden, (self.q, self.kv, self.kv)),
            "o": (self.q, (self.hidden,)),
            "gate_up": (self.hidden, (self.intermediate, self.intermediate)),
            "down": (self.intermediate, (self.hidden,)),
        }

    def lora_slot_bytes(self, rank: int, layers: int, dtype_bytes: int) -> int:
        """Bytes of one adapter slot of SGLang's LoRA pool (``sglang/srt/lora/mem_pool.py``,
        ``get_lora_A_shape`` / ``get_lora_B_shape``) when every linear module of ``layers`` decoder
        layers of this shape is a target, at ``--max-lora-rank rank``, with elements of
        ``dtype_bytes`` bytes (2 for bfloat16/float16, 4 for float32).

        Per module and layer the pool holds, per slot, LoRA-A ``(stack * rank, in)`` (stack: 3 for
        q/k/v, 2 for gate/up, else 1) and LoRA-B ``(out, rank)`` (out: the stacked outputs
        together); every slot is sized for ``rank``, whatever the ranks of the adapters in it. The
        pool holds ``--max-loras-per-batch`` such slots, allocated at start-up on the device. For a
        shape sharded over tensor parallelism (per rank, as ``llama-3.3-70b-tp8``) it is one rank's
        share. Embedding and lm_head LoRA (their own buffers) are not counted.
        """
        elements = sum(rank * len(outs) * in_dim + sum(outs) * rank for in_dim, outs in self.modules().values())
        return elements * layers * dtype_bytes


MODELS = {
    "llama-3.1-8b": ModelShape("llama-3.1-8b", hidden=4096, q=4096, kv=1024, intermediate=14336),
    # Llama-3.3-70B sharded over TP 8: column-parallel outputs and row-parallel inputs divided by 8.
    "llama-3.3-70b-tp8": ModelShape("llama-3.3-70b-tp8", hidden=8192, q=1024, kv=128, intermediate=3584),
}


#: Device types with graphs and streams: ``torch.cuda`` and ``torch.xpu`` share those names.
GRAPH_DEVICES = ("cuda", "xpu")


def use_sglang_triton_kernels(device: torch.device) -> None:
    """Serve ``intel_xpu``'s linears on SGLang's Triton kernels (``SGLANG_XPU_LORA_KERNELS=triton``:
    no native or portable ops), on CPU in Triton's interpreter (``TRITON_INTERPRET=1``, left as
    set if already set). Call before SGLang's kernels are imported: Triton reads the interpreter
    switch when a kernel is defined."""
    if torch.device(device).type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ["SGLANG_XPU_LORA_KERNELS"] = "triton"


def accelerator(device: torch.device):
    """``torch.cuda`` or ``torch.xpu`` for a device of that type, None for any other (CPU)."""
    return getattr(torch, device.type) if device.type in GRAPH_DEVICES else None


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on CPU)."""
    if accelerator(device) is not None:
        accelerator(device).synchronize(device)


def time_call(fn: Callable[[], object], device: torch.device, *, min_seconds: float = 0.2, max_reps: int = 200) -> float:
    """Median wall time of ``fn`` in seconds (device-synchronised), after one warm-up call."""
    sync = lambda: synchronize(device)  # noqa: E731
    fn()
    sync()
    samples: list[float] = []
    deadline = time.perf_counter() + min_seconds
    while len(samples) < 3 or (time.perf_counter() < deadline and len(samples) < max_reps):
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


#: One capture stream per device, reused by every capture: SGLang's graph runners warm up and
#: capture on one global capture stream, and ``LoraWorkspace`` (``triton_v2``) keys its graph
#: scratch by the caller's stream, so warming up on one stream and capturing on another leaves the
#: capture's scratch unwarmed ("MoE LoRA workspace was not warmed before CUDA capture").
_CAPTURE_STREAMS: dict = {}


def capture(fn: Callable[[], object], device: torch.device, *, warmups: int = 2):
    """Capture ``fn`` in a CUDA or XPU graph (``device``'s type) as SGLang's graph runners do:
    ``warmups`` calls on the device's capture stream, then the capture on that same stream.

    Returns ``(graph, what the captured call returned)``: the returned tensors are the graph's
    outputs, rewritten by every replay.
    """
    gpu = accelerator(device)
    stream = _CAPTURE_STREAMS.get(device)
    if stream is None:
        stream = _CAPTURE_STREAMS[device] = gpu.Stream(device)
    stream.wait_stream(gpu.current_stream())
    with gpu.stream(stream):
        for _ in range(warmups):
            fn()
    stream.synchronize()
    g = torch.cuda.CUDAGraph() if device.type == "cuda" else torch.xpu.XPUGraph()
    with gpu.graph(g, stream=stream):
        result = fn()
    gpu.current_stream().wait_stream(stream)
    return g, result


def replay_time(fn: Callable[[], object], device: torch.device, *, calls: int = 50, rounds: int = 5) -> tuple[float, float]:
    """Seconds per call of ``fn`` as a server pays it: :func:`interleaved_replay_times` of ``fn`` alone.

    Returns ``(median, spread)``: the median over the rounds of each round's time per call, and
    the rounds' (slowest - fastest) / median.
    """
    return interleaved_replay_times({"fn": fn}, device, calls=calls, rounds=rounds)["fn"]


def headless_pyplot():
    """``matplotlib.pyplot`` on the Agg backend (files only, no display), or None where matplotlib
    is not installed (a bare GPU machine: the benchmarks plot later with ``--plot-only``)."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed; skipping the plot")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def balanced_orders(count: int) -> list[list[int]]:
    """Orders of ``count`` items, one per round, in which each item holds each place equally often
    and, within the rounds, directly follows each other item equally often: a Williams design
    (E. J. Williams, "Experimental designs balanced for the estimation of residual effects of
    treatments", Aust. J. Sci. Res. A 2, 1949), ``count`` rounds for an even count, ``2 * count``
    (the rows and their mirrors) for an odd one.
    """
    first = [0]
    for step in range(1, count):
        first.append((step + 1) // 2 if step % 2 else count - step // 2)
    rows = [[(item + shift) % count for item in first] for shift in range(count)]
    return rows if count % 2 == 0 or count == 1 else rows + [row[::-1] for row in rows]


def interleaved_replay_times(
    fns: dict, device: torch.device, *, calls: int = 50, rounds: int = 5
) -> dict:
    """Seconds per call of each of ``fns`` (name -> callable) as a server pays it, measured
    together: one warm-up call each, then ``rounds`` rounds, each timing ``calls`` back-to-back calls
    of every callable in turn (device events around them on a CUDA or XPU GPU, so nothing waits for
    the host between calls; a host clock after a synchronize on CPU). The orders of the rounds are a
    Williams design (:func:`balanced_orders`), ``rounds`` rounded up to whole designs: each callable
    holds each place in a round equally often and, within a round, directly follows each other
    callable equally often (a round's first block follows the previous round's last one, which
    the design does not balance), so a drift of the device's speed over a point (clocks, heat)
    falls on every callable alike. The predecessor matters where the device runs at its power
    cap (an H200 at 8192 prefill tokens, :mod:`benchmarks.clock_log`): a block right after a slow,
    low-power one starts at a higher clock, and with the order only rotated each path always
    follows the same one.

    Returns ``{name: (median, spread)}``: the median over the rounds of each round's time per call,
    and the rounds' (slowest - fastest) / median.
    """
    gpu = accelerator(device)
    names = list(fns)
    orders = balanced_orders(len(names))
    rounds = -(-rounds // len(orders)) * len(orders)
    for name in names:
        fns[name]()
    synchronize(device)
    per_call: dict = {name: [] for name in names}
    for round_index in range(rounds):
        for name in (names[i] for i in orders[round_index % len(orders)]):
            fn = fns[name]
            if gpu is not None:
                start, end = gpu.Event(enable_timing=True), gpu.Event(enable_timing=True)
                start.record()
                for _ in range(calls):
                    fn()
                end.record()
                end.synchronize()
                per_call[name].append(start.elapsed_time(end) * 1e-3 / calls)
            else:
                begin = time.perf_counter()
                for _ in range(calls):
                    fn()
                per_call[name].append((time.perf_counter() - begin) / calls)
    result = {}
    for name, samples in per_call.items():
        median = statistics.median(samples)
        result[name] = (median, (max(samples) - min(samples)) / median)
    return result


def machine() -> dict:
    info = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": __import__("os").cpu_count(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    elif getattr(torch, "xpu", None) is not None and torch.xpu.is_available():
        info["gpu"] = torch.xpu.get_device_name()
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def write(name: str, rows: list[dict], columns: list[str], out_dir: Optional[Path] = None, extra: Optional[dict] = None) -> Path:
    """Write ``<name>.json`` and ``<name>.md`` (a table of ``columns``) and return the JSON path."""
    out_dir = Path(out_dir or RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine(), **(extra or {}), "rows": rows}
    (out_dir / f"{name}.json").write_text(json.dumps(payload, indent=1))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c)) for c in columns) + " |")
    header = f"Machine: {payload['machine']}\n\n"
    (out_dir / f"{name}.md").write_text(header + "\n".join(lines) + "\n")
    return out_dir / f"{name}.json"


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return "" if value is None else str(value)
