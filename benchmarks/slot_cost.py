"""What a slot costs per batch: ``intel_xpu``'s host work per batch against the slot count S
(``--max-loras-per-batch``), with the same adapters active (issue 31, item 2).

For each S, one ``IntelXpuLoRABackend`` (the portable ops, ``SGLANG_XPU_LORA_KERNELS=torch``) and
one SGLang ``TritonLoRABackend`` (its batch preparation, which ``intel_xpu`` inherits; SGLang's own
per-batch work) are built; the pool holds S slots of one decoder layer's LoRA weights (q/k/v,
o, gate/up, down of ``--shape``, rank ``--rank``), and every batch names the adapters of slots
``1..--active`` (slot 0 is the base model's, rank 0, as in SGLang's pool). Timed per batch, median
of repeated calls (``benchmarks.common.time_call``), the best of ``--best-of`` such medians (``spread``:
the row's largest (slowest - best) / best):

* ``prepare_us``: ``prepare_lora_batch`` (eager; a decode batch of ``--decode-batch`` requests
  and a prefill batch of ``--prefill-batch`` requests of ``--prefill-len`` tokens), and for
  ``triton`` the same call of SGLang's own backend;
* ``layer_us``: ``prepare_lora_batch`` plus one decoder layer's LoRA ops through the backend's
  ``run_*`` methods (the routes are built at their first use in an eager batch);
* ``graph_prepare_us``: ``prepare_lora_batch`` of the decode batch into decode-graph batch infos
  (routes built at once, as before a replay), after ``init_decode_cuda_graph_batch_info``;
* ``graph_setup_ms``: ``init_decode_cuda_graph_batch_info`` for ``--decode-batch`` requests, once
  per server start.

Counted per batch (one prepare + one layer, not timed): ``aten_ops`` and ``elements``, the aten
calls the batch makes and the elements of the tensors they return (``TorchDispatchMode``), for
``intel_xpu`` less those of SGLang's own preparation at the same S (``*_added``): the work the
plugin adds, which must not grow with S. ``ratio`` columns are each figure over the S = smallest
row's. On a CPU the ops route on the host (grouped GEMMs over the active slots only); this is the
host work, the question of the issue. ``--decode-batch`` 64 keeps every op on the host routing at
S = 8 too (smaller problems take the device routing on a CPU, ``torch_ops.routes_on_host``, whose
all-slots products do grow with S). Results: ``benchmarks/results/slot-cost-cpu.json`` / ``.md``.

The machine's load average (1, 5, 15 minutes) before and after the run goes into the JSON.

    python -m benchmarks.slot_cost [--slots 8 64 256] [--quick]
"""

from __future__ import annotations

import argparse
import os
import types
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.common import RESULTS, ModelShape, time_call, write

#: A small Llama-like layer: large enough that the portable ops route on the host at every S.
SHAPE = ModelShape("small", hidden=1024, q=1024, kv=256, intermediate=2816)
COLUMNS = [
    "phase", "slots", "active", "prepare_us", "triton_prepare_us", "layer_us", "graph_prepare_us", "graph_setup_ms",
    "aten_ops_added", "elements_added", "prepare_ratio", "layer_ratio", "spread",
]


class WorkCounter(TorchDispatchMode):
    """Counts aten calls and the elements of the tensors they return (views aside: no new data)."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.elements = 0

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        if func.is_view:
            return out
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, torch.Tensor):
                self.elements += value.numel()
        return out


def forward_batch(phase: str, requests: int, prefill_len: int):
    """The ``ForwardBatch`` fields LoRA batch preparation reads: a decode batch of ``requests``, or
    a prefill batch of ``requests`` sequences of ``prefill_len`` tokens."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    batch = types.SimpleNamespace(
        forward_mode=ForwardMode.DECODE if phase == "decode" else ForwardMode.EXTEND, batch_size=requests,
        return_logprob=False, spec_info=None, extend_seq_lens_cpu=None, extend_seq_lens=None, extend_num_tokens=None,
    )
    if phase == "prefill":
        lens = [prefill_len] * requests
        batch.extend_seq_lens_cpu, batch.extend_num_tokens = lens, sum(lens)
        batch.extend_seq_lens = torch.tensor(lens, dtype=torch.int32)
    return batch


