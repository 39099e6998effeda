"""Op-level benchmark: one decoder layer's LoRA work (qkv, o, gate_up, down), per module and whole,
for ``intel_xpu``'s providers against peers measured in the same run.

Every path reads one pool: SGLang's packed layout (stacked LoRA-A slice ``p`` at row ``p * r``),
zero tails (the plugin's pool patch), real ranks. ``intel_xpu`` tiers, each called as
``IntelXpuLoRABackend`` routes a layer (a shrink's slices moved to ``p * max_lora_rank`` by one
gather before a native or portable multi-slice expand, :mod:`sglang_xpu_lora.providers.slice_layout`;
its index, built once per batch by the backend, is built once per point here and not timed):

* ``portable``: the portable provider for every op;
* ``intel_xpu``: the op tables ``SGLANG_XPU_LORA_KERNELS`` (default ``auto``) selects on the device
  (:func:`sglang_xpu_lora.providers.choose`), the eager table timed eagerly and the graph table
  (native ops only where a trial capture passed, as at graph set-up: ``graph_verdicts`` in the
  JSON) in a CUDA or XPU graph. Without native ops on the device that is SGLang's Triton kernels in
  both modes.
  ``--emulated-build`` installs an emulated sgl-kernel-xpu build first: the configuration a real
  Intel box gets (native ops present, outside graphs; inside graphs the ops the selection keeps,
  Triton for those that are not capture-safe). Its native ops run only where the emulator has
  kernels for the device; ``intel_xpu_providers`` in the JSON says what each op ran on, and eager
  times of emulated native ops measure the emulator, not a kernel.

Peers: SGLang's ``torch_native`` LoRA ops (its eager "control" path: one GEMM per merged segment and
slice, from ``sglang.srt.lora.torch_ops.lora_ops``) everywhere; on a CUDA or XPU GPU also SGLang's
Triton dense ops (``sglang.kernels.ops.lora.dense``, the ``triton`` backend) and chunked-SGMV ops (the
``csgmv`` backend). On a GPU every path is also captured in a CUDA (or XPU) graph. Points with
``real_rank < rank`` have adapters below ``max_lora_rank``.

Decode batches give each request (one token) a random adapter and route them as SGLang's Triton
backend does for decode (tokens sorted by slot, chunked SGMV with a permutation); prefill batches are
512-token requests, each with a random adapter (contiguous segments). The pool has 8 slots.

    python -m benchmarks.ops                  # CPU, default grid (minutes)
    python -m benchmarks.ops --quick          # a few seconds: the smoke test
    python -m benchmarks.ops --device cuda    # GPU, with Triton tiers, peers and CUDA graphs
    python -m benchmarks.ops --device xpu     # Intel GPU: the real sgl-kernel-xpu ops, XPU graphs
    python -m benchmarks.ops --device cuda --emulated-build full --points below-max-rank
                                              # intel_xpu as on an Intel box, adapters below max rank

On CPU the ``intel_xpu`` tier runs only under ``TRITON_INTERPRET=1`` (Triton's interpreter, with
``SGLANG_XPU_LORA_KERNELS=triton``: ``auto`` never picks the interpreter), and ``--quick`` then uses a
tiny layer shape: a smoke test, not a measurement.

As a server runs them, the B ops add into the layer's base output (``Case.base_outputs``; no
zero-fill kernels), and graph figures are device events around back-to-back replays
(:func:`benchmarks.common.replay_time`), not one replay and a synchronize.

Writes ``benchmarks/results/ops-<device>.{json,md,png}``; ``speedup_vs_torch_native`` is torch_native
time / portable time, ``graph_ratio_vs_*`` a path's graph time / the peer's graph time, and
``intel_xpu_graph_vs_best_peer`` the tier's graph time / the faster of ``triton`` and ``csgmv``,
``intel_xpu_vs_triton`` its eager time / ``triton``'s.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import random
import types
from pathlib import Path
from typing import Callable, Optional

import torch

from benchmarks.common import GRAPH_DEVICES, MODELS, RESULTS, ModelShape, capture, headless_pyplot, replay_time, time_call, write
from sglang_xpu_lora.providers import slice_layout, torch_ops, triton_ops

MAX_LORAS = 8
PREFILL_REQUEST_TOKENS = 512
#: A layer small enough for Triton's interpreter on CPU (the --quick smoke run only).
TINY = ModelShape("tiny", hidden=32, q=32, kv=16, intermediate=48)


class Case:
    """Weights and routing metadata for one (model, rank, adapters, tokens, mode) point."""

    def __init__(self, model: ModelShape, rank: int, num_adapters: int, tokens: int, mode: str, dtype, device, seed=0,
                 real_rank: Optional[int] = None):
        rng = random.Random(seed)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        self.model, self.rank, self.tokens, self.mode, self.device = model, rank, tokens, mode, device
        self.real_rank = real = real_rank or rank
        self.weights = {}  # SGLang's packed pool, zero tails (the plugin's pool patch)
        for name, (in_dim, outs) in model.modules().items():
            a = torch.zeros(MAX_LORAS, len(outs) * rank, in_dim)
            a[:, : len(outs) * real] = torch.randn(MAX_LORAS, len(outs) * real, in_dim, generator=gen) * 0.02
            b = torch.zeros(MAX_LORAS, sum(outs), rank)
            b[:, :, :real] = torch.randn(MAX_LORAS, sum(outs), real, generator=gen) * 0.02
            self.weights[name] = (a.to(device, dtype), b.to(device, dtype), outs)
        self.inputs = {name: torch.randn(tokens, in_dim, generator=gen).to(device, dtype) for name, (in_dim, _) in model.modules().items()}
        #: Per module, the base output its B op adds into (:meth:`add_base_outputs`), or None.
        self.base_outputs: Optional[dict] = None
        if mode == "decode":
            request_slots = [rng.randrange(num_adapters) for _ in range(tokens)]
            request_lens = [1] * tokens
        else:
            n = max(1, tokens // PREFILL_REQUEST_TOKENS)
            request_slots = [rng.randrange(num_adapters) for _ in range(n)]
            request_lens = [tokens // n] * n
        self.request_slots, self.request_lens = request_slots, request_lens
        self.ranks = torch.full((MAX_LORAS,), real, dtype=torch.int32, device=device)
        # Distinct scalings per adapter (0.5 .. 4.0): a kernel that applies one adapter's scaling to
        # every segment shows up in the max-error columns.
        self.scalings = torch.linspace(0.5, 4.0, MAX_LORAS, dtype=torch.float32, device=device)
        slot_per_token = torch.tensor([s for s, n in zip(request_slots, request_lens) for _ in range(n)], device=device)
        if mode == "decode":  # SGLang's _build_sgemm_routing: sort by slot, one segment per slot
            self.permutation = torch.argsort(slot_per_token, stable=True).to(torch.int32)
            counts = torch.bincount(slot_per_token, minlength=MAX_LORAS)
            self.seg_indptr = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
            self.weight_indices = torch.arange(MAX_LORAS, dtype=torch.int32, device=device)
        else:
            self.permutation = None
            lens = torch.tensor(request_lens)
            self.seg_indptr = torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(torch.int32).to(device)
            self.weight_indices = torch.tensor(request_slots, dtype=torch.int32, device=device)
        self.offsets = {
            name: torch.tensor([0, *itertools.accumulate(outs)], dtype=torch.int32, device=device)
            for name, (_, _, outs) in self.weights.items()
        }
        #: The portable ops' routing cache of the current batch (:meth:`begin_batch`).
        self.routing = torch_ops.RoutingCache()
        #: The slice-spacing gather index per slice count (IntelXpuLoRABackend: once per batch).
        self.spacing = {
            n: slice_layout.spacing_index(self.seg_indptr, self.weight_indices, self.ranks, tokens, n, rank, self.permutation)
            for n in {len(outs) for _, _, outs in self.weights.values()} if n > 1
        }

    def add_base_outputs(self) -> None:
        """Give every module's B op a base output to add into, as SGLang's layers pass one (no
        zero-fill kernel in the op). Zeros: :meth:`zero_base_outputs` before a checked call makes
        its output the LoRA term alone; timed calls accumulate into them."""
        self.base_outputs = {name: torch.zeros(self.tokens, sum(outs), dtype=a.dtype, device=self.device)
                             for name, (a, _, outs) in self.weights.items()}

    def base_output(self, name: str) -> Optional[torch.Tensor]:
        """Module ``name``'s base output (:meth:`add_base_outputs`), None without them."""
        return None if self.base_outputs is None else self.base_outputs[name]

    def zero_base_outputs(self) -> None:
        """Zero the base outputs, so that the next call's output is the LoRA term alone."""
        for out in (self.base_outputs or {}).values():
            out.zero_()

    def begin_batch(self) -> None:
        """Start a batch: a new routing cache for the portable ops, as a backend's batch binds one."""
        self.routing = torch_ops.RoutingCache()

    @functools.cached_property
    def launches(self):
        """The case's own launch cache (``triton_launch.TritonLaunches``) for the ops that launch
        through one (the Triton ops: their compiled kernels, kept across the case's batches, as a
        backend keeps its own), made at their first call."""
        from sglang_xpu_lora.providers.triton_launch import TritonLaunches

        return TritonLaunches()

    def min_bytes(self) -> int:
        """Bytes a perfect kernel moves for the layer: each used adapter's A and B once, the inputs
        read once, the outputs written once."""
        used = len(set(self.request_slots))
        total = 0
        for name, (a, b, outs) in self.weights.items():
            total += used * (a[0].numel() + b[0].numel()) * a.element_size() * self.real_rank // self.rank
            total += self.inputs[name].numel() * a.element_size() + self.tokens * sum(outs) * a.element_size()
        return total

    # --- intel_xpu's providers, called as IntelXpuLoRABackend routes a layer -----------------------

    def run_module(self, ops, name: str, reads_spaced: Callable[[str], bool], **extra) -> torch.Tensor:
        """Module ``name`` through the op table ``ops`` (a provider module or an ``OpSelection``
        table; keyword calls): a permuted (decode) batch through the chunked shrink and expand, a
        contiguous one through ``sgemm_lora_a_fwd`` and the B op of the module's slice count. The
        shrink's output is re-spaced when ``reads_spaced(expand op)`` and there is more than one
        slice. ``extra`` goes to every op (the Triton provider's ``batch_info``)."""
        a, b, outs = self.weights[name]
        x, n = self.inputs[name], len(outs)
        meta = dict(seg_indptr=self.seg_indptr, weight_indices=self.weight_indices, lora_ranks=self.ranks, **extra)
        if self.permutation is not None:
            expand_op = "chunked_sgmv_lora_expand_fwd"
            mid = ops.chunked_sgmv_lora_shrink_fwd(
                input_x=x, weights=a, num_slices=n, num_segments=MAX_LORAS, permutation=self.permutation, **meta
            )
        else:
            expand_op = {3: "qkv_lora_b_fwd", 2: "gate_up_lora_b_fwd", 1: "sgemm_lora_b_fwd"}[n]
            mid = ops.sgemm_lora_a_fwd(input_x=x, weights=a, num_slices=n, **meta)
        if n > 1 and reads_spaced(expand_op):
            mid = slice_layout.spaced_slices(mid, self.spacing[n])
        expand = dict(input_x=mid, scalings=self.scalings, base_output=self.base_output(name), **meta)
        if self.permutation is not None:
            return ops.chunked_sgmv_lora_expand_fwd(
                weights=b, slice_offsets=self.offsets[name], max_slice_size=max(outs), num_slices=n,
                num_segments=MAX_LORAS, permutation=self.permutation, **expand,
            )
        if n == 3:
            return ops.qkv_lora_b_fwd(qkv_lora_b=b, output_offset=self.offsets[name], max_qkv_out_dim=max(outs), **expand)
        if n == 2:
            return ops.gate_up_lora_b_fwd(gate_up_lora_b=b, output_dim=outs[0], **expand)
        return ops.sgemm_lora_b_fwd(weights=b, **expand)

    def portable(self, name: str) -> torch.Tensor:
        return self.run_module(torch_ops, name, lambda op: True, routing=self.routing)

    def intel_xpu_fn(self, selection, use_graph: bool) -> Callable[[str], torch.Tensor]:
        """The layer through ``selection``'s eager or graph table (an ``OpSelection``), with the
        batch info SGLang's Triton backend builds for its Triton ops (real ranks; decode: one
        segment per slot, tokens sorted by slot; prefill: one segment per request)."""
        from benchmarks.triton_peers import dense_batch_info

        info = dense_batch_info(self) if triton_ops.PROVIDER in selection.providers else None
        table = self.with_batch_state(selection, use_graph)
        return lambda name: self.run_module(
            table, name, lambda op: selection.reads_spaced_slices(op, use_graph), batch_info=info
        )

    def with_batch_state(self, selection, use_graph: bool) -> types.SimpleNamespace:
        """``selection``'s eager or graph table, its portable ops given the routing cache of the
        case's current batch (:meth:`begin_batch`) and its Triton ops the case's launch cache
        (:attr:`launches`), as the backend's bound ops get theirs."""
        table = selection.for_graph(use_graph)
        chosen = selection.graph_choices if use_graph else selection.choices

        def portable(fn):
            return lambda **kwargs: fn(**kwargs, routing=self.routing)

        def launching(fn):
            return lambda **kwargs: fn(**kwargs, launches=self.launches)

        def with_state(op, provider):
            fn = getattr(table, op)
            return portable(fn) if provider.caches_routing else launching(fn) if provider.uses_launch_cache else fn

        return types.SimpleNamespace(**{op: with_state(op, choice.provider) for op, choice in chosen.items()})

    # --- whole backends, through their run_* methods (what a user gets) ------------------------------

    def forward_batch(self):
        """The fields of SGLang's ``ForwardBatch`` that LoRA batch preparation reads, for the case."""
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        fb = types.SimpleNamespace(
            forward_mode=ForwardMode.DECODE if self.mode == "decode" else ForwardMode.EXTEND,
            batch_size=len(self.request_slots), return_logprob=False, spec_info=None,
            extend_seq_lens_cpu=None, extend_seq_lens=None, extend_num_tokens=None,
        )
        if self.mode != "decode":
            fb.extend_seq_lens_cpu, fb.extend_num_tokens = list(self.request_lens), sum(self.request_lens)
            fb.extend_seq_lens = torch.tensor(self.request_lens, dtype=torch.int32, device=self.device)
        return fb

    def backend_fn(self, backend_name: str) -> Callable[[str], torch.Tensor]:
        """The layer through a whole LoRA backend on SGLang's packed pool, after its
        ``prepare_lora_batch`` of the case's batch: ``intel_xpu`` (``IntelXpuLoRABackend`` as
        ``auto`` selects it on a device without native kernels: SGLang's Triton kernels) or
        ``triton`` (SGLang's ``TritonLoRABackend``). Each module is called as SGLang's LoRA layers call the backend."""
        from sglang.srt.lora.backend.triton_backend import TritonLoRABackend

        from sglang_xpu_lora.backend.xpu import IntelXpuLoRABackend

        if backend_name == "triton":
            backend = TritonLoRABackend(max_loras_per_batch=MAX_LORAS, device=self.device)
        else:
            with kernels_env("triton"):  # auto's choice on a GPU without sgl-kernel-xpu (and on CPU for smoke runs)
                backend = IntelXpuLoRABackend(max_loras_per_batch=MAX_LORAS, device=self.device)
            backend.lora_memory_pool = types.SimpleNamespace(max_lora_rank=self.rank)
        ranks, scalings = [self.real_rank] * MAX_LORAS, self.scalings.tolist()
        backend.prepare_lora_batch(self.forward_batch(), list(self.request_slots), ranks, scalings, False)

        def run(name):
            a, b, outs = self.weights[name]
            x, offsets, base = self.inputs[name], self.offsets[name], self.base_output(name)
            if len(outs) == 3:
                return backend.run_qkv_lora(
                    x=x, qkv_lora_a=a, qkv_lora_b=b, output_offset=offsets, max_qkv_out_dim=max(outs), base_output=base
                )
            if len(outs) == 2:
                return backend.run_gate_up_lora(x=x, gate_up_lora_a=a, gate_up_lora_b=b, output_offset=offsets, base_output=base)
            return backend.run_lora_b_sgemm(x=backend.run_lora_a_sgemm(x, a), weights=b, output_offset=offsets, base_output=base)

        return run

    # --- SGLang torch_native (eager control path) ---------------------------------------------------

    def torch_native_fn(self) -> Callable[[str], torch.Tensor]:
        from sglang.srt.lora.torch_ops import lora_ops

        # TorchNativeLoRABackend.prepare_lora_batch merges consecutive requests sharing an adapter.
        slots, lens = [], []
        for slot, n in zip(self.request_slots, self.request_lens):
            if slots and slots[-1] == slot:
                lens[-1] += n
            else:
                slots.append(slot)
                lens.append(n)
        wi, sl = torch.tensor(slots), torch.tensor(lens)
        ranks, scalings = self.ranks.cpu(), self.scalings.cpu()

        def run(name):
            a, b, outs = self.weights[name]
            mid = lora_ops.sgemm_lora_a_fwd(self.inputs[name], a, wi, sl, ranks, scalings, len(outs))
            return lora_ops.sgemm_lora_b_fwd(mid, b, wi, sl, ranks, self.offsets[name].cpu(), self.base_output(name))

        return run


