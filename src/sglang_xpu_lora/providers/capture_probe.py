"""Whether a native op may run inside CUDA/XPU graphs, decided by trying it in a trial capture.

No sgl-kernel-xpu build declares which of its ops can be captured, and every build seen so far
validates its inputs on the host (``.item()``, ``.cpu()``; shared/research, kernels note section
1.1), which a graph capture refuses. So before SGLang captures its graphs,
``IntelXpuLoRABackend.init_decode_cuda_graph_batch_info`` / ``init_prefill_cuda_graph_batch_info``
ask :class:`CaptureProbe` to try each native op the selection would run inside graphs
(:attr:`.selection.OpSelection.graph_candidates`), and the graph op table is rebuilt from the
verdicts (:func:`.selection.choose`). One trial per op (:meth:`CaptureProbe.try_op`):

1. build two batches of the same shapes (``tokens``, ``slots``, ``max_rank`` and dtype of the graph
   set-up, :class:`ProbeCase`) with different routing, ranks, scalings and values;
2. run the op eagerly on the second batch: the reference;
3. capture the op on the first batch into a **private** memory pool of its own (a fresh one per
   trial, released with the trial graph), on **one side stream** reused for every trial (never
   SGLang's shared graph pool, never the current stream);
4. copy the second batch into the captured inputs in place (as SGLang's graph runner refreshes its
   batch buffers), poison the captured output with NaN, replay, and compare with the reference
   (tolerance :data:`TOLERANCE` of the dtype, relative to the reference's magnitude).

An op that captures and replays equal to eager runs natively inside graphs; any other outcome (a
host sync refused during capture, an error at capture end, a replay that differs from eager or
leaves outputs unwritten, an eager failure) is a verdict against it, with the reason, and the op
falls back to SGLang's Triton kernels, else the portable ops.

Measured facts the trial relies on (CUDA graphs on an H200, findings-2026-12.md section 2): a host
sync under capture raises and invalidates the whole capture, so the trial must precede SGLang's own
capture; after a failed capture the process stays usable, but the pool it recorded into refuses
every later capture, and a pool whose graph was released cannot be captured into again (on the
H200: "it->second->use_count > 0 INTERNAL ASSERT FAILED" in ``CUDACachingAllocator``), so every
trial takes a fresh pool; ``torch.cuda.graph``'s exit leaves
its side stream current, so the capture is begun and ended here by hand, always ended, and the
current stream always restored (``try``/``finally``). Cost: about 0.3-0.6 ms per op (the first
trial in a process a few ms), about 2 MiB left reserved per failing trial.

Devices: CUDA graphs on ``cuda`` (``torch.cuda.CUDAGraph``), XPU graphs on ``xpu``
(``torch.xpu.XPUGraph``, present in torch >= 2.11); elsewhere (CPU) there are no device graphs and
the verdict says so without trying: native ops stay out of graph batches.

``SGLANG_XPU_LORA_GRAPH_NATIVE`` overrides the trial: ``probe`` (default), ``never`` (native ops
never run inside graphs), ``always`` (they run inside graphs untried: for a build known to be
capture-safe, or to see the capture error itself).

Verdicts are cached per :class:`CaptureProbe` object (one per backend, so per process) and trial
case; nothing here is on the math path.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from sglang_xpu_lora.settings import GRAPH_NATIVE_ENV, env_choice

if TYPE_CHECKING:
    from sglang.srt.lora.mem_pool import LoRAMemoryPool

GRAPH_NATIVE_CHOICES = ("probe", "never", "always")

#: Largest replay-vs-eager difference accepted, relative to the eager output's largest magnitude.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

#: Feature widths of the trial calls (input width, output width per slice, vocabulary): whether an
#: op can be captured depends on how it launches and validates, not on these, and small widths keep
#: a trial well under a millisecond of device time.
TRIAL_IN, TRIAL_OUT, TRIAL_VOCAB = 64, 32, 64

logger = logging.getLogger("sglang_xpu_lora.providers")


def graph_native_choice() -> str:
    """The validated value of ``SGLANG_XPU_LORA_GRAPH_NATIVE`` (default ``probe``).

    Raises:
        ValueError: for a value other than ``probe``, ``never`` or ``always``.
    """
    return env_choice(GRAPH_NATIVE_ENV, GRAPH_NATIVE_CHOICES, "unset it to decide by a trial capture at graph set-up")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Whether ``op`` may run natively inside graphs, why, and what deciding it cost."""

    op: str
    capture_safe: bool
    reason: str
    seconds: float = 0.0  #: wall time of the trial (inputs, eager reference, capture, replay)


