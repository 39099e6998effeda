"""Which provider runs each op, outside graphs (eager) and inside CUDA/XPU graphs, and why.

``SGLANG_XPU_LORA_KERNELS`` (default ``auto``):

* ``auto``: per op, eager: the native sgl-kernel-xpu op when the installed build has it (and, for a
  known device, registers a kernel for it) -> SGLang's Triton kernels when Triton runs on the
  serving device -> the portable PyTorch op. Inside graphs the same order, but a native op only
  when a trial capture at graph set-up showed it captures and replays equal to eager
  (:mod:`.capture_probe`; ``SGLANG_XPU_LORA_GRAPH_NATIVE`` overrides: ``never``, ``always``);
  until the trial (:attr:`OpSelection.graph_decided` False) native ops stay out of graphs.
  ``auto`` never picks Triton on CPU (its interpreter is far slower than the portable ops).
* ``native``: the native op for every op in eager mode, an error naming any missing op; inside
  graphs a native op the trial rejected is replaced as under ``auto``.
* ``triton``: SGLang's Triton kernels for every op, in both modes; an error when Triton cannot run
  on the serving device (on CPU only under ``TRITON_INTERPRET=1``, for tests).
* ``torch``: the portable PyTorch ops everywhere (also lets ``intel_xpu`` run on a device other
  than ``xpu``).

Pairing: a Triton shrink leaves rows of rank-0 slots and columns past a slot's rank unwritten,
which only SGLang's Triton expands skip (:mod:`.triton_ops`), so every expand fed by a Triton
shrink is served by Triton too.

Pool layout: one for every provider, SGLang's packed one (stacked LoRA-A slice ``p`` at row
``p * r``), and every provider runs at each adapter's real rank. The native and portable ops
contract over the full ``max_lora_rank``, so they need each slot zeroed before it is loaded
(:attr:`OpSelection.needs_zeroed_slots`); their multi-slice expands read each slice at
``p * max_lora_rank``, which the backend provides with one gather per layer
(:meth:`OpSelection.reads_spaced_slices`, :mod:`.slice_layout`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import types
from typing import Callable, Optional, Union

import torch

from sglang_xpu_lora.providers.base import OP_NAMES
from sglang_xpu_lora.providers.capture_probe import Verdict, graph_native_choice
from sglang_xpu_lora.settings import GRAPH_NATIVE_ENV, KERNELS_ENV

KERNEL_CHOICES = ("auto", "native", "triton", "torch")
PROVIDERS = ("native", "triton", "torch")

#: Expands that read each shrink's output (the backend's routing, :mod:`sglang_xpu_lora.backend.xpu`).
SHRINK_CONSUMERS = {
    "sgemm_lora_a_fwd": ("sgemm_lora_b_fwd", "qkv_lora_b_fwd", "gate_up_lora_b_fwd", "chunked_sgmv_lora_expand_fwd"),
    "chunked_sgmv_lora_shrink_fwd": ("chunked_sgmv_lora_expand_fwd",),
}

#: Triton backends that serve each device type.
TRITON_BACKENDS = {"cuda": ("nvidia", "amd"), "xpu": ("intel",)}

logger = logging.getLogger("sglang_xpu_lora.providers")

Device = Union[str, torch.device, None]


def kernels_choice() -> str:
    """The validated value of ``SGLANG_XPU_LORA_KERNELS``.

    Raises:
        ValueError: if the variable holds anything but ``auto``, ``native``, ``triton`` or ``torch``.
    """
    value = os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"
    if value not in KERNEL_CHOICES:
        raise ValueError(
            f"{KERNELS_ENV}={os.environ.get(KERNELS_ENV)!r} is not one of "
            f"{', '.join(KERNEL_CHOICES)}; unset it or set {KERNELS_ENV}=torch for the portable kernels"
        )
    return value


def portable_kernels_selected() -> bool:
    """True when the portable PyTorch kernels were chosen explicitly (``SGLANG_XPU_LORA_KERNELS=torch``)."""
    return kernels_choice() == "torch"


def device_type(device: Device) -> Optional[str]:
    """``"xpu"``, ``"cuda"``, ``"cpu"``... for a device or device name; None when unknown."""
    return None if device is None else torch.device(device).type


def triton_support(device: Device) -> tuple[bool, str]:
    """Whether SGLang's Triton LoRA kernels can run on ``device``, and why (not).

    A GPU device needs an active Triton backend for it (``nvidia``/``amd`` for ``cuda``, ``intel``
    for ``xpu``); CPU tensors run only in Triton's interpreter (``TRITON_INTERPRET=1``).
    """
    kind = device_type(device)
    if kind is None:
        return False, "the serving device is unknown"
    try:
        import triton
    except Exception as exc:  # noqa: BLE001 - a broken Triton is as unusable as a missing one
        return False, f"triton is not importable ({type(exc).__name__}: {exc})"
    if kind == "cpu":
        if os.environ.get("TRITON_INTERPRET") == "1":
            return True, f"Triton {triton.__version__} interpreter (TRITON_INTERPRET=1)"
        return False, "Triton has no CPU backend (TRITON_INTERPRET=1 runs its interpreter, for tests)"
    try:
        from triton.backends import backends
    except Exception as exc:  # noqa: BLE001
        return False, f"triton.backends is not importable ({type(exc).__name__}: {exc})"
    for backend in TRITON_BACKENDS.get(kind, ()):
        if backend in backends and backends[backend].driver.is_active():
            return True, f"Triton {triton.__version__} {backend} backend"
    return False, f"no active Triton backend for {kind} (installed: {', '.join(sorted(backends)) or 'none'})"


@dataclasses.dataclass(frozen=True)
class OpChoice:
    """Which provider runs one op, and why."""

    op: str
    provider: str  #: one of :data:`PROVIDERS`
    reason: str
    capture_safe: Optional[bool]  #: whether it may run inside graphs; None: a native op not tried yet
    kernel: Optional[object] = None  #: the :class:`.native.KernelOp` when native


@dataclasses.dataclass(frozen=True)
class OpSelection:
    """The op tables the backend calls: :attr:`eager` outside graphs, :attr:`graph` inside them.

    Both are namespaces with the seven op names of :class:`.base.LoRAOpsProvider`; every entry
    takes the interface's keyword arguments plus ``batch_info`` (SGLang's ``LoRABatchInfo``, read
    by the Triton ops, ignored by the others).
    """

    eager: types.SimpleNamespace
    graph: types.SimpleNamespace
    choices: dict  #: op -> OpChoice outside graphs
    graph_choices: dict  #: op -> OpChoice inside graphs
    mode: str  #: the SGLANG_XPU_LORA_KERNELS value
    build: str  #: description of the installed kernel build
    device: Optional[str] = None  #: the serving device type the selection was made for
    #: op -> :class:`.native.KernelOp`: the native ops that would run inside graphs if a trial
    #: capture accepts them (what :class:`.capture_probe.CaptureProbe` tries at graph set-up).
    graph_candidates: dict = dataclasses.field(default_factory=dict)
    #: False while native ops wait for their trial capture (and stay out of :attr:`graph`).
    graph_decided: bool = True

    def for_graph(self, use_graph: bool) -> types.SimpleNamespace:
        return self.graph if use_graph else self.eager

    def _all_choices(self):
        return (*self.choices.values(), *self.graph_choices.values())

    @property
    def uses_triton(self) -> bool:
        """Whether any op, eager or in graphs, runs SGLang's Triton kernels."""
        return any(c.provider == "triton" for c in self._all_choices())

    @property
    def needs_zeroed_slots(self) -> bool:
        """Whether any op, eager or in graphs, is native or portable: those contract over the full
        ``max_lora_rank``, so every pool slot must be zeroed before an adapter is loaded into it
        (zero rank tails, nothing left of a previous tenant)."""
        return any(c.provider != "triton" for c in self._all_choices())

    def reads_spaced_slices(self, op: str, use_graph: bool) -> bool:
        """Whether expand ``op``, as this selection serves it outside (``use_graph`` False) or
        inside graphs, reads a multi-slice input with slice ``p`` at columns ``p * max_lora_rank``
        (native and portable expands) rather than SGLang's packed ``p * rank`` (Triton's)."""
        chosen = self.graph_choices if use_graph else self.choices
        return chosen[op].provider != "triton"

    def bind_batch(self, use_graph: bool, info, uniform_offsets: Callable[[int, int], torch.Tensor], names) -> types.SimpleNamespace:
        """The ops (and chunked-expand forms) ``names`` of the table for ``use_graph`` bound to
        the batch ``info`` (SGLang's ``LoRABatchInfo``): callables taking only the per-call
        arguments (:func:`.batch_binding.bind_table`; ``uniform_offsets`` as there)."""
        from sglang_xpu_lora.providers.batch_binding import bind_table

        chosen = self.graph_choices if use_graph else self.choices
        return bind_table(self.for_graph(use_graph), chosen, info, uniform_offsets, names)