@contextlib.contextmanager
def kernels_env(value: str):
    """``SGLANG_XPU_LORA_KERNELS=value`` for the block (the selection reads it at construction)."""
    saved = os.environ.get("SGLANG_XPU_LORA_KERNELS")
    os.environ["SGLANG_XPU_LORA_KERNELS"] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ["SGLANG_XPU_LORA_KERNELS"]
        else:
            os.environ["SGLANG_XPU_LORA_KERNELS"] = saved


def measure(row: dict, key: str, fn: Callable[[], object], device, args) -> None:
    """``row[key + "_ms"]``: the best of ``args.repeats`` timings of ``fn`` (each the median of a
    :func:`time_call`), and with repeats ``row[key + "_spread"]``: worst / best - 1."""
    times = [time_call(fn, device, min_seconds=args.seconds) for _ in range(args.repeats)]
    row[f"{key}_ms"] = min(times) * 1e3
    if args.repeats > 1:
        row[f"{key}_spread"] = max(times) / min(times) - 1


def layer(fn: Callable[[str], torch.Tensor], case: Case) -> Callable[[], None]:
    """One layer's LoRA work. Each call starts a batch (a new routing cache for the portable ops),
    as ``prepare_lora_batch`` does, so routing is paid once per layer here (once per forward in SGLang)."""

    def run():
        case.begin_batch()
        for name in case.weights:
            fn(name)

    return run