@dataclasses.dataclass(frozen=True)
class ProbeCase:
    """The batch sizes of one graph set-up, for the trial calls.

    ``tokens``: tokens the graphs are captured for (decode: largest batch size x tokens per
    request; prefill: the token cap); ``slots``: ``max_loras_per_batch``; ``max_rank`` and
    ``dtype``: the LoRA pool's ``max_lora_rank`` and value dtype.
    """

    device: torch.device
    tokens: int
    slots: int
    max_rank: int
    dtype: torch.dtype

    @classmethod
    def for_graph_setup(cls, device, tokens: int, slots: int, pool: Optional[LoRAMemoryPool] = None) -> "ProbeCase":
        """The case of a graph set-up: sizes from SGLang's call, rank and dtype from ``pool``
        (SGLang's ``LoRAMemoryPool``; when it is unknown, None: rank 16 and bfloat16, float32 on
        CPU). A pool is read as it is: one without ``dtype`` or ``max_lora_rank`` raises
        AttributeError rather than trying in another dtype than the graphs run in."""
        device = torch.device(device)
        if pool is None:
            rank, dtype = 16, torch.float32 if device.type == "cpu" else torch.bfloat16
        else:
            rank, dtype = pool.max_lora_rank, pool.dtype
        return cls(device, max(1, tokens), max(1, slots), max(1, rank), dtype)

    def describe(self) -> str:
        return f"{self.tokens} tokens, {self.slots} slots, rank {self.max_rank}, {str(self.dtype).replace('torch.', '')}"


class DeviceGraphs:
    """The device graph API a trial drives: ``torch.cuda`` or ``torch.xpu`` (the same names)."""

    def __init__(self, module: Any, graph_class: Callable[[], Any], name: str):
        self.module, self.graph_class, self.name = module, graph_class, name

    def new_graph(self):
        return self.graph_class()

    def new_pool(self):
        """A private memory pool handle (``graph_pool_handle()``), shared with no one else."""
        return self.module.graph_pool_handle()

    def new_stream(self, device: torch.device):
        return self.module.Stream(device)

    def current_stream(self, device: torch.device):
        return self.module.current_stream(device)

    def set_stream(self, stream) -> None:
        self.module.set_stream(stream)

    def synchronize(self, device: torch.device) -> None:
        self.module.synchronize(device)


def device_graphs(device_type: str) -> tuple[Optional[DeviceGraphs], str]:
    """``(graph API or None, why none)`` for a device type."""
    if device_type == "cuda":
        if not torch.cuda.is_available():
            return None, "no CUDA device is available"
        return DeviceGraphs(torch.cuda, torch.cuda.CUDAGraph, "CUDA graph"), ""
    if device_type == "xpu":
        xpu = getattr(torch, "xpu", None)
        if xpu is None or not hasattr(xpu, "XPUGraph"):
            return None, f"torch {torch.__version__} has no torch.xpu.XPUGraph"
        if not xpu.is_available():
            return None, "no XPU device is available"
        return DeviceGraphs(xpu, xpu.XPUGraph, "XPU graph"), ""
    return None, f"{device_type} has no device graphs to try a capture in"