def _ignoring_batch_info(fn: Callable) -> Callable:
    """``fn`` with the table calling convention: accepts and drops ``batch_info``."""

    @functools.wraps(fn)
    def call(*args, batch_info=None, **kwargs):
        return fn(*args, **kwargs)

    return call


def _detect_native() -> tuple[str, dict]:
    """``(build description, {op: (KernelOp or None, reason)})``."""
    from sglang_xpu_lora.providers import native, torch_ops

    module, build = native.kernel_build()
    found = {
        op: native.detect_op(op, tuple(inspect.signature(getattr(torch_ops, op)).parameters)) if module else (None, build)
        for op in OP_NAMES
    }
    return build, found


def _native_choices(kind: Optional[str], mode: str) -> tuple[str, dict]:
    """``(build, {op: (KernelOp or None, reason)})``, a kernel counted only when it runs on ``kind``."""
    from sglang_xpu_lora.providers import native

    build, found = _detect_native()
    for op, (kernel, reason) in list(found.items()):
        if kernel is not None and kind is not None and not native.has_kernel_for_device(kernel, kind):
            kernel, reason = None, f"{kernel.schema_note} has no {kind} kernel"
            found[op] = (kernel, reason)
        if kernel is None and mode == "native":
            raise RuntimeError(
                f"{KERNELS_ENV}=native: sgl-kernel-xpu op {op} is unavailable: {reason}. Install "
                f"{native.MINIMUM_BUILD[op]} or newer, or set {KERNELS_ENV}=auto to use another provider for it"
            )
    return build, found