def graph(fn: Callable[[], object], device: torch.device) -> Callable[[], None]:
    """Capture ``fn`` in a CUDA or XPU graph (``device``'s type) and return its replay."""
    return capture(fn, device)[0].replay


def check_graph_replay(device, dtype) -> dict:
    """Capture a decode layer of the portable path in a CUDA graph with one batch's routing, refill
    the index buffers in place with another batch's (as SGLang's graph runner does), replay, and
    compare with eager execution of the second batch: routing cached during capture must be
    recomputed by every replay, not frozen. Returns max relative errors (``replay_error`` should
    be ~0; ``batches_differ`` shows the two routings give different outputs, so the check bites)."""
    model = MODELS["llama-3.1-8b"]
    case = Case(model, 16, 8, 64, "decode", dtype, device, seed=1)
    other = Case(model, 16, 8, 64, "decode", dtype, device, seed=2)  # other adapters per request
    case.add_base_outputs()  # the B ops add into the layer's output, as in serving
    outputs = {}

    def forward():
        case.begin_batch()
        for name in case.weights:
            outputs[name] = case.portable(name)

    def relative(a, b):
        return max(((a[n].float() - b[n].float()).abs().max() / b[n].float().abs().max()).item() for n in b)

    replay = graph(forward, device)
    first = {name: out.clone() for name, out in outputs.items()}
    for attr in ("seg_indptr", "weight_indices", "permutation"):
        getattr(case, attr).copy_(getattr(other, attr))
    case.zero_base_outputs()
    replay()
    replayed = {name: out.clone() for name, out in outputs.items()}
    case.begin_batch()
    case.zero_base_outputs()
    expected = {name: case.portable(name) for name in case.weights}
    return {"replay_error": relative(replayed, expected), "batches_differ": relative(first, expected)}


