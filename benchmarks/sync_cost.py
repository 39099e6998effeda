"""Sync-cost stand-in: what the host synchronisations of the sgl-kernel-xpu LoRA ops cost per
eager decode step, against the sync-free Triton path, measured in the same run.

No Intel GPU is needed: each native op is stood in for by SGLang's Triton kernel of the op (as the
Triton provider calls it) preceded by the host reads the sgl-kernel-xpu op makes before it launches
(``shared/research/sgl-kernel-xpu-ops-and-plugin-conventions.md`` section 1.1, "Host syncs"), each
a real device-to-host read of the index tensors (:data:`SYNCS`):

* every op: ``aminmax(weight_indices)``, ``seg_indptr[0]``, ``seg_indptr[-1]``, ``aminmax`` of the
  segment lengths, ``aminmax(lora_ranks)``, each value read with ``.item()``: 8 reads;
* ops with a permutation (the decode path): ``aminmax(permutation)``: 2 more;
* ``qkv_lora_b_fwd`` and the chunked expand: the band offsets copied with ``.cpu()``: 1 more.

A decode step of a Llama-3.1-8B-like stack is ``--layers`` layers (32) of the four LoRA modules
(qkv, o, gate_up, down), each a chunked shrink and a chunked expand as ``IntelXpuLoRABackend``
routes decode: 21 reads per module, 84 per layer, 2688 per step. With ``--base`` (default on a GPU)
each layer also runs its base projections (bf16 GEMMs of the model's shapes; no attention), so the
step is what eager decode is made of apart from attention. Paths per token count:

* ``base``: the base projections only (with ``--base``);
* ``triton``: + the LoRA ops, sync-free (SGLang's Triton kernels);
* ``synced``: + the same kernels, each after its host reads (the native ops' sync pattern).

    python -m benchmarks.sync_cost --device cuda            # 1-256 tokens, writes sync-cost-cuda.{json,md}
    python -m benchmarks.sync_cost --quick                  # CPU smoke run (tiny layer, one layer)

On CPU the kernels are the portable ops and a host read synchronises nothing: CPU numbers are a
smoke test only.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.common import GRAPH_DEVICES, MODELS, RESULTS, time_call, write
from benchmarks.ops import TINY, Case, layer
from sglang_xpu_lora.providers import torch_ops

#: Host reads before each op of the decode path (module docstring; research notes section 1.1).
SYNCS = {"shrink": 8 + 2, "expand": 8 + 2 + 1}
#: The aten ops behind those reads: ``.item()`` and a device-to-host copy.
READ_OPS = ("_local_scalar_dense", "_to_copy")


def host_reads(case: Case, offsets: Optional[torch.Tensor]) -> None:
    """The reads an sgl-kernel-xpu op with a permutation makes before it launches (``offsets``:
    the expand's band offsets, copied to the host)."""
    lengths = case.seg_indptr[1:] - case.seg_indptr[:-1]
    for tensor in (case.weight_indices, lengths, case.ranks, case.permutation):
        low, high = torch.aminmax(tensor)
        low.item()
        high.item()
    case.seg_indptr[0].item()
    case.seg_indptr[-1].item()
    if offsets is not None:
        offsets.to("cpu", copy=True)  # .cpu(), also a copy (and countable) when the case is on the CPU


def lora_module_fn(case: Case, synced: bool) -> Callable[[str], torch.Tensor]:
    """One module's decode LoRA (chunked shrink + chunked expand) through the Triton provider on
    SGLang's packed pool on a GPU (CUDA or XPU), else the portable ops; ``synced`` adds the host reads."""
    if case.device.type in GRAPH_DEVICES:
        from benchmarks.triton_peers import dense_batch_info
        from sglang_xpu_lora.providers import triton_ops as ops
        from sglang_xpu_lora.providers.triton_launch import TritonLaunches

        extra = dict(batch_info=dense_batch_info(case), launches=TritonLaunches())  # compiled kernels kept across calls
    else:
        ops, extra = torch_ops, {}
    slots = case.seg_indptr.numel() - 1

    def run(name: str) -> torch.Tensor:
        a, b, outs = case.weights[name]
        meta = dict(seg_indptr=case.seg_indptr, weight_indices=case.weight_indices, lora_ranks=case.ranks, **extra)
        if synced:
            host_reads(case, None)
        mid = ops.chunked_sgmv_lora_shrink_fwd(case.inputs[name], a, len(outs), slots, permutation=case.permutation, **meta)
        if synced:
            host_reads(case, case.offsets[name])
        return ops.chunked_sgmv_lora_expand_fwd(
            mid, b, case.offsets[name], max(outs), len(outs), slots, scalings=case.scalings, permutation=case.permutation, **meta
        )

    return run


def base_weights(case: Case) -> dict:
    """One layer's base projection weights ``(out, in)`` in the case's dtype (reused by every layer)."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    return {
        name: (torch.randn(sum(outs), in_dim, generator=gen) * 0.02).to(case.device, case.inputs[name].dtype)
        for name, (in_dim, outs) in case.model.modules().items()
    }


def decode_step(case: Case, layers: int, lora: Optional[Callable[[str], torch.Tensor]], base: Optional[dict]) -> Callable[[], None]:
    """``layers`` layers of the base projections (if ``base``) and the LoRA modules (if ``lora``)."""
    one_layer = layer(lora, case) if lora is not None else None

    def run():
        for _ in range(layers):
            if base is not None:
                for name, weight in base.items():
                    torch.matmul(case.inputs[name], weight.t())
            if one_layer is not None:
                one_layer()

    return run


class ReadCounter(TorchDispatchMode):
    """Counts the aten ops behind host reads (:data:`READ_OPS`)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense" or (name == "_to_copy" and (kwargs or {}).get("device") == torch.device("cpu")):
            self.count += 1
        return func(*args, **(kwargs or {}))


def run(args) -> list[dict]:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type in GRAPH_DEVICES else torch.float32
    model = TINY if args.quick else MODELS["llama-3.1-8b"]
    rows = []
    for tokens in args.tokens:
        case = Case(model, args.rank, args.adapters, tokens, "decode", dtype, device)
        base = base_weights(case) if args.base else None
        row = dict(model=model.name, rank=args.rank, adapters=args.adapters, tokens=tokens, layers=args.layers,
                   syncs_per_step=args.layers * len(case.weights) * (SYNCS["shrink"] + SYNCS["expand"]))
        with ReadCounter() as counter:
            decode_step(case, 1, lora_module_fn(case, synced=True), None)()
        row["reads_counted_per_step"] = counter.count * args.layers
        paths = {"triton": lora_module_fn(case, synced=False), "synced": lora_module_fn(case, synced=True)}
        if base is not None:
            paths = {"base": None, **paths}
        for path, lora in paths.items():
            step = decode_step(case, args.layers, lora, base)
            times = [time_call(step, device, min_seconds=args.seconds) for _ in range(args.repeats)]
            row[f"{path}_ms"] = min(times) * 1e3
            row[f"{path}_spread"] = max(times) / min(times) - 1
        row["added_ms"] = row["synced_ms"] - row["triton_ms"]
        row["us_per_sync"] = row["added_ms"] * 1e3 / row["syncs_per_step"]
        row["step_ratio"] = row["synced_ms"] / row["triton_ms"]
        if base is not None:
            row["lora_ratio"] = (row["synced_ms"] - row["base_ms"]) / (row["triton_ms"] - row["base_ms"])
        rows.append(row)
        print(row, flush=True)
    return rows


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="tiny layer, 1 layer, 1 and 4 tokens: the smoke test")
    parser.add_argument("--tokens", type=lambda s: [int(t) for t in s.split(",")], default=None,
                        help="comma-separated decode batch sizes (default 1,4,16,64,256)")
    parser.add_argument("--layers", type=int, default=None, help="layers per decode step (default 32)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--base", action=argparse.BooleanOptionalAction, default=None,
                        help="also run the base projections (default: on a GPU)")
    parser.add_argument("--repeats", type=int, default=3, help="timings per path and point: the best is reported, and the spread")
    parser.add_argument("--seconds", type=float, default=0.3, help="minimum timing time per measurement")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.tokens = args.tokens or ([1, 4] if args.quick else [1, 4, 16, 64, 256])
    args.layers = args.layers or (1 if args.quick else 32)
    if args.base is None:
        args.base = args.device != "cpu"
    if args.quick:
        args.seconds, args.repeats = min(args.seconds, 0.01), 1
    rows = run(args)
    columns = ["tokens", "layers", "syncs_per_step", "reads_counted_per_step", "base_ms", "triton_ms", "synced_ms", "added_ms",
               "us_per_sync", "step_ratio", "lora_ratio", "triton_spread", "synced_spread"]
    write(f"sync-cost-{args.device}" + ("-quick" if args.quick else ""), rows, columns, args.out,
          extra={"syncs_per_op": SYNCS, "repeats": args.repeats})


if __name__ == "__main__":
    main()
