"""Op providers and their selection, per op: ``SGLANG_XPU_LORA_KERNELS=auto|native|torch``.

* ``torch``: the portable PyTorch provider (:mod:`.torch_ops`) for every op, on any device; this
  also lets ``--lora-backend intel_xpu`` run with a device other than ``xpu``.
* ``native``: the sgl-kernel-xpu ops (:mod:`.native`); an op the installed build lacks is an error
  at start-up naming the op and the first build that has it.
* ``auto`` (default): native for each op the build has, the portable op for the others (logged
  once per op).

Graph mode: inside a CUDA/XPU graph (``batch_info.use_cuda_graph``) a capture-unsafe native op is
replaced by the portable op (:attr:`OpSelection.graph`), and the substitution is logged once.

Scope: the selection covers the dense LoRA ops of ``IntelXpuLoRABackend``. LoRA on MoE experts and
the absorbed-MLA ``kv_b_proj`` correction are computed by SGLang's own Triton kernels whatever this
variable says (:mod:`sglang_xpu_lora.backend.scope`).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import types
from typing import Optional

KERNELS_ENV = "SGLANG_XPU_LORA_KERNELS"
KERNEL_CHOICES = ("auto", "native", "torch")

logger = logging.getLogger(__name__)


def kernels_choice() -> str:
    """The validated value of ``SGLANG_XPU_LORA_KERNELS``.

    Raises:
        ValueError: if the variable holds anything but ``auto``, ``native`` or ``torch``.
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


@dataclasses.dataclass(frozen=True)
class OpChoice:
    """Which provider runs one op, and why."""

    op: str
    provider: str  #: "native" or "torch"
    reason: str
    capture_safe: bool
    kernel: Optional[object] = None  #: the :class:`.native.KernelOp` when native


@dataclasses.dataclass(frozen=True)
class OpSelection:
    """The op table the backend calls: :attr:`eager` outside graphs, :attr:`graph` inside them.

    Both are namespaces with the seven op names of :class:`.base.LoRAOpsProvider`.
    """

    eager: types.SimpleNamespace
    graph: types.SimpleNamespace
    choices: dict  #: op -> OpChoice outside graphs
    graph_choices: dict  #: op -> OpChoice inside graphs
    mode: str  #: the SGLANG_XPU_LORA_KERNELS value
    build: str  #: description of the installed kernel build

    def for_graph(self, use_graph: bool) -> types.SimpleNamespace:
        return self.graph if use_graph else self.eager


def _detect_native() -> tuple[Optional[object], str, dict]:
    """``(sgl_kernel module or None, build description, {op: (KernelOp or None, reason)})``."""
    from sglang_xpu_lora.providers import native, torch_ops
    from sglang_xpu_lora.providers.base import OP_NAMES

    module, build = native.kernel_build()
    found = {
        op: native.detect_op(op, tuple(inspect.signature(getattr(torch_ops, op)).parameters)) if module else (None, build)
        for op in OP_NAMES
    }
    return module, build, found


def select_ops() -> OpSelection:
    """Choose a provider for each op according to ``SGLANG_XPU_LORA_KERNELS`` and the installed build.

    Raises:
        ValueError: for an invalid selector value.
        RuntimeError: with ``native``, when the build lacks an op (names the op and the first build
            that has it) or sgl_kernel cannot be imported.
    """
    from sglang_xpu_lora.providers import native, torch_ops
    from sglang_xpu_lora.providers.base import OP_NAMES

    mode = kernels_choice()
    portable = {op: getattr(torch_ops, op) for op in OP_NAMES}
    if mode == "torch":
        choice = {op: OpChoice(op, "torch", f"{KERNELS_ENV}=torch", True) for op in OP_NAMES}
        table = types.SimpleNamespace(**portable)
        return OpSelection(table, table, choice, choice, mode, "not used")

    _, build, found = _detect_native()
    eager, graph, choices, graph_choices = {}, {}, {}, {}
    for op in OP_NAMES:
        kernel, reason = found[op]
        if kernel is None:
            if mode == "native":
                raise RuntimeError(
                    f"{KERNELS_ENV}=native: sgl-kernel-xpu op {op} is unavailable: {reason}. Install "
                    f"{native.MINIMUM_BUILD[op]} or newer, or set {KERNELS_ENV}=auto to use the portable op for it"
                )
            choices[op] = graph_choices[op] = OpChoice(op, "torch", f"native op missing: {reason}", True)
            eager[op] = graph[op] = portable[op]
            continue
        choices[op] = OpChoice(op, "native", reason, kernel.capture_safe, kernel)
        eager[op] = native.bind(kernel)
        if kernel.capture_safe:
            graph_choices[op], graph[op] = choices[op], eager[op]
        else:
            graph_choices[op] = OpChoice(op, "torch", "native op is not capture-safe (host syncs)", True)
            graph[op] = portable[op]
    selection = OpSelection(
        types.SimpleNamespace(**eager), types.SimpleNamespace(**graph), choices, graph_choices, mode, build
    )
    _report(selection)
    return selection


_reported: set = set()


def _report(selection: OpSelection) -> None:
    """Log each fallback and graph substitution once per process."""
    for op in selection.choices:
        eager, graph = selection.choices[op], selection.graph_choices[op]
        if eager.provider == "torch" and ("eager", op) not in _reported:
            _reported.add(("eager", op))
            logger.warning("sglang-xpu-lora: %s uses the portable PyTorch op (%s)", op, eager.reason)
        elif eager.provider == "native" and graph.provider == "torch" and ("graph", op) not in _reported:
            _reported.add(("graph", op))
            logger.info("sglang-xpu-lora: %s: native outside graphs, portable inside graphs (%s)", op, graph.reason)


def runs_on_device(device: Optional[str]) -> bool:
    """Whether ``intel_xpu`` can serve on ``device`` (a device other than ``xpu``): with the portable
    kernels, or when the installed build registers every op it has for that device (e.g. a CPU
    build of the kernels, such as the test emulator)."""
    mode = kernels_choice()
    if mode == "torch":
        return True
    from sglang_xpu_lora.providers import native

    module, _, found = _detect_native()
    if module is None or device is None:
        return False
    kernels = [kernel for kernel, _ in found.values() if kernel is not None]
    return bool(kernels) and all(native.has_kernel_for_device(k, device) for k in kernels)