def intel_xpu_tier_runs(device: torch.device) -> bool:
    """The ``intel_xpu`` tier runs on a CUDA or XPU GPU, and on CPU in Triton's interpreter (smoke
    runs; elsewhere on CPU it is the portable tier)."""
    return device.type in GRAPH_DEVICES or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def grid(args) -> list[tuple]:
    """Points ``(model, max_lora_rank, adapters, tokens, mode, real rank)``."""
    if args.quick:
        if args.device == "cpu" and intel_xpu_tier_runs(torch.device("cpu")):  # the interpreter: a tiny layer
            return [("tiny", 16, 8, 8, "decode", 16), ("tiny", 16, 4, 8, "decode", 8), ("tiny", 16, 1, 16, "prefill", 8)]
        return [("llama-3.1-8b", 16, 8, 64, "decode", 16), ("llama-3.1-8b", 16, 1, 64, "decode", 16),
                ("llama-3.1-8b", 16, 4, 512, "prefill", 16)]
    gpu = torch.device(args.device).type in GRAPH_DEVICES
    decode = [1, 16, 64, 256, 1024, 2048] if gpu else [1, 16, 64, 256]
    prefill = [512, 2048, 8192, 16384] if gpu else [512, 2048]
    points = []
    if args.points == "all":
        for model, rank, adapters in itertools.product(MODELS, (16, 64), (1, 4, 8)):
            points += [(model, rank, adapters, t, "decode", rank) for t in decode]
            points += [(model, rank, adapters, t, "prefill", rank) for t in prefill]
    if gpu:  # adapters below max_lora_rank (the common case), and at it for reference
        for model, adapters, real in itertools.product(MODELS, (4, 8), (8, 16, 64)):
            if real < 64 or args.points == "below-max-rank":
                points += [(model, 64, adapters, t, "decode", real) for t in decode if t <= 256]
        for real in (8, 16):
            points += [("llama-3.1-8b", 64, 8, t, "prefill", real) for t in prefill]
    return points