def _pair_triton_shrinks(choices: dict) -> None:
    """Serve every expand that reads a Triton shrink's output by Triton (see the module docstring)."""
    for shrink, expands in SHRINK_CONSUMERS.items():
        if choices[shrink].provider != "triton":
            continue
        for op in expands:
            if choices[op].provider != "triton":
                choices[op] = OpChoice(
                    op, "triton", f"reads the Triton {shrink} output, which only Triton expands read correctly", True
                )


#: Eager decode: serve the permuted ops by SGLang's Triton kernels rather than native ops that
#: synchronise with the host (not shown sync-free by a trial capture), where Triton runs. On by
#: evidence: the host reads of the sgl-kernel-xpu decode ops (21 per LoRA module), stood in on an
#: H200, make a Llama-3.1-8B decode step 2.8-5.2x as long as the sync-free Triton path at 1-256
#: tokens (benchmarks/results/sync-cost-cuda.md; docs/performance.md, "Host syncs in eager
#: decode"). ``examples/xpu/measure.sh`` measures the same trade-off on an Intel GPU.
EAGER_DECODE_PREFERS_TRITON = True
#: The permuted (decode) ops that rule covers.
DECODE_OPS = ("chunked_sgmv_lora_shrink_fwd", "chunked_sgmv_lora_expand_fwd")


def _prefer_triton_for_eager_decode(choices: dict, triton_reason: str) -> None:
    """Apply :data:`EAGER_DECODE_PREFERS_TRITON` to the eager choices (``auto`` only)."""
    for op in DECODE_OPS:
        choice = choices[op]
        if choice.provider == "native" and choice.capture_safe is not True:
            choices[op] = OpChoice(
                op, "triton", f"native op syncs with the host, which costs more than Triton in eager decode; {triton_reason}", True
            )


def _graph_verdict(verdict: Optional[Verdict], graph_native: str) -> tuple[Optional[bool], str]:
    """Whether a native op runs inside graphs (None: not tried yet), and why."""
    if graph_native == "always":
        return True, f"{GRAPH_NATIVE_ENV}=always: runs inside graphs untried"
    if graph_native == "never":
        return False, f"{GRAPH_NATIVE_ENV}=never"
    if verdict is None:
        return None, "capture safety is decided by a trial capture at graph set-up"
    return verdict.capture_safe, verdict.reason


