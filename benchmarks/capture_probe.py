"""Device evidence for the capture probe on real CUDA or XPU graphs: on CUDA, the emulated
host-syncing sgl-kernel-xpu build (``full``) falls back to Triton inside graphs, the emulated
sync-free build (``full-syncfree``) runs natively inside them, and graph replays equal eager; on an
Intel GPU, the verdicts for the installed sgl-kernel-xpu build (``--builds installed``, the default
there) and its graph replays against eager.

For each build, as a fresh serving process would (a new :class:`CaptureProbe` per build):

1. install the emulated build (its ops registered for CUDA; ``installed``: nothing, the kernels
   present are used) and select the ops for the device under ``SGLANG_XPU_LORA_KERNELS=auto``:
   every op native outside graphs, none inside until tried;
2. run the trial captures at a decode-graph and a prefill-graph set-up's sizes (``--decode-tokens``,
   ``--prefill-tokens``, 8 slots, ``max_lora_rank`` 64, bfloat16), as
   ``IntelXpuLoRABackend.init_*_cuda_graph_batch_info`` does, and record each op's verdict, reason
   and cost; afterwards no capture is open and the stream current before is current again;
3. rebuild the selection from the verdicts and check the graph providers: all Triton for ``full``,
   all native for ``full-syncfree`` (``installed``: whatever the trials decided, recorded);
4. capture one Llama-3.1-8B decoder layer's LoRA work (qkv, o, gate_up, down; adapters of rank 16
   under ``max_lora_rank`` 64 on the packed pool, 4 adapters with distinct scalings) through the
   graph op table in a CUDA or XPU graph, decode and prefill, refill the routing with another batch in
   place (as SGLang's graph runner does), replay, and compare with eager execution of the same
   table on that batch (``replay_vs_eager``, relative to the output's magnitude) and with the
   float64 reference (``vs_float64``).

The script exits with status 1 if a check fails. On a GPU machine with torch and Triton but no
SGLang, run it with the stand-ins of ``benchmarks/prepare_gpu_carry.sh``::

    bash benchmarks/prepare_gpu_carry.sh
    PYTHONPATH=.carry/site:src:devsupport/src:. python3 -m benchmarks.capture_probe --device cuda \\
        --out benchmarks/results/capture-probe-cuda.json

On an Intel GPU: ``python -m benchmarks.capture_probe --device xpu`` (``benchmarks/kit.py`` runs it).

``--device cpu --quick`` is the smoke run of the tests: there are no device graphs, so nothing is
tried (the verdict says so), and the layer (a tiny one with ``--quick``) runs eagerly through the
graph table only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional

import torch

from benchmarks.common import GRAPH_DEVICES, MODELS, RESULTS, accelerator, machine, synchronize

BUILDS = {"full": "triton", "full-syncfree": "native"}  # emulated build -> provider expected inside graphs on a GPU
INSTALLED = "installed"  #: the sgl-kernel-xpu build present, no emulator (what an Intel box runs)
SLOTS, MAX_RANK, REAL_RANK, ADAPTERS = 8, 64, 16, 4


def layer(selection, use_graph: bool, case, info) -> dict:
    """One layer's LoRA outputs through ``selection``'s graph or eager table, routed as
    ``IntelXpuLoRABackend`` routes them (:meth:`benchmarks.ops.Case.run_module`: the shrink's
    slices re-spaced for the expands that read them at ``max_lora_rank``; a new batch for the
    portable ops' routing, the case's launch cache for the Triton ops)."""
    case.begin_batch()
    table = case.with_batch_state(selection, use_graph)
    return {
        name: case.run_module(table, name, lambda op: selection.reads_spaced_slices(op, use_graph), batch_info=info)
        for name in case.weights
    }


def relative(got: dict, expected: dict) -> float:
    return max(float((got[n].double() - expected[n].double()).abs().max() / expected[n].double().abs().max().clamp(min=1e-30))
               for n in expected)


def layer_check(selection, mode: str, device: torch.device, quick: bool) -> dict:
    """Step 4 of the module docstring for ``mode`` (``decode``: 64 tokens, ``prefill``: 2 x 512),
    on a Llama-3.1-8B layer (``quick``: a tiny layer)."""
    from benchmarks.ops import TINY, Case, graph, reference_output
    from sglang_xpu_lora.providers import triton_ops

    tokens = 64 if mode == "decode" else 1024
    model = TINY if quick else MODELS["llama-3.1-8b"]
    case, other = (Case(model, MAX_RANK, ADAPTERS, tokens, mode, torch.bfloat16 if device.type in GRAPH_DEVICES else torch.float32,
                        device, seed=seed, real_rank=REAL_RANK) for seed in (1, 2))
    for c in (case, other):
        c.scalings.copy_(torch.linspace(0.5, 2.0, c.scalings.numel()))  # distinct per adapter
    info = None
    if triton_ops.PROVIDER in selection.providers:
        from benchmarks.triton_peers import dense_batch_info

        info = dense_batch_info(case)  # real ranks on SGLang's packed pool
    result = {"mode": mode, "tokens": tokens, "graph_ops": sorted({c.provider.name for c in selection.graph_choices.values()})}
    if device.type in GRAPH_DEVICES:
        outputs = {}
        replay = graph(lambda: outputs.update(layer(selection, True, case, info)), device)  # warm-up, then capture
        for attr in ("seg_indptr", "weight_indices") + (("permutation",) if mode == "decode" else ()):
            getattr(case, attr).copy_(getattr(other, attr))  # the next batch, in place
        for name in case.inputs:
            case.inputs[name].copy_(other.inputs[name])
        case.request_slots, case.request_lens = other.request_slots, other.request_lens  # the reference's routing
        if info is not None:
            info.seg_lens.copy_(case.seg_indptr[1:] - case.seg_indptr[:-1])
        replay()
        synchronize(device)
        replayed = {name: out.clone() for name, out in outputs.items()}
    else:
        replayed = layer(selection, True, case, info)
    reference = {name: reference_output(case, name) for name in case.weights}
    result["replay_vs_eager"] = relative(replayed, layer(selection, True, case, info))  # the same ops, eagerly
    result["replay_vs_eager_ops"] = relative(replayed, layer(selection, False, case, info))  # the ops outside graphs
    result["vs_float64"] = relative(replayed, reference)
    result["ok"] = result["replay_vs_eager"] <= 1e-3 and result["replay_vs_eager_ops"] <= 2e-2 and result["vs_float64"] <= 2e-2
    return result


def expected_eager(selection, verdicts: dict) -> dict:
    """The eager providers an emulated build with every op must get: native, except eager decode's
    permuted ops on Triton where Triton runs, unless their trial showed them sync-free
    (``providers.selection.EAGER_DECODE_AVOIDS_HOST_SYNCS``)."""
    from sglang_xpu_lora.providers import selection as rules
    from sglang_xpu_lora.providers import triton_ops

    def provider(op):
        moved = rules.EAGER_DECODE_AVOIDS_HOST_SYNCS and triton_ops.PROVIDER in selection.providers and op in rules.DECODE_OPS
        return "triton" if moved and not verdicts[op].capture_safe else "native"

    return {op: provider(op) for op in selection.choices}


def probe_build(build: str, device: torch.device, args) -> dict:
    """Steps 1-3 of the module docstring for ``build``, then step 4."""
    from sglang_xpu_lora import providers
    from sglang_xpu_lora.providers import capture_probe

    emulator = None
    if build != INSTALLED:
        from sglang_cpu_devsupport import kernel_emulator as emulator

        emulator.install(build)
    gpu = accelerator(device)
    try:
        before = providers.choose(device.type)
        probe = capture_probe.CaptureProbe()
        reserved = gpu.memory_reserved() if gpu else 0
        stream = gpu.current_stream() if gpu else None
        verdicts, trials = {}, []
        for setup, tokens in (("decode", args.decode_tokens), ("prefill", args.prefill_tokens)):
            case = capture_probe.ProbeCase(device, tokens, SLOTS, MAX_RANK, torch.bfloat16 if gpu else torch.float32)
            found = probe.try_ops(before.graph_candidates, case, before.bind_trial)
            trials += [{"setup": setup, "tokens": tokens, "op": op, "capture_safe": v.capture_safe, "reason": v.reason,
                        "ms": v.seconds * 1e3} for op, v in found.items()]
            verdicts = capture_probe.merge(verdicts, found)
        after = providers.choose(device.type, verdicts)
        state = {}
        if gpu:
            state = {"capturing_after": gpu.is_current_stream_capturing(),
                     "stream_restored_after": gpu.current_stream() == stream,
                     "reserved_mib_by_trials": (gpu.memory_reserved() - reserved) / 2**20}
        expected = "torch" if not gpu else BUILDS.get(build)  # installed: whatever the trials decided
        result = {
            "build": build,
            "eager": {op: c.provider.name for op, c in after.choices.items()},
            "graph": {op: c.provider.name for op, c in after.graph_choices.items()},
            "graph_reasons": {op: c.reason for op, c in after.graph_choices.items()},
            "trials": trials,
            "probe_ms_total": sum(t["ms"] for t in trials),
            **state,
            "layers": [layer_check(after, mode, device, args.quick) for mode in ("decode", "prefill")],
        }
        result["ok"] = (
            (build == INSTALLED or result["eager"] == expected_eager(after, verdicts))
            and (expected is None or set(result["graph"].values()) == {expected})
            and all(layer["ok"] for layer in result["layers"])
            and not state.get("capturing_after", False)
            and state.get("stream_restored_after", True)
        )
        return result
    finally:
        if emulator is not None:
            emulator.uninstall()


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--builds", type=lambda s: s.split(","),
                        help=f"comma-separated: emulated builds ({', '.join(BUILDS)}) and/or {INSTALLED} (the kernels present); "
                        f"default {INSTALLED} on xpu, else {','.join(BUILDS)}")
    parser.add_argument("--decode-tokens", type=int, default=128, help="tokens of the decode-graph set-up's trial")
    parser.add_argument("--prefill-tokens", type=int, default=512, help="tokens of the prefill-graph set-up's trial")
    parser.add_argument("--quick", action="store_true", help="a tiny layer (the CPU smoke run)")
    parser.add_argument("--out", type=Path, help="default: benchmarks/results/capture-probe-<device>.json")
    args = parser.parse_args(argv)
    os.environ["SGLANG_XPU_LORA_KERNELS"] = "auto"
    os.environ.pop("SGLANG_XPU_LORA_GRAPH_NATIVE", None)
    device = torch.device(args.device)
    args.out = args.out or RESULTS / f"capture-probe-{device.type}.json"
    builds = args.builds or ([INSTALLED] if device.type == "xpu" else list(BUILDS))
    results = [probe_build(build, device, args) for build in builds]
    payload = {"machine": machine(), "device": device.type, "ok": all(r["ok"] for r in results), "builds": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1))
    for r in results:
        print(f"{r['build']}: graph providers {sorted(set(r['graph'].values()))}, probe {r['probe_ms_total']:.1f} ms "
              f"over {len(r['trials'])} trials, layers {[(l['mode'], round(l['replay_vs_eager'], 6), round(l['vs_float64'], 4)) for l in r['layers']]}, "
              f"ok={r['ok']}")
    print(f"wrote {args.out}; ok={payload['ok']}")
    return 0 if payload["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