def selected(points: list[tuple], args) -> list[tuple]:
    """The grid points that pass the ``--models``/``--modes``/``--tokens``/``--ranks``/``--adapters`` filters."""
    keep = []
    for point in points:
        model, rank, adapters, tokens, mode, _ = point
        if (args.models and model not in args.models) or (args.modes and mode not in args.modes):
            continue
        if (args.tokens and tokens not in args.tokens) or (args.ranks and rank not in args.ranks):
            continue
        if args.adapters and adapters not in args.adapters:
            continue
        keep.append(point)
    return keep


def copy_bandwidth(device) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second (1 GiB copies)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / time_call(lambda: dst.copy_(src), device, min_seconds=0.5)


def intel_xpu_selection(args, device: torch.device):
    """The op selection ``intel_xpu`` makes on ``device`` (``SGLANG_XPU_LORA_KERNELS``, default
    ``auto``), over the emulated sgl-kernel-xpu build ``args.emulated_build`` when given. With
    graphs, its graph table is decided as at graph set-up: each native op it would run inside
    graphs is tried in a trial capture (a 64-token decode set-up, rank 64, bfloat16), and the
    verdicts go to ``args.graph_verdicts``."""
    from sglang_xpu_lora.providers import capture_probe, choose, native

    if args.emulated_build:
        from sglang_cpu_devsupport import kernel_emulator

        kernel_emulator.install(args.emulated_build)
    selection = choose(device)
    args.graph_verdicts = None
    if selection.graph_candidates and device.type in GRAPH_DEVICES and not args.no_graphs:
        case = capture_probe.ProbeCase(device, 64, MAX_LORAS, 64, torch.bfloat16)
        verdicts = capture_probe.CaptureProbe().try_ops(selection.graph_candidates, case, selection.bind_trial)
        args.graph_verdicts = {op: {"capture_safe": v.capture_safe, "reason": v.reason} for op, v in verdicts.items()}
        selection = choose(device, verdicts)
    args.intel_xpu_providers = {
        op: {"eager": selection.choices[op].provider.name, "graph": selection.graph_choices[op].provider.name}
        for op in selection.choices
    }
    print("intel_xpu providers (eager / graph):", {op: f"{p['eager']} / {p['graph']}" for op, p in args.intel_xpu_providers.items()}, flush=True)
    if args.emulated_build and not any(c.provider is native.PROVIDER for c in selection.choices.values()):
        print(f"warning: the emulated build {args.emulated_build} has no {device.type} kernels; intel_xpu is measured "
              "without native ops (inside graphs that is also what an Intel box runs)", flush=True)
    return selection