def choose(device: Device = None, graph_verdicts: Optional[dict] = None) -> OpSelection:
    """The selection for ``device`` (see the module docstring), without logging.

    ``graph_verdicts``: op -> :class:`.capture_probe.Verdict` from the trial captures at graph
    set-up; None before them (native ops then stay out of graphs, :attr:`OpSelection.graph_decided`
    False, unless ``SGLANG_XPU_LORA_GRAPH_NATIVE`` is ``always`` or ``never``).

    Raises:
        ValueError: for an invalid ``SGLANG_XPU_LORA_KERNELS`` or ``SGLANG_XPU_LORA_GRAPH_NATIVE`` value.
        RuntimeError: with ``native``, when the build lacks an op (names the op and the first build
            that has it); with ``triton``, when Triton cannot run on ``device``.
    """
    from sglang_xpu_lora.providers import native, torch_ops, triton_ops

    mode, kind = kernels_choice(), device_type(device)
    portable = {op: _ignoring_batch_info(getattr(torch_ops, op)) for op in OP_NAMES}
    triton = {op: getattr(triton_ops, op) for op in OP_NAMES}
    if mode == "torch":
        choices = {op: OpChoice(op, "torch", f"{KERNELS_ENV}=torch", True) for op in OP_NAMES}
        table = types.SimpleNamespace(**portable)
        return OpSelection(table, table, choices, dict(choices), mode, "not used", kind)
    triton_runs, triton_reason = triton_support(kind)
    if mode == "triton":
        if not triton_runs:
            raise RuntimeError(
                f"{KERNELS_ENV}=triton: SGLang's Triton LoRA kernels cannot run on device {kind}: {triton_reason}. "
                f"Unset {KERNELS_ENV} or set {KERNELS_ENV}=torch for the portable kernels"
            )
        choices = {op: OpChoice(op, "triton", f"{KERNELS_ENV}=triton ({triton_reason})", True) for op in OP_NAMES}
        table = types.SimpleNamespace(**triton)
        return OpSelection(table, table, choices, dict(choices), mode, "not used", kind)
    if kind == "cpu" and triton_runs:
        triton_runs, triton_reason = False, f"{KERNELS_ENV}={mode} does not use the Triton interpreter on CPU"

    graph_native = graph_native_choice()
    build, found = _native_choices(kind, mode)
    choices, graph_choices, optimistic = {}, {}, {}
    for op in OP_NAMES:
        kernel, reason = found[op]
        if kernel is None:
            if triton_runs:
                choices[op] = OpChoice(op, "triton", f"no native op: {reason}; {triton_reason}", True)
            else:
                choices[op] = OpChoice(op, "torch", f"no native op: {reason}; no Triton: {triton_reason}", True)
            graph_choices[op] = optimistic[op] = choices[op]
            continue
        safe, why = _graph_verdict((graph_verdicts or {}).get(op), graph_native)
        choices[op] = OpChoice(op, "native", reason, safe, kernel)
        optimistic[op] = OpChoice(op, "native", why, True, kernel)
        if safe:
            graph_choices[op] = optimistic[op]
        elif triton_runs:
            graph_choices[op] = OpChoice(op, "triton", f"native op not run inside graphs: {why}; {triton_reason}", True)
        else:
            graph_choices[op] = OpChoice(op, "torch", f"native op not run inside graphs: {why}; no Triton: {triton_reason}", True)
    if EAGER_DECODE_PREFERS_TRITON and mode == "auto" and triton_runs:
        _prefer_triton_for_eager_decode(choices, triton_reason)
    for chosen in (choices, graph_choices, optimistic):
        _pair_triton_shrinks(chosen)
    candidates = {op: c.kernel for op, c in optimistic.items() if c.provider == "native"}
    decided = not candidates or all(choices[op].capture_safe is not None for op in candidates)
    implementations = {"triton": triton, "torch": portable}

    def table(chosen: dict) -> types.SimpleNamespace:
        return types.SimpleNamespace(**{
            op: native.bind(c.kernel) if c.provider == "native" else implementations[c.provider][op]
            for op, c in chosen.items()
        })

    eager = table(choices)
    graph = eager if graph_choices == choices else table(graph_choices)
    return OpSelection(eager, graph, choices, graph_choices, mode, build, kind, candidates, decided)


_reported: set = set()


def _report(selection: OpSelection) -> None:
    """Log each op not served natively, and each graph substitution once decided, once per process."""
    for op in selection.choices:
        eager, graph = selection.choices[op], selection.graph_choices[op]
        if eager.provider != "native" and ("eager", op, eager.provider) not in _reported:
            _reported.add(("eager", op, eager.provider))
            level = logging.WARNING if eager.provider == "torch" else logging.INFO
            logger.log(level, "sglang-xpu-lora: %s uses the %s provider (%s)", op, eager.provider, eager.reason)
        elif selection.graph_decided and eager.provider != graph.provider and ("graph", op, graph.provider) not in _reported:
            _reported.add(("graph", op, graph.provider))
            logger.info(
                "sglang-xpu-lora: %s: %s outside graphs, %s inside graphs (%s)", op, eager.provider, graph.provider, graph.reason
            )


def select_ops(device: Device = None, graph_verdicts: Optional[dict] = None) -> OpSelection:
    """:func:`choose` for ``device`` and ``graph_verdicts``, logging each op not served natively
    once per process.

    Raises:
        ValueError, RuntimeError: as :func:`choose`.
    """
    selection = choose(device, graph_verdicts)
    if selection.mode not in ("torch", "triton"):
        _report(selection)
    return selection


def runs_on_device(device: Device) -> bool:
    """Whether ``intel_xpu`` can serve on ``device`` (a device other than ``xpu``): with the portable
    kernels chosen explicitly, or when at least one op is served by a native kernel registered for
    that device (e.g. the test emulator's CPU build) or by Triton.

    Raises:
        ValueError: when the selection itself fails (e.g. ``triton`` on a device Triton cannot run on).
    """
    if kernels_choice() == "torch":
        return True
    if device is None:
        return False
    try:
        selection = choose(device)
    except RuntimeError as exc:
        raise ValueError(str(exc)) from exc
    return any(c.provider != "torch" for c in selection.choices.values())
