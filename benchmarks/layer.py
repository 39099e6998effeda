"""Layer benchmark: what a server pays for LoRA in one decoder layer, against every SGLang LoRA
backend.

One layer's four LoRA'd linears (qkv, o, gate_up, down) with their base GEMMs, each called as
SGLang's LoRA layers call their backend (``sglang.srt.lora.layers``): ``forward_with_base(layer, x,
base_fn, lora_a, lora_b, output_offset, lora_offsets)``, whose default runs ``layer.apply_lora(
base_fn(), x)`` (:class:`LoraLinear`; ``triton_v2`` overrides it with its dense runner). Every
backend is SGLang's own class (ours for ``intel_xpu``), prepared by its own ``prepare_lora_batch``
(decode graphs: after its ``init_decode_cuda_graph_batch_info``), over SGLang's packed pool with
the adapters' real ranks (:class:`benchmarks.ops.Case`: 8 slots, distinct scalings 0.5-4.0).

Modes: ``graph`` (decode, each path captured in a CUDA/XPU graph, as SGLang's decode graphs),
``eager`` (decode without graphs), ``prefill`` (eager, 512-token requests). Paths:

* ``base``: the four base GEMMs alone (``F.linear``), the floor;
* ``triton``, ``csgmv``, ``triton_v2``, ``torch_native``: SGLang's backends;
* ``intel_xpu``: ``IntelXpuLoRABackend`` as ``SGLANG_XPU_LORA_KERNELS=auto`` selects it on the
  device (on CUDA: SGLang's Triton kernels); ``intel_xpu_portable``: its portable PyTorch ops
  (``SGLANG_XPU_LORA_KERNELS=torch``); ``intel_xpu_box``: the configuration an Intel box gets, over
  the emulated sgl-kernel-xpu build ``--emulated-build`` (default ``full``; on CUDA its native ops
  are the emulator's: eager times of this path measure the emulator, not a kernel; inside graphs
  it runs what the trial captures keep, as on the box). Not on an XPU, where ``intel_xpu`` runs
  the real build.

Timing (:func:`benchmarks.common.interleaved_replay_times`): the paths of a point are timed
together, device events around ``--calls`` back-to-back calls (graph replays, or eager layer calls)
of each path in turn, ``--rounds`` rounds (rounded up to a whole Williams design: each path in each
place, and after each other path, equally often); median and spread (slowest - fastest over the
median). So a drift of the GPU's speed over a point falls on every path alike (timed one path
after the other, the H200's figures moved by up to 10 % with the order of the paths; at 8192
prefill tokens, where the H200 runs at its power cap, ``triton_v2`` read 5.5 ms per layer when
always timed right after the slow ``csgmv``, 6.1 ms mostly right after the base GEMMs:
docs/performance.md). The first path of a point rotates by one per point (``--order-offset`` shifts it,
one per run). What a layer's time is made of, per path: :mod:`benchmarks.layer_profile`.
Per-forward work stays out: ``prepare_lora_batch`` (once per forward in a
server) is not timed; ``triton_v2`` builds its route in the first LoRA layer of a forward, so its
graph figures hold one route build (2-4 µs on an H200) where a server pays it once per forward.
Every output is checked against a float64 reference (base GEMM + a loop over the slots at real
rank): ``<path>_error`` is the largest ``max|out - ref| / max|ref|`` over the four linears, and
``--tolerance`` (bf16: 2e-2; float32 on CPU: 1e-4) fails the path at that point
(``<path>_failed``). A path that raises
records the error (``<path>_failed``) and the run goes on: on an Intel GPU ``triton_v2`` fails
this way in SGLang 0.5.23 (its expand kernels read offsets from a CUDA device only). Batches over
512 tokens (prefill 2048 and 8192) build ``triton_v2``'s route with SGLang's pure-Triton builder,
not its CUDA JIT alignment kernel (:func:`route_large_batches_in_triton`).

Row-parallel linears (o, down) are measured on one rank without the all-reduce: at TP 8 a server
adds it to every path alike.

Reported per point: ``base_us``, ``<path>_us`` (with ``_spread``), ``<path>_overhead_us`` (path -
base), ``best_peer`` (the fastest of ``triton``, ``csgmv``, ``triton_v2`` at the point) and
``<intel path>_vs_best_peer`` (time over the best peer's). The no-adapter batch (``adapters`` 0)
routes every request to the pool's base slot (rank 0), as SGLang does; ``triton_v2`` then runs no
LoRA kernels (its layers skip inactive batches; SGLang captures a separate no-LoRA graph for it).
On a CUDA GPU with ``nvidia-smi``, each point also records the GPU's median SM clock (``sm_mhz``),
largest power draw (``power_w``) and share of samples at the power cap (``power_capped``) from
``timed_from`` to ``timed_to`` (:mod:`benchmarks.clock_log`; samples in ``layer-<device>-clocks.csv``;
``--best-of`` keeps them per run, ``<column>_runs``).

    python -m benchmarks.layer --device cuda            # the H200 grid (8 minutes with rotated rounds; more with whole designs)
    python -m benchmarks.layer --device xpu             # an Intel GPU (the kit runs it)
    python -m benchmarks.layer --quick                  # CPU smoke run: tiny layer, torch paths
    python -m benchmarks.layer --plot-only benchmarks/results/layer-cuda.json
    python -m benchmarks.layer --device cuda --best-of run1/layer-cuda.json run2/layer-cuda.json run3/layer-cuda.json

Writes ``layer-<device>[-quick].{json,md,png}`` (and ``.partial.jsonl`` as points finish, without the clocks, which are read when the run ends) under
``--out`` (default ``benchmarks/results``); the JSON also records, per ``intel_xpu`` path, the
providers of its ops and where its dense tier serves with which plan tables (``intel_xpu_dense``:
a table named by ``SGLANG_XPU_LORA_PLANS`` comes first).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
import types
from datetime import datetime
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from benchmarks.common import (
    GRAPH_DEVICES,
    MODELS,
    RESULTS,
    ModelShape,
    capture,
    headless_pyplot,
    interleaved_replay_times,
    write,
)
from benchmarks.clock_log import CLOCK_COLUMNS, ClockLog, physical_gpu
from benchmarks.ops import MAX_LORAS, TINY, Case, kernels_env, reference_output

#: SGLang's LoRA backends measured as peers; the best of the first three is the target.
PEERS = ("triton", "csgmv", "triton_v2")
INTEL_PATHS = ("intel_xpu", "intel_xpu_portable", "intel_xpu_box")
PATHS = ("base", *PEERS, "torch_native", *INTEL_PATHS)
MODES = ("graph", "eager", "prefill")
#: Decode graphs are set up for this many requests (SGLang's capture bucket list tops out here).
GRAPH_MAX_BS = 256
#: Largest output error relative to float64 that passes, per measured dtype.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-4}
#: (max_lora_rank, adapters' real rank): below the max and at it.
RANK_POINTS = ((64, 16), (64, 64), (16, 16))


def _grid_gpu() -> list[tuple]:
    """Points ``(model, mode, max_rank, rank, adapters, tokens)`` of the GPU run, in the order
    they run (the decode graphs first: what a server's decode steps run)."""
    points = []
    decode = (1, 8, 32, 64, 128, 256)
    for model in MODELS:
        for (max_rank, rank), adapters in itertools.product(RANK_POINTS[:2], (1, 4, 8)):
            points += [(model, "graph", max_rank, rank, adapters, t) for t in decode]
        points += [(model, "graph", 64, 0, 0, t) for t in decode]
        for (max_rank, rank), adapters in itertools.product(RANK_POINTS[2:], (1, 4, 8)):
            points += [(model, "graph", max_rank, rank, adapters, t) for t in decode]
    for model in MODELS:
        for (max_rank, rank), adapters in itertools.product(RANK_POINTS[:2], (1, 8)):
            points += [(model, "prefill", max_rank, rank, adapters, t) for t in (512, 2048, 8192)]
        points += [(model, "prefill", 64, 0, 0, t) for t in (512, 8192)]
    for model in MODELS:
        for adapters in (1, 8):
            points += [(model, "eager", 64, 16, adapters, t) for t in (1, 32, 256)]
        points += [(model, "eager", 64, 0, 0, t) for t in (1, 256)]
    return points


def grid(args) -> list[tuple]:
    """The run's points, after the ``--models``/``--modes``/``--tokens``/``--adapters`` filters;
    ``--quick``: a tiny layer on CPU, one point per mode (and the no-adapter batch)."""
    if args.quick:
        points = [
            ("tiny", "eager", 16, 8, 4, 8),
            ("tiny", "prefill", 16, 16, 1, 1024),
            ("tiny", "eager", 16, 0, 0, 4),
        ]
        if torch.device(args.device).type in GRAPH_DEVICES:
            points.insert(0, ("tiny", "graph", 16, 8, 4, 8))
        return points
    keep = []
    for point in _grid_gpu():
        model, mode, _, _, adapters, tokens = point
        if (args.models and model not in args.models) or (args.modes and mode not in args.modes):
            continue
        if (args.tokens and tokens not in args.tokens) or (
            args.adapters is not None and adapters not in args.adapters
        ):
            continue
        keep.append(point)
    return keep


class LoraLinear:
    """One LoRA'd linear as SGLang's LoRA layers drive their backend: the attributes those layers
    set in ``set_lora_info`` (``lora_a``/``lora_b``, ``A_buffer``/``B_buffer``, the qkv layer's
    ``A_buffer_qkv``/``B_buffer_qkv``, ``output_offset`` on the device and ``output_offset_cpu``,
    ``lora_offsets``, the merged layer's ``use_gate_up_lora``), ``apply_lora`` making the backend
    calls of ``QKVParallelLinearWithLoRA`` (qkv), ``MergedColumnParallelLinearWithLoRA`` (gate_up)
    and ``RowParallelLinearWithLoRA`` (o, down), and :meth:`forward` the layers'
    ``forward_with_base``
    call (tests/integration/test_layer_benchmark.py checks the calls against SGLang's classes).

    ``weight``: base weight ``(out features, in features)``; ``a``: ``(slots, slices * max_rank,
    in)``; ``b``: ``(slots, out, max_rank)``; ``outs``: the slices' widths.
    """

    def __init__(
        self,
        kind: str,
        weight: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        outs: tuple,
        backend,
    ):
        self.kind, self.weight, self.lora_backend = kind, weight, backend
        self.lora_a = self.A_buffer = self.A_buffer_qkv = a
        self.lora_b = self.B_buffer = self.B_buffer_qkv = b
        offsets = [0, *itertools.accumulate(outs)]
        self.output_offset = torch.tensor(offsets, dtype=torch.int32, device=weight.device)
        self.output_offset_cpu = torch.tensor(offsets, dtype=torch.int32)
        self.lora_offsets = tuple(offsets)
        self.max_qkv_out_dim = self.max_out_dim = max(outs)
        self.use_gate_up_lora = kind == "gate_up"

    def apply_lora(self, base_output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``base_output`` plus this linear's LoRA, through the backend's ``run_*`` methods."""
        backend, offsets = self.lora_backend, dict(
            output_offset=self.output_offset, output_offset_cpu=self.output_offset_cpu
        )
        if self.kind == "qkv":
            return backend.run_qkv_lora(
                x=x,
                qkv_lora_a=self.A_buffer_qkv,
                qkv_lora_b=self.B_buffer_qkv,
                base_output=base_output,
                max_qkv_out_dim=self.max_qkv_out_dim,
                **offsets,
            )
        if self.kind == "gate_up":
            return backend.run_gate_up_lora(
                x=x,
                gate_up_lora_a=self.A_buffer,
                gate_up_lora_b=self.B_buffer,
                base_output=base_output,
                **offsets,
            )
        lora_a_output = backend.run_lora_a_sgemm(x, self.A_buffer)
        return backend.run_lora_b_sgemm(
            x=lora_a_output, weights=self.B_buffer, base_output=base_output, **offsets
        )

    def lora_active(self) -> bool:
        """SGLang's ``BaseLayerWithLoRA.lora_active`` outside a capture: a backend that skips
        inactive batches runs no LoRA when no request has an adapter (for graphs SGLang captures
        a separate no-LoRA graph for those backends)."""
        backend = self.lora_backend
        info = None if backend is None else backend.get_batch_info()
        if info is None:
            return False
        if not (backend.skip_inactive_lora_batches or backend.skip_inactive_dense_lora):
            return True
        return bool(info.has_active_lora)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Base GEMM plus LoRA, as ``ColumnParallelLinearWithLoRA.forward`` (and the row-parallel
        one without its all-reduce) runs it."""

        def base_fn():
            return F.linear(x, self.weight)

        if not self.lora_active():
            return base_fn()
        return self.lora_backend.forward_with_base(
            self, x, base_fn, self.lora_a, self.lora_b, self.output_offset, self.lora_offsets
        )


class Server:
    """One model's base weights and, per path, one backend for one ``max_lora_rank``, as a server
    holds them (decode-graph batch info set up once per backend)."""

    def __init__(self, model: ModelShape, max_rank: int, paths: list[str], dtype, device, args):
        self.model, self.max_rank, self.dtype, self.device = model, max_rank, dtype, device
        if (
            device.type == "cpu"
        ):  # SGLang's batch preparation pins host memory: a no-op without an accelerator
            from sglang_cpu_devsupport import pin_memory

            pin_memory.register()
        gen = torch.Generator(device="cpu").manual_seed(1234)
        self.weights = {
            name: (torch.randn(sum(outs), in_dim, generator=gen) * in_dim**-0.5).to(device, dtype)
            for name, (in_dim, outs) in model.modules().items()
        }
        self.backends: dict[str, object] = {}
        self.failures: dict[str, str] = {}
        for path in paths:
            if path == "base":
                continue
            try:
                self.backends[path] = make_backend(path, device, max_rank, dtype, args)
            except Exception as exc:  # recorded per path; the kit wants to know what fails where
                self.failures[path] = f"{type(exc).__name__}: {exc}"
        graphs = device.type in GRAPH_DEVICES and "graph" in (args.modes or MODES)
        for path, backend in list(self.backends.items()):
            if graphs:
                try:
                    backend.init_decode_cuda_graph_batch_info(GRAPH_MAX_BS, 1)
                except Exception as exc:
                    self.failures[f"{path}:graph"] = f"{type(exc).__name__}: {exc}"

    def layer(self, path: str, case: Case) -> list[tuple[LoraLinear, torch.Tensor]]:
        """The four linears of ``path`` over ``case``'s pool, each with its input."""
        backend = self.backends.get(path)
        return [
            (LoraLinear(name, self.weights[name], *case.weights[name], backend), case.inputs[name])
            for name in case.weights
        ]


def _use_emulated_build(build: Optional[str]) -> None:
    """Have exactly the emulated sgl-kernel-xpu ``build`` installed (None: none), so that each
    ``intel_xpu`` path's selection, made when its backend is built, sees only its own build."""
    from sglang_cpu_devsupport import kernel_emulator

    if kernel_emulator.installed_build != build:
        if kernel_emulator.installed_build is not None:
            kernel_emulator.uninstall()
        if build:
            kernel_emulator.install(build)


def route_large_batches_in_triton(runner) -> None:
    """Let ``triton_v2``'s dense runner (SGLang's ``DenseLoraRunner``) build the routes of batches
    over 512 tokens with SGLang's pure-Triton large builder, as the ``intel_xpu`` dense tier does
    (:func:`sglang_xpu_lora.dense.runner.large_aligned_route`), where SGLang calls its CUDA JIT
    alignment kernel, which the GPU carry does not hold (a tvm-ffi C++ build). Only the route
    builder differs; ``triton_v2``'s plans and kernels are SGLang's. The route is built once per
    forward, by its first linear: in eager and prefill points only the first, untimed, call
    builds it (:func:`measure_path`), so the figures hold no route build."""
    from sglang_xpu_lora.dense.runner import SMALL_ROUTE_ROWS, large_aligned_route

    build_route = runner._build_route

    def build_route_without_jit(key: tuple):
        if key[0] == "sorted" and runner.token_slots.numel() > SMALL_ROUTE_ROWS:
            return large_aligned_route(runner, key[1])
        return build_route(key)

    runner._build_route = build_route_without_jit


def make_backend(path: str, device: torch.device, max_rank: int, dtype, args):
    """SGLang's backend class for ``path`` (ours for the ``intel_xpu`` paths), built as SGLang's
    ``LoRAManager`` builds it, with ``MAX_LORAS`` slots.

    Raises:
        ValueError: an unknown path.
    """
    if path == "triton":
        from sglang.srt.lora.backend.triton_backend import TritonLoRABackend

        return TritonLoRABackend(MAX_LORAS, device)
    if path == "csgmv":
        from sglang.srt.lora.backend.chunked_backend import ChunkedSgmvLoRABackend

        return ChunkedSgmvLoRABackend(MAX_LORAS, device, server_args=None)
    if path == "triton_v2":
        from sglang.srt.lora.backend.triton_v2_backend import TritonV2LoRABackend

        backend = TritonV2LoRABackend(MAX_LORAS, device)
        route_large_batches_in_triton(backend.runner)
        return backend
    if path == "torch_native":
        from sglang.srt.lora.backend.torch_backend import TorchNativeLoRABackend

        return TorchNativeLoRABackend(MAX_LORAS, device)
    if path in INTEL_PATHS:
        from sglang_xpu_lora.backend.xpu import IntelXpuLoRABackend

        kernels = {"intel_xpu_portable": "torch", "intel_xpu_box": "auto"}.get(
            path, os.environ.get("SGLANG_XPU_LORA_KERNELS", "auto")
        )
        if (
            args.emulated_build
        ):  # the box path is built last (PATHS order): it keeps its build installed
            _use_emulated_build(args.emulated_build if path == "intel_xpu_box" else None)
        with kernels_env(kernels):
            backend = IntelXpuLoRABackend(MAX_LORAS, device)
        # The pool the plugin's hook hands over (its rank and dtype size the trial captures).
        backend.lora_memory_pool = types.SimpleNamespace(max_lora_rank=max_rank, dtype=dtype)
        return backend
    raise ValueError(f"unknown path {path!r}; known: {', '.join(PATHS)}")


def prepare(backend, case: Case, adapters: int, use_graph: bool) -> None:
    """``prepare_lora_batch`` of the case's batch as SGLang's ``LoRAManager`` calls it: the
    adapters' slots with their real ranks and scalings, every other slot rank 0; with no adapter,
    every request on the base slot 0 at rank 0. Then ``has_active_lora`` as the manager sets it."""
    if adapters:
        ranks = [case.real_rank if s < adapters else 0 for s in range(MAX_LORAS)]
        scalings = [float(v) if s < adapters else 0.0 for s, v in enumerate(case.scalings.tolist())]
        slots = list(case.request_slots)
    else:
        ranks, scalings, slots = [0] * MAX_LORAS, [0.0] * MAX_LORAS, [0] * len(case.request_slots)
    backend.prepare_lora_batch(case.forward_batch(), slots, ranks, scalings, use_graph)
    backend.batch_info.has_active_lora = any(ranks[s] > 0 for s in slots)


def reference(server: Server, case: Case, adapters: int) -> dict[str, dict[str, torch.Tensor]]:
    """float64 output of each linear, per path kind: ``"base"`` the base GEMM, ``"lora"`` the base
    GEMM plus (with adapters) the LoRA loop over the slots."""
    base = {
        name: case.inputs[name].double() @ weight.double().t()
        for name, weight in server.weights.items()
    }
    return {
        "base": base,
        "lora": (
            {name: ref + reference_output(case, name) for name, ref in base.items()}
            if adapters
            else base
        ),
    }


def relative_error(outputs: list[torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """Largest ``max|out - ref| / max|ref|`` over the linears (NaN anywhere gives NaN)."""
    errors = [
        float((o.double() - r).abs().max() / r.abs().max().clamp(min=1e-30))
        for o, r in zip(outputs, ref.values())
    ]
    return float("nan") if any(e != e for e in errors) else max(errors)


def ready_path(server: Server, path: str, case: Case, mode: str, adapters: int):
    """One path at one point made ready to time: ``(call, outputs)``, ``call`` one timed call (a
    graph replay, or an eager layer call) after one untimed call, ``outputs()`` the four outputs
    after the timed calls. Raises what the path raises."""
    backend = server.backends.get(path)
    use_graph = mode == "graph"
    layer = server.layer(path, case)

    def forward():
        if backend is not None and use_graph:
            backend.reset_routing_cache()  # SGLang: before every warm-up and capture forward
        return [linear.forward(x) for linear, x in layer]

    if backend is not None:
        prepare(backend, case, adapters, use_graph)
    if use_graph:
        graph, outputs = capture(forward, server.device)
        graph.replay()
        return graph.replay, lambda: outputs
    forward()
    return forward, forward


def measure_point(
    server: Server, paths: list[str], case: Case, mode: str, adapters: int, ref, args
) -> dict:
    """``<path>_us``, ``_spread`` and ``_error`` of each of ``paths`` at one point, timed together
    (:func:`benchmarks.common.interleaved_replay_times`, in the order of ``paths``), ``ref`` from
    :func:`reference` (``<path>_failed`` where a path raises or misses ``--tolerance``; a raise
    while timing fails every path of the point), and ``timed_from`` / ``timed_to``, the local
    times (ISO) around the timed calls, which the point's clocks cover."""
    result, ready = {}, {}
    for path in paths:
        if path != "base" and server.backends.get(path) is None:
            result[f"{path}_failed"] = server.failures.get(path, "not built")
        elif mode == "graph" and f"{path}:graph" in server.failures:
            result[f"{path}_failed"] = server.failures[f"{path}:graph"]
        else:
            try:
                ready[path] = ready_path(server, path, case, mode, adapters)
            except Exception as exc:
                result[f"{path}_failed"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    calls, rounds = (
        (args.prefill_calls, args.prefill_rounds) if mode == "prefill" else (args.calls, args.rounds)
    )
    try:
        timed_from = datetime.now()
        times = interleaved_replay_times(
            {path: call for path, (call, _) in ready.items()}, server.device, calls=calls, rounds=rounds
        )
        result.update(timed_from=timed_from.isoformat(), timed_to=datetime.now().isoformat())
    except Exception as exc:
        return {**result, **{f"{path}_failed": f"{type(exc).__name__}: {str(exc)[:300]}" for path in ready}}
    tolerance = args.tolerance or TOLERANCE[server.dtype]
    for path, (_, outputs) in ready.items():
        seconds, spread = times[path]
        try:
            error = relative_error(outputs(), ref["base" if path == "base" else "lora"])
        except Exception as exc:
            result[f"{path}_failed"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            continue
        result.update({f"{path}_us": seconds * 1e6, f"{path}_spread": spread, f"{path}_error": error})
        if not error <= tolerance:
            result[f"{path}_failed"] = f"output error {error:.3g} over tolerance {tolerance:g}"
    return result


def measure_path(server: Server, path: str, case: Case, mode: str, adapters: int, ref, args) -> dict:
    """:func:`measure_point` of one path."""
    return measure_point(server, [path], case, mode, adapters, ref, args)


def summarise(row: dict, paths: list[str]) -> None:
    """Add ``<path>_overhead_us``, ``best_peer``/``best_peer_us`` and the intel_xpu paths' ratios
    (over the best peer; ``_overhead_vs_best_peer``: LoRA overhead over the best peer's) to ``row``.
    A path that failed at the point has no time and takes no part."""
    timed = {p: row[f"{p}_us"] for p in paths if f"{p}_us" in row and f"{p}_failed" not in row}
    base = timed.get("base")
    if base is not None:
        for p, us in timed.items():
            if p != "base":
                row[f"{p}_overhead_us"] = us - base
    peers = {p: timed[p] for p in PEERS if p in timed}
    if not peers:
        return
    best = min(peers, key=peers.get)
    row["best_peer"], row["best_peer_us"] = best, peers[best]
    legacy = [peers[p] for p in ("triton", "csgmv") if p in peers]
    if "triton_v2" in peers and legacy:
        row["triton_v2_vs_best_legacy"] = peers["triton_v2"] / min(legacy)
    for p in INTEL_PATHS:
        if p in timed:
            row[f"{p}_vs_best_peer"] = timed[p] / peers[best]
            if base is not None and peers[best] > base:
                row[f"{p}_overhead_vs_best_peer"] = (timed[p] - base) / (peers[best] - base)


def default_paths(device: torch.device) -> list[str]:
    """Every path that runs on ``device``: SGLang's Triton backends on GPUs only (CPU: the torch
    paths and the emulated build's CPU kernels), the emulated box configuration not on an XPU."""
    if device.type == "cpu":
        return ["base", "torch_native", "intel_xpu_portable", "intel_xpu_box"]
    paths = list(PATHS)
    if device.type == "xpu":
        paths.remove("intel_xpu_box")
    return paths


def run(args) -> list[dict]:
    """Measure every point of the grid; rows also appended to ``<name>.partial.jsonl``. Stops
    starting points after ``--budget-seconds`` (the rows so far are the result, and
    ``args.cut_short`` says how many points were left)."""
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    paths = args.paths or default_paths(device)
    if not args.emulated_build and "intel_xpu_box" in paths:
        paths.remove("intel_xpu_box")
    if "intel_xpu_box" not in paths:
        args.emulated_build = None  # no emulator (nor its package) needed
    points = grid(args)
    rows, servers, started = [], {}, time.perf_counter()
    partial = Path(args.out) / f"{args.name}.partial.jsonl"
    partial.unlink(missing_ok=True)
    args.cut_short = 0
    for index, (model, mode, max_rank, rank, adapters, tokens) in enumerate(points):
        if time.perf_counter() - started > args.budget_seconds:
            args.cut_short = len(points) - index
            print(
                f"budget of {args.budget_seconds:.0f} s spent: {args.cut_short} points not run",
                flush=True,
            )
            break
        key = (model, max_rank)
        if key not in servers:
            servers.clear()  # one server at a time: its graphs' memory goes with it
            if device.type == "cuda":
                torch.cuda.empty_cache()
            shape = TINY if model == "tiny" else MODELS[model]
            servers[key] = Server(shape, max_rank, paths, dtype, device, args)
            args.backend_failures = {
                **getattr(args, "backend_failures", {}),
                **servers[key].failures,
            }
            args.intel_xpu_providers = {
                **getattr(args, "intel_xpu_providers", {}),
                **providers(servers[key]),
            }
            args.intel_xpu_dense = {
                **getattr(args, "intel_xpu_dense", {}),
                **dense_tiers(servers[key]),
            }
        server = servers[key]
        case_mode = "decode" if mode in ("graph", "eager") else "prefill"
        case = Case(
            server.model,
            max_rank,
            max(adapters, 1),
            tokens,
            case_mode,
            dtype,
            device,
            real_rank=rank or max_rank,
        )
        ref = reference(server, case, adapters)
        row = dict(
            model=model, mode=mode, max_rank=max_rank, rank=rank, adapters=adapters, tokens=tokens
        )
        first = (index + args.order_offset) % len(paths)
        point_paths = [
            path for path in paths[first:] + paths[:first]
            if not (path == "torch_native" and mode == "graph" and tokens > args.torch_native_graph_max)
        ]
        row.update(measure_point(server, point_paths, case, mode, adapters, ref, args))
        summarise(row, paths)
        rows.append(row)
        print(_line(row, paths), flush=True)
        with open(partial, "a") as handle:  # survives a timeout
            handle.write(json.dumps(row) + "\n")
    args.paths_run = paths
    return rows


def best_of_runs(runs: list[dict]) -> list[dict]:
    """Rows of several runs of the same grid (their JSON results) merged point by point: per path
    the fastest run's ``_us`` and ``_spread``, its ``_error`` the largest of the runs, and
    ``_runs_spread`` (slowest - fastest run) / fastest; a path that failed in any run keeps that
    failure. Ratios are recomputed from the merged times (:func:`summarise`). The clocks of a point
    (:data:`benchmarks.clock_log.CLOCK_COLUMNS`) are kept per run, in the runs' order, as
    ``<column>_runs`` (None for a run without them): a point's fastest path need not come from one run."""
    key = lambda r: (r["model"], r["mode"], r["max_rank"], r["rank"], r["adapters"], r["tokens"])  # noqa: E731
    merged: dict[tuple, dict] = {}
    for run_rows in runs:
        for row in run_rows["rows"]:
            merged.setdefault(key(row), []).append(row)
    rows = []
    for point_rows in merged.values():
        first = point_rows[0]
        row = {k: first[k] for k in ("model", "mode", "max_rank", "rank", "adapters", "tokens")}
        for p in PATHS:
            failed = [r[f"{p}_failed"] for r in point_rows if f"{p}_failed" in r]
            timed = [r for r in point_rows if f"{p}_us" in r]
            if failed:
                row[f"{p}_failed"] = failed[0]
            if timed:
                best = min(timed, key=lambda r: r[f"{p}_us"])
                times = [r[f"{p}_us"] for r in timed]
                row[f"{p}_us"], row[f"{p}_spread"] = best[f"{p}_us"], best[f"{p}_spread"]
                row[f"{p}_error"] = max(r[f"{p}_error"] for r in timed)
                row[f"{p}_runs_spread"] = (max(times) - min(times)) / min(times)
        for column in CLOCK_COLUMNS:
            if any(column in r for r in point_rows):
                row[f"{column}_runs"] = [r.get(column) for r in point_rows]
        summarise(row, list(PATHS))
        rows.append(row)
    return rows


def timing_by_mode(result: dict) -> dict[str, Optional[dict]]:
    """``{mode: {"calls", "rounds", "order"}}``: how each mode's figures in a result (a run's or a
    merge's JSON) were timed: back-to-back calls x rounds, and the order of the paths in a round
    (``williams``: :func:`benchmarks.common.balanced_orders`; ``rotated``: by one per round, the
    order of the runs from before it). A merge records it (its modes can come from runs of other
    settings); a run's come from its settings, ``prefill_calls`` x ``prefill_rounds`` for prefill
    and ``calls`` x ``rounds`` for the decode modes. A merge from before merges recorded it gives
    None per mode: its top-level settings are its first run's, not those behind each mode."""
    if "timing_by_mode" in result:
        return result["timing_by_mode"]
    modes = dict.fromkeys(r["mode"] for r in result["rows"])
    if "runs" in result:
        return dict.fromkeys(modes)
    order = result.get("order", "rotated")
    return {
        mode: {"calls": result["prefill_calls"], "rounds": result["prefill_rounds"], "order": order} if mode == "prefill"
        else {"calls": result["calls"], "rounds": result["rounds"], "order": order}
        for mode in modes
    }


def providers(server: Server) -> dict:
    """What each ``intel_xpu`` path's selection runs per op, eager / graph."""
    out = {}
    for path in INTEL_PATHS:
        backend = server.backends.get(path)
        if backend is not None:
            sel = backend.op_selection
            out[path] = {
                op: f"{sel.choices[op].provider.name} / {sel.graph_choices[op].provider.name}"
                for op in sel.choices
            }
    return out


def dense_tiers(server: Server) -> dict:
    """Where each ``intel_xpu`` path runs its linears on the dense tier, and with which plans:
    ``{"plans": the plan table's sources, first match first (SGLANG_XPU_LORA_PLANS, the shipped
    table, SGLang's), "graphs": graph batches, "eager_from_tokens": eager batches from this many
    tokens (None: never)}``, or None where the path has no dense tier."""
    out = {}
    for path in INTEL_PATHS:
        backend = server.backends.get(path)
        if backend is None:
            continue
        dense, selection = getattr(backend, "dense", None), backend.op_selection
        out[path] = None if dense is None else {
            "plans": list(dense.plans.sources),
            "graphs": selection.dense_tier_serves(True),
            "eager_from_tokens": backend.eager_dense_min_tokens if selection.dense_tier_serves(False) else None,
        }
    return out


def _line(row: dict, paths: list[str]) -> str:
    point = f"r{row['rank']}/{row['max_rank']} a{row['adapters']} t{row['tokens']}"
    head = f"{row['model']} {row['mode']} {point}:"
    cells = [
        (
            f"{p} {row[p + '_us']:.1f}" + ("!" if p + "_failed" in row else "")
            if p + "_us" in row
            else f"{p} FAIL"
        )
        for p in paths
        if p + "_us" in row or p + "_failed" in row
    ]
    ratio = row.get("intel_xpu_vs_best_peer")
    return " ".join(
        [head, *cells] + ([f"| intel_xpu/best {ratio:.2f} ({row['best_peer']})"] if ratio else [])
    )


COLUMNS = [
    "model",
    "mode",
    "max_rank",
    "rank",
    "adapters",
    "tokens",
    "base_us",
    "triton_us",
    "csgmv_us",
    "triton_v2_us",
    "torch_native_us",
    "intel_xpu_us",
    "intel_xpu_portable_us",
    "intel_xpu_box_us",
    "best_peer",
    "intel_xpu_vs_best_peer",
    "intel_xpu_box_vs_best_peer",
    "triton_v2_overhead_us",
    "intel_xpu_overhead_us",
    "triton_v2_vs_best_legacy",
]


def plot(
    rows: list[dict], path: Path, *, rank: int = 16, max_rank: int = 64, adapters: int = 8
) -> None:
    """Graph-captured decode: layer time against tokens, one line per path, base GEMMs shaded as
    the floor; one panel per model."""
    plt = headless_pyplot()
    if plt is None or not rows:  # no matplotlib, or no point measured (a run its budget cut before the first)
        return

    models = [m for m in dict.fromkeys(r["model"] for r in rows)]
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        chosen = [
            r
            for r in rows
            if r["model"] == model
            and r["mode"] == "graph"
            and r["adapters"] == adapters
            and r["rank"] == rank
            and r["max_rank"] == max_rank
        ]
        if not chosen:
            chosen = [r for r in rows if r["model"] == model]
        tokens = [r["tokens"] for r in chosen]
        for p in PATHS:
            points = [
                (r["tokens"], r[f"{p}_us"])
                for r in chosen
                if f"{p}_us" in r and f"{p}_failed" not in r
            ]
            if not points:
                continue
            if p == "base":
                ax.fill_between(*zip(*points), 0, color="0.85", label="base GEMMs (floor)")
                ax.plot(*zip(*points), "k-", lw=1)
            else:
                ax.plot(
                    *zip(*points),
                    "-o" if p.startswith("intel") else "--s",
                    ms=3,
                    label=p,
                    color=f"C{PATHS.index(p)}",
                )
        ax.set(
            xscale="log",
            xlabel="decode tokens (requests)",
            ylabel="µs per layer (qkv+o+gate_up+down, base included)",
            title=f"{model}: rank {rank} of max {max_rank}, {adapters} adapters, graphs",
        )
        if tokens:
            ax.set_xticks(sorted(set(tokens)), [str(t) for t in sorted(set(tokens))])
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--quick", action="store_true", help="tiny layer, one point per mode: the smoke test"
    )
    names = lambda s: s.split(",")  # noqa: E731
    numbers = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    parser.add_argument("--paths", type=names, help=f"comma-separated subset of {','.join(PATHS)}")
    parser.add_argument("--models", type=names)
    parser.add_argument("--modes", type=names, help="graph, eager, prefill")
    parser.add_argument("--tokens", type=numbers)
    parser.add_argument("--adapters", type=numbers, help="adapter counts (0: the no-adapter batch)")
    parser.add_argument(
        "--calls", type=int, help="back-to-back calls per timed round, decode (default 40; quick 3)"
    )
    parser.add_argument("--rounds", type=int, help="timed rounds, decode (default 5; quick 2)")
    parser.add_argument(
        "--prefill-calls", type=int, help="as --calls, prefill (default 8; quick 1)"
    )
    parser.add_argument(
        "--prefill-rounds", type=int, help="as --rounds, prefill (default 3; quick 2)"
    )
    parser.add_argument(
        "--torch-native-graph-max",
        type=int,
        default=64,
        help="torch_native in decode graphs only up to this many tokens (it loops over requests)",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        help="largest output error relative to float64 "
        "(default: 2e-2 in bfloat16 on a GPU, 1e-4 in float32 on CPU)",
    )
    parser.add_argument(
        "--emulated-build",
        default="full",
        help="emulated sgl-kernel-xpu build of the intel_xpu_box path ('' to leave the path out)",
    )
    parser.add_argument(
        "--budget-seconds",
        type=float,
        default=float("inf"),
        help="start no point after this long (the rows so far are written)",
    )
    parser.add_argument(
        "--order-offset",
        type=int,
        default=0,
        help="the paths are measured in an order rotated by one per point, plus this offset (give "
        "each of several runs its own): a path always measured after the others can read slower",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--best-of", nargs="+", metavar="RUN_JSON",
                        help="merge runs of one grid (their layer-<device>.json) into layer-<device>.json, best run per point and path")
    parser.add_argument("--keep-other-modes", type=Path, metavar="EARLIER_JSON",
                        help="with --best-of: keep this earlier result's points of the modes the runs did not measure")
    parser.add_argument(
        "--plot-only", type=Path, help="redraw the plot of an existing results JSON"
    )
    args = parser.parse_args(argv)
    if args.plot_only:
        plot(json.loads(args.plot_only.read_text())["rows"], args.plot_only.with_suffix(".png"))
        return
    if args.best_of:
        runs = [json.loads(Path(f).read_text()) for f in args.best_of]
        rows = best_of_runs(runs)
        name = f"layer-{args.device}"
        extra = {k: v for k, v in runs[0].items() if k != "rows"}  # the GPU machine of the runs
        extra["runs"] = [r.get("machine", {}).get("date") for r in runs]
        timing: dict = {}  # per mode: the runs that measured it were timed alike, or they are not merged
        for path, run_timing in zip(args.best_of, map(timing_by_mode, runs)):
            for mode, settings in run_timing.items():
                if timing.setdefault(mode, settings) != settings:
                    parser.error(f"--best-of: {path} timed {mode} as {settings}, an earlier run as {timing[mode]}; "
                                 "a point's best of runs compares runs timed alike")
        extra["timing_by_mode"] = timing
        if args.keep_other_modes:  # an earlier result's points of the modes these runs did not measure
            earlier = json.loads(args.keep_other_modes.read_text())
            measured = {r["mode"] for r in rows}
            kept = [r for r in earlier["rows"] if r["mode"] not in measured]
            rows = [*rows, *kept]
            if kept:
                extra["runs_of_other_modes"] = list(dict.fromkeys(
                    [*earlier.get("runs", [earlier["machine"].get("date")]), *earlier.get("runs_of_other_modes", [])]
                ))
                extra["modes_from_runs"] = sorted(measured)
                kept_timing = {m: t for m, t in timing_by_mode(earlier).items() if m in {r["mode"] for r in kept}}
                extra["timing_by_mode"] = {**timing, **kept_timing}
        write(name, rows, COLUMNS, args.out, extra=extra)
        plot(rows, Path(args.out) / f"{name}.png")
        return
    for key, full, quick in (
        ("calls", 40, 3),
        ("rounds", 5, 2),
        ("prefill_calls", 8, 1),
        ("prefill_rounds", 3, 2),
    ):
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    args.name = f"layer-{args.device}" + ("-quick" if args.quick else "")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    device = torch.device(args.device)
    gpu = physical_gpu(torch.cuda.current_device()) if device.type == "cuda" else "0"
    with ClockLog(Path(args.out) / f"{args.name}-clocks.csv", enabled=device.type == "cuda", gpu=gpu) as clocks:
        rows = run(args)
    for row in rows:  # the log is closed: every sample is on disk
        if "timed_from" in row:
            row.update(clocks.window(datetime.fromisoformat(row["timed_from"]), datetime.fromisoformat(row["timed_to"])))
    extra = {
        "paths": args.paths_run,
        "peers": list(PEERS),
        "graph_max_bs": GRAPH_MAX_BS,
        "calls": args.calls,
        "rounds": args.rounds,
        "order": "williams",  # rounds rounded up to whole designs: 2n for an odd n of paths, n for an even n
        "order_offset": args.order_offset,
        "prefill_calls": args.prefill_calls,
        "prefill_rounds": args.prefill_rounds,
        "tolerance": args.tolerance,
        "emulated_build": args.emulated_build or None,
        "intel_xpu_providers": getattr(args, "intel_xpu_providers", {}),
        "intel_xpu_dense": getattr(args, "intel_xpu_dense", {}),
        "backend_failures": getattr(args, "backend_failures", {}),
        "points_not_run": args.cut_short,
    }
    write(args.name, rows, COLUMNS, args.out, extra=extra)
    plot(rows, Path(args.out) / f"{args.name}.png")


if __name__ == "__main__":
    main()