def run(args) -> list[dict]:
    device = torch.device(args.device)
    gpu = device.type in GRAPH_DEVICES
    bandwidth = copy_bandwidth(device) if gpu else None
    args.copy_bandwidth = bandwidth
    dtype = {"cpu": torch.float32}.get(args.device, torch.bfloat16)
    if gpu and not args.no_graphs:
        args.graph_replay_check = check_graph_replay(device, torch.bfloat16)
        print("graph replay check:", args.graph_replay_check, flush=True)
    selection = intel_xpu_selection(args, device) if intel_xpu_tier_runs(device) else None
    rows = []
    for model, rank, adapters, tokens, mode, real_rank in selected(grid(args), args):
        shape = TINY if model == "tiny" else MODELS[model]
        case = Case(shape, rank, adapters, tokens, mode, dtype, device, real_rank=real_rank)
        case.add_base_outputs()
        row = dict(model=model, rank=rank, real_rank=real_rank, adapters=adapters, tokens=tokens, mode=mode,
                   dtype=str(dtype).replace("torch.", ""))
        graphs = gpu and not args.no_graphs
        if not args.no_portable:
            portable = time_call(layer(case.portable, case), device, min_seconds=args.seconds)
            row["portable_ms"] = portable * 1e3
            if not args.no_torch_native and (device.type == "cpu" or tokens <= 256):
                native = time_call(layer(case.torch_native_fn(), case), device, min_seconds=args.seconds)
                row["torch_native_ms"] = native * 1e3
                row["speedup_vs_torch_native"] = native / portable
        if selection is not None:
            row.update(intel_xpu_tier(case, selection, device, args.seconds, graphs))
            row.update(backend_tiers(case, device, args, graphs))
        if gpu:
            if graphs and not args.no_portable:
                row["portable_graph_ms"] = replay_time(graph(layer(case.portable, case), device), device)[0] * 1e3
                row["roofline_fraction"] = case.min_bytes() / (row["portable_graph_ms"] * 1e-3) / bandwidth
            from benchmarks import triton_peers

            for peer, fn in triton_peers.peers(case).items():
                measure(row, peer, layer(fn, case), device, args)
                if graphs:
                    row[f"{peer}_graph_ms"] = replay_time(graph(layer(fn, case), device), device)[0] * 1e3
                    if "portable_graph_ms" in row:
                        row[f"graph_ratio_vs_{peer}"] = row["portable_graph_ms"] / row[f"{peer}_graph_ms"]
            for tier in ("intel_xpu", "intel_xpu_eager"):
                if graphs and f"{tier}_graph_ms" in row:
                    row[f"{tier}_graph_vs_best_peer"] = row[f"{tier}_graph_ms"] / min(row["triton_graph_ms"], row["csgmv_graph_ms"])
                if f"{tier}_ms" in row:
                    row[f"{tier}_vs_triton"] = row[f"{tier}_ms"] / row["triton_ms"]
            row["intel_xpu_eager_vs_triton_backend"] = row["intel_xpu_eager_ms"] / row["triton_backend_ms"]
        rows.append(row)
        print(row, flush=True)
        with open(Path(args.out) / f"ops-{args.device}.partial.jsonl", "a") as partial:  # survives a timeout
            partial.write(json.dumps(row) + "\n")
    return rows