def _segments(case: ProbeCase, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Decode-style routing (SGLang's ``_build_sgemm_routing``): random slot per token, tokens
    sorted by slot, one segment per slot, some slots empty; distinct ranks (0, below and at the
    maximum) and scalings per slot."""
    slot_of_token = torch.randint(0, case.slots, (case.tokens,), generator=generator)
    counts = torch.bincount(slot_of_token, minlength=case.slots)
    ranks = torch.randint(0, case.max_rank + 1, (case.slots,), generator=generator)
    ranks[torch.randint(0, case.slots, (1,), generator=generator)] = case.max_rank
    return dict(
        seg_indptr=torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32),
        weight_indices=torch.arange(case.slots, dtype=torch.int32),
        lora_ranks=ranks.to(torch.int32),
        permutation=torch.argsort(slot_of_token, stable=True).to(torch.int32),
        scalings=torch.rand(case.slots, generator=generator) * 2 + 0.25,
    )


def trial_arguments(op: str, case: ProbeCase, seed: int) -> dict[str, Any]:
    """Keyword arguments of one trial call of ``op`` (the provider interface, :mod:`.base`) on
    ``case``'s device; the same shapes for every ``seed``, other values."""
    generator = torch.Generator().manual_seed(seed)
    t, r, n = case.tokens, case.max_rank, TRIAL_OUT
    meta = _segments(case, generator)
    permutation, scalings = meta.pop("permutation"), meta.pop("scalings")

    def values(*shape):
        return torch.randn(*shape, generator=generator).to(case.dtype)

    def offsets(widths):
        return torch.tensor([0, *itertools.accumulate(widths)], dtype=torch.int32)

    if op == "embedding_lora_a_fwd":
        args = dict(input_ids=torch.randint(0, TRIAL_VOCAB, (t,), generator=generator), weights=values(case.slots, r, TRIAL_VOCAB),
                    vocab_size=TRIAL_VOCAB, extra_embeddings=None, max_len=t)
    elif op == "sgemm_lora_a_fwd":
        args = dict(input_x=values(t, TRIAL_IN), weights=values(case.slots, 3 * r, TRIAL_IN), num_slices=3)
    elif op == "chunked_sgmv_lora_shrink_fwd":
        args = dict(input_x=values(t, TRIAL_IN), weights=values(case.slots, 3 * r, TRIAL_IN), num_slices=3,
                    num_segments=case.slots, permutation=permutation)
    elif op == "sgemm_lora_b_fwd":
        args = dict(input_x=values(t, r), weights=values(case.slots, n, r), scalings=scalings, base_output=values(t, n))
    elif op == "qkv_lora_b_fwd":
        widths = (2 * n, n, n)
        args = dict(input_x=values(t, 3 * r), qkv_lora_b=values(case.slots, sum(widths), r), output_offset=offsets(widths),
                    max_qkv_out_dim=max(widths), scalings=scalings, base_output=values(t, sum(widths)))
    elif op == "gate_up_lora_b_fwd":
        args = dict(input_x=values(t, 2 * r), gate_up_lora_b=values(case.slots, 2 * n, r), output_dim=n, scalings=scalings,
                    base_output=values(t, 2 * n))
    elif op == "chunked_sgmv_lora_expand_fwd":
        widths = (2 * n, n, n)
        args = dict(input_x=values(t, 3 * r), weights=values(case.slots, sum(widths), r), slice_offsets=offsets(widths),
                    max_slice_size=max(widths), num_slices=3, num_segments=case.slots, scalings=scalings,
                    permutation=permutation, base_output=values(t, sum(widths)))
    else:
        raise ValueError(f"no trial call for op {op!r}")
    args.update(meta)
    return {k: v.to(case.device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"


def merge(verdicts: dict[str, Verdict], new: dict[str, Verdict]) -> dict[str, Verdict]:
    """Combined verdicts of several graph set-ups: an op stays capture-safe only while every trial
    passed; the first failing trial's verdict is kept."""
    merged = dict(verdicts)
    for op, verdict in new.items():
        if op not in merged or (merged[op].capture_safe and not verdict.capture_safe):
            merged[op] = verdict
    return merged


class CaptureProbe:
    """Trial captures of native ops, with their per-process state: one side stream and the
    verdicts per (op, kernel, case); each trial captures into a private pool of its own.

    Args:
        graphs: the graph API to drive; by default the device's (:func:`device_graphs`).
    """

    def __init__(self, graphs: Optional[DeviceGraphs] = None):
        self._graphs = graphs
        self._stream = None
        self._verdicts: dict[tuple, Verdict] = {}

    def _graph_api(self, device: torch.device) -> tuple[Optional[DeviceGraphs], str]:
        return (self._graphs, "") if self._graphs is not None else device_graphs(device.type)

    def try_ops(self, candidates: dict[str, Any], case: ProbeCase, bind: Callable[[Any], Callable]) -> dict[str, Verdict]:
        """Verdicts for ``candidates`` (op -> what a trial binds,
        :attr:`.selection.OpSelection.graph_candidates`) on ``case``, each op tried once per case
        (cached); ``bind`` makes a kernel's provider-interface call
        (:meth:`.selection.OpSelection.bind_trial`). Logs one line per new trial."""
        verdicts = {}
        for op, kernel in candidates.items():
            key = (op, getattr(kernel, "kernel_name", None), case)
            if key not in self._verdicts:
                self._verdicts[key] = verdict = self.try_op(op, bind(kernel), case)
                logger.info(
                    "sglang-xpu-lora: capture probe: %s %s inside graphs (%s; %.2f ms)",
                    op, "runs natively" if verdict.capture_safe else "falls back", verdict.reason, verdict.seconds * 1e3,
                )
            verdicts[op] = self._verdicts[key]
        return verdicts

    @torch.no_grad()
    def try_op(self, op: str, call: Callable[..., torch.Tensor], case: ProbeCase) -> Verdict:
        """One trial of ``call`` (the provider-interface call of ``op``) on ``case``; see the
        module docstring for the steps. Never raises for a failing op: the failure is the verdict.
        On return the capture is ended and the current stream is the one current at entry."""
        start = time.perf_counter()
        graphs, why_not = self._graph_api(case.device)
        if graphs is None:
            return Verdict(op, False, f"not tried: {why_not}, so the native op stays out of graph batches")
        captured, replayed = trial_arguments(op, case, seed=0), trial_arguments(op, case, seed=1)
        previous = graphs.current_stream(case.device)
        if self._stream is None:
            self._stream = graphs.new_stream(case.device)  # one for every trial: each new one reserves memory
        stream = self._stream
        stream.wait_stream(previous)
        graphs.set_stream(stream)
        try:
            safe, reason = self._capture_and_replay(graphs, call, case, captured, replayed)
        finally:
            graphs.set_stream(previous)
            previous.wait_stream(stream)
        return Verdict(op, safe, reason, time.perf_counter() - start)

    def _capture_and_replay(self, graphs: DeviceGraphs, call, case: ProbeCase, captured: dict, replayed: dict) -> tuple[bool, str]:
        where = f"a trial {graphs.name} ({case.describe()})"
        try:
            expected = call(**replayed)
        except Exception as exc:  # noqa: BLE001 - whatever the op raises is the verdict
            return False, f"the eager trial call failed ({_error(exc)})"
        graph = graphs.new_graph()
        try:
            return self._capture_into_fresh_pool(graphs, graph, call, where, captured, replayed, expected, case)
        finally:
            _release(graph)

    @staticmethod
    def _capture_into_fresh_pool(graphs: DeviceGraphs, graph, call, where: str, captured: dict, replayed: dict,
                                 expected: torch.Tensor, case: ProbeCase) -> tuple[bool, str]:
        try:
            graph.capture_begin(pool=graphs.new_pool())
        except Exception as exc:  # noqa: BLE001 - no trial, no native op in graphs
            return False, f"could not begin {where} ({_error(exc)})"
        try:
            output = call(**captured)
        except Exception as exc:  # noqa: BLE001
            _end_failed_capture(graph)
            return False, f"capture failed in {where} ({_error(exc)})"
        try:
            graph.capture_end()
            for name, value in captured.items():
                if isinstance(value, torch.Tensor):
                    value.copy_(replayed[name])  # the next batch, in place, as SGLang's graph runner does
            output.fill_(float("nan"))
            graph.replay()
            graphs.synchronize(case.device)
        except Exception as exc:  # noqa: BLE001 - e.g. an error raised at capture end or at replay
            return False, f"capture or replay failed in {where} ({_error(exc)})"
        difference = (output.float() - expected.float()).abs().max().item()
        scale = max(1.0, expected.float().abs().max().item())
        if not difference <= TOLERANCE.get(case.dtype, 1e-5) * scale:  # NaN (unwritten output) fails too
            return False, f"replay in {where} differs from eager (largest difference {difference:.3g})"
        return True, f"captured in {where} and replayed equal to eager"


def _end_failed_capture(graph) -> None:
    """End a capture the op broke. Ending it raises a second, chained error (the first one is the
    verdict); the pool it recorded into refuses later captures and is released with the graph."""
    try:
        graph.capture_end()
    except Exception:  # noqa: BLE001 - "operation failed due to a previous error during capture"
        pass


def _release(graph) -> None:
    """Free a trial graph and its private pool now rather than at garbage collection (the next
    trial takes a new pool, so nothing captures into this one again)."""
    try:
        graph.reset()
    except Exception:  # noqa: BLE001 - a graph that never captured has nothing to free
        pass