def layer_weights(slots: int, active: int, rank: int, shape: ModelShape, seed: int = 0) -> dict:
    """One decoder layer's pool buffers for ``slots`` slots: module -> (A ``(slots, stack * rank,
    in)``, B ``(slots, out, rank)``), float32, random in slots ``1..active`` and zero elsewhere."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for module, (in_dim, outs) in shape.modules().items():
        a = torch.zeros(slots, len(outs) * rank, in_dim)
        b = torch.zeros(slots, sum(outs), rank)
        a[1 : active + 1] = torch.randn(active, len(outs) * rank, in_dim, generator=generator) * 0.05
        b[1 : active + 1] = torch.randn(active, sum(outs), rank, generator=generator) * 0.05
        weights[module] = (a, b)
    return weights


def run_layer(backend, x: torch.Tensor, weights: dict, shape: ModelShape) -> None:
    """One decoder layer's LoRA calls, as SGLang's LoRA layers make them."""
    qkv_a, qkv_b = weights["qkv"]
    offsets = torch.tensor([0, shape.q, shape.q + shape.kv, shape.q + 2 * shape.kv], dtype=torch.int32)
    backend.run_qkv_lora(x=x, qkv_lora_a=qkv_a, qkv_lora_b=qkv_b, output_offset=offsets, max_qkv_out_dim=shape.q)
    o_a, o_b = weights["o"]
    backend.run_lora_b_sgemm(x=backend.run_lora_a_sgemm(x[:, : shape.q], o_a), weights=o_b)
    gate_up_a, gate_up_b = weights["gate_up"]
    backend.run_gate_up_lora(x=x, gate_up_lora_a=gate_up_a, gate_up_lora_b=gate_up_b)
    down_a, down_b = weights["down"]
    down_x = torch.randn(x.shape[0], shape.intermediate, generator=torch.Generator().manual_seed(1))
    backend.run_lora_b_sgemm(x=backend.run_lora_a_sgemm(down_x, down_a), weights=down_b)


def measure(slots: int, args, phase: str) -> dict:
    """One row: the timings and counts of ``phase`` (``decode`` or ``prefill``) at ``slots`` slots."""
    from sglang.srt.lora.backend.triton_backend import TritonLoRABackend

    from sglang_xpu_lora.backend.xpu import IntelXpuLoRABackend

    device = torch.device("cpu")
    requests = args.decode_batch if phase == "decode" else args.prefill_batch
    batch = forward_batch(phase, requests, args.prefill_len)
    # SGLang's lists (LoRAManager.prepare_lora_batch): one entry per slot; active slots 1..A.
    weight_indices = [1 + i % args.active for i in range(requests)]
    ranks = [0] * slots
    scalings = [0.0] * slots
    for slot in range(1, args.active + 1):
        ranks[slot], scalings[slot] = args.rank, 2.0
    tokens = requests if phase == "decode" else requests * args.prefill_len
    x = torch.randn(tokens, SHAPE.hidden, generator=torch.Generator().manual_seed(0))
    weights = layer_weights(slots, args.active, args.rank, SHAPE)
    xpu = IntelXpuLoRABackend(max_loras_per_batch=slots, device=device)
    xpu.lora_memory_pool = types.SimpleNamespace(max_lora_rank=args.rank)
    triton = TritonLoRABackend(max_loras_per_batch=slots, device=device)
    spreads = []

    def best(fn) -> float:
        """Microseconds per call: the best of ``--best-of`` medians (``time_call``); their spread
        ((slowest - best) / best) goes to the row's ``spread``."""
        medians = [time_call(fn, device, min_seconds=args.min_seconds) * 1e6 for _ in range(args.best_of)]
        spreads.append((max(medians) - min(medians)) / min(medians))
        return min(medians)

    def prepare(backend, graph=False):
        backend.prepare_lora_batch(batch, weight_indices, ranks, scalings, graph)

    def batch_with_layer():
        prepare(xpu)
        run_layer(xpu, x, weights, SHAPE)

    row = {
        "phase": phase, "slots": slots, "active": args.active,
        "prepare_us": best(lambda: prepare(xpu)),
        "triton_prepare_us": best(lambda: prepare(triton)),
        "layer_us": best(batch_with_layer),
    }
    with WorkCounter() as ours:
        batch_with_layer()
    with WorkCounter() as sglang:
        prepare(triton)
    row["aten_ops_added"] = ours.ops - sglang.ops
    row["elements_added"] = ours.elements - sglang.elements
    if phase == "decode":
        graph_backend = IntelXpuLoRABackend(max_loras_per_batch=slots, device=device)
        graph_backend.lora_memory_pool = xpu.lora_memory_pool
        row["graph_setup_ms"] = best(lambda: graph_backend.init_decode_cuda_graph_batch_info(requests, 1)) / 1e3
        row["graph_prepare_us"] = best(lambda: prepare(graph_backend, graph=True))
    row["spread"] = max(spreads)
    return row


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, nargs="+", default=[8, 64, 256], help="S values (--max-loras-per-batch)")
    parser.add_argument("--active", type=int, default=7, help="adapters named by every batch (slots 1..A)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--prefill-batch", type=int, default=8)
    parser.add_argument("--prefill-len", type=int, default=64)
    parser.add_argument("--min-seconds", type=float, default=0.5, help="timing per median")
    parser.add_argument("--best-of", type=int, default=3, help="medians per figure, the best kept")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: host work, and steady on a shared machine)")
    parser.add_argument("--quick", action="store_true", help="S 8 and 16, 0.05 s per figure: the smoke run")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    if args.quick:
        args.slots, args.min_seconds, args.best_of, args.prefill_len = [8, 16], 0.05, 1, 8
    if min(args.slots) <= args.active:
        parser.error(f"--slots must exceed --active ({args.active}): slot 0 is the base model's")
    os.environ["SGLANG_XPU_LORA_KERNELS"] = "torch"
    torch.set_num_threads(args.threads)
    from sglang.srt.plugins import load_plugins

    load_plugins()
    load_before = os.getloadavg()
    rows = []
    for phase in ("decode", "prefill"):
        first = None
        for slots in sorted(args.slots):
            row = measure(slots, args, phase)
            first = first or row
            row["prepare_ratio"] = row["prepare_us"] / first["prepare_us"]
            row["layer_ratio"] = row["layer_us"] / first["layer_us"]
            rows.append(row)
            print(row, flush=True)
    name = "slot-cost-cpu" + ("-quick" if args.quick else "")
    settings = {key: value for key, value in vars(args).items() if key != "out"}
    write(name, rows, COLUMNS, args.out, extra={"settings": {**settings, "shape": vars(SHAPE)}, "load_average": {"before": load_before, "after": os.getloadavg()}})


if __name__ == "__main__":
    main()