def intel_xpu_tier(case: Case, selection, device: torch.device, seconds: float, graphs: bool) -> dict:
    """Times of the ``intel_xpu`` tier (its eager table eagerly and, on CUDA, its graph table
    graph-captured), and the largest difference of each table's output from the float64 reference
    (``intel_xpu_max_error``, ``intel_xpu_graph_max_error``, relative to the output's magnitude: a
    correctness check in the measured dtype, bfloat16 on a GPU)."""
    result = {}
    reference = {name: reference_output(case, name) for name in case.weights}
    tables = {"": False, "_graph": True} if graphs else {"": False}
    for suffix, use_graph in tables.items():
        fn = case.intel_xpu_fn(selection, use_graph)
        if use_graph:
            seconds_per_call = replay_time(graph(layer(fn, case), device), device)[0]
        else:
            seconds_per_call = time_call(layer(fn, case), device, min_seconds=seconds)
        result[f"intel_xpu{suffix}_ms"] = seconds_per_call * 1e3
        case.begin_batch()
        case.zero_base_outputs()
        result[f"intel_xpu{suffix}_max_error"] = max(
            float((fn(name).double() - ref).abs().max() / ref.abs().max().clamp(min=1e-30)) for name, ref in reference.items()
        )
    return result


def backend_tiers(case: Case, device: torch.device, args, graphs: bool) -> dict:
    """Times of whole backends through their ``run_*`` methods, best of ``args.repeats``:
    ``intel_xpu_eager`` (``IntelXpuLoRABackend``, what a user of ``intel_xpu`` gets without native
    kernels, every per-op step included) and ``triton_backend`` (SGLang's ``TritonLoRABackend``);
    on CUDA also graph-captured (``*_graph_ms``). ``*_max_error``: as :func:`triton_tiers`."""
    if device.type == "cpu":  # SGLang's batch preparation pins host memory: a no-op without an accelerator
        from sglang_cpu_devsupport import pin_memory

        pin_memory.register()
    tiers = {"intel_xpu_eager": case.backend_fn("intel_xpu"), "triton_backend": case.backend_fn("triton")}
    result = {}
    reference = {name: reference_output(case, name) for name in case.weights}
    for tier, fn in tiers.items():
        measure(result, tier, layer(fn, case), device, args)
        case.zero_base_outputs()
        if graphs and tier != "triton_backend":
            result[f"{tier}_graph_ms"] = replay_time(graph(layer(fn, case), device), device)[0] * 1e3
        if tier != "triton_backend":
            case.zero_base_outputs()  # the graph's replays added into them too
            result[f"{tier}_max_error"] = max(
                float((fn(name).double() - ref).abs().max() / ref.abs().max().clamp(min=1e-30)) for name, ref in reference.items()
            )
    return result


def reference_output(case: Case, name: str) -> torch.Tensor:
    """float64 LoRA output of module ``name``: a loop over the slots, each slice's GEMMs at the
    slot's real rank on the packed pool."""
    a, b, outs = case.weights[name]
    x = case.inputs[name].double()
    bounds = [0, *itertools.accumulate(outs)]
    slot_of_row = torch.tensor([s for s, n in zip(case.request_slots, case.request_lens) for _ in range(n)], device=x.device)
    out = torch.zeros(x.shape[0], bounds[-1], dtype=torch.float64, device=x.device)
    real = case.real_rank
    for slot in slot_of_row.unique().tolist():
        rows = slot_of_row == slot
        for p in range(len(outs)):
            shrink = x[rows] @ a[slot, p * real : (p + 1) * real].double().t()
            band = b[slot, bounds[p] : bounds[p + 1], :real].double()
            out[rows, bounds[p] : bounds[p + 1]] = float(case.scalings[slot]) * shrink @ band.t()
    return out


def plot(rows: list[dict], path: Path) -> None:
    """Decode time per layer against tokens (Llama-3.1-8B, rank 16, 8 adapters), one line per path."""
    plt = headless_pyplot()
    if plt is None:
        return

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, style in (("portable_ms", "-o"), ("torch_native_ms", "--s"), ("triton_ms", ":^"), ("portable_graph_ms", "-x"),
                       ("triton_graph_ms", ":v"), ("csgmv_graph_ms", ":d"), ("intel_xpu_graph_ms", "-P")):
        points = [(r["tokens"], r[key]) for r in rows if r["mode"] == "decode" and r["adapters"] == 8 and r["rank"] == 16
                  and r.get("real_rank", 16) == 16 and r["model"] == "llama-3.1-8b" and key in r]
        if points:
            ax.plot(*zip(*points), style, label=key.replace("_ms", ""))
    ax.set(xscale="log", yscale="log", xlabel="decode tokens", ylabel="ms per layer (qkv+o+gate_up+down)",
           title="LoRA work of one Llama-3.1-8B layer, rank 16, 8 adapters")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="three points, for the smoke test")
    parser.add_argument("--seconds", type=float, default=0.3, help="minimum timing time per measurement")
    parser.add_argument("--no-torch-native", action="store_true")
    parser.add_argument("--no-portable", action="store_true", help="skip the portable and torch_native tiers")
    parser.add_argument("--no-graphs", action="store_true", help="eager timings only (on CUDA)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timings of the peers and the backend tiers per point: the best is reported, and the spread")
    names = lambda s: s.split(",")  # noqa: E731
    numbers = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    parser.add_argument("--models", type=names, help="comma-separated subset of the grid's models")
    parser.add_argument("--modes", type=names, help="decode, prefill or both")
    parser.add_argument("--tokens", type=numbers, help="comma-separated subset of the grid's token counts")
    parser.add_argument("--ranks", type=numbers, help="comma-separated subset of max_lora_rank values")
    parser.add_argument("--adapters", type=numbers, help="comma-separated subset of adapter counts")
    parser.add_argument("--emulated-build", help="install this emulated sgl-kernel-xpu build for the intel_xpu tier "
                        "(sglang_cpu_devsupport.kernel_emulator.BUILDS, e.g. full)")
    parser.add_argument("--points", choices=("all", "below-max-rank"), default="all",
                        help="below-max-rank: only the max_lora_rank 64 points (real ranks 8, 16 and 64; GPU)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--plot-only", type=Path, help="redraw the plot of an existing results JSON")
    args = parser.parse_args(argv)
    if args.plot_only:
        plot(json.loads(args.plot_only.read_text())["rows"], args.plot_only.with_suffix(".png"))
        return
    torch.manual_seed(0)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rows = run(args)
    name = f"ops-{args.device}" + ("-quick" if args.quick else "")
    columns = ["model", "mode", "rank", "real_rank", "adapters", "tokens", "portable_ms", "torch_native_ms", "speedup_vs_torch_native"]
    if any("intel_xpu_ms" in row for row in rows):
        columns += ["intel_xpu_ms", "intel_xpu_max_error", "intel_xpu_eager_ms", "intel_xpu_eager_max_error"]
    if torch.device(args.device).type in GRAPH_DEVICES:
        columns += ["portable_graph_ms", "triton_graph_ms", "graph_ratio_vs_triton", "csgmv_graph_ms", "graph_ratio_vs_csgmv",
                    "intel_xpu_graph_ms", "intel_xpu_graph_max_error", "intel_xpu_graph_vs_best_peer", "intel_xpu_vs_triton",
                    "intel_xpu_eager_vs_triton", "intel_xpu_eager_spread", "triton_spread", "intel_xpu_eager_vs_triton_backend",
                    "intel_xpu_eager_graph_vs_best_peer",
                    "roofline_fraction"]
    extra = {"copy_bandwidth_bytes_s": args.copy_bandwidth, "graph_replay_check": getattr(args, "graph_replay_check", None),
             "emulated_build": args.emulated_build, "intel_xpu_providers": getattr(args, "intel_xpu_providers", None),
             "graph_verdicts": getattr(args, "graph_verdicts", None),
             "repeats": args.repeats}
    write(name, rows, columns, args.out, extra=extra)
    plot(rows, Path(args.out) / f"{name}.png")


if __name__ == "__main__":
    main()
