"""Native provider: the sgl-kernel-xpu LoRA ops through ``torch.ops.sgl_kernel``, detected per op.

Detection is by schema, not by version string: for each op the known kernel names are looked up
(``chunked_sgmv_lora_shrink_fwd`` also under its first name ``chunked_sgmv_lora_shrink_forward``)
and the call is bound to the schema's argument names, so optional arguments that only some builds
have (``embedding_lora_a_fwd``'s ``max_len``) are passed exactly when the build declares them. An op
whose schema needs an argument this plugin cannot supply counts as absent.

The raw ops take the output first (``Tensor! output, ...) -> ()``); :func:`bind` allocates it the
way the sgl-kernel-xpu Python wrappers do (``python/sgl_kernel/lora.py``), zero-filled.

Whether an op may run inside CUDA/XPU graphs is not read from the build (no build declares it, and
every build seen so far validates inputs on the host with ``.item()``/``.cpu()``): it is decided by
a trial capture at graph set-up (:mod:`.capture_probe`), or by ``SGLANG_XPU_LORA_GRAPH_NATIVE``.

:data:`PROVIDER` describes the provider to the selection: its ops contract over the full
``max_rank`` (zeroed pool slots), its multi-slice expands read slice ``p`` at ``p * max_rank``, its
capture safety is decided by trial (:meth:`NativeProvider.bind_trial`), and its ops may sync with
the host in eager mode.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Mapping, Optional

import torch

from sglang_xpu_lora.providers.base import OP_NAMES, Offer, Provider, parameters
from sglang_xpu_lora.providers.capture_probe import Verdict, graph_native_choice
from sglang_xpu_lora.settings import GRAPH_NATIVE_ENV, KERNELS_ENV

#: Kernel names per op, newest first.
KERNEL_NAMES = {op: (op,) for op in OP_NAMES} | {
    "chunked_sgmv_lora_shrink_fwd": ("chunked_sgmv_lora_shrink_fwd", "chunked_sgmv_lora_shrink_forward"),
}

#: The first sgl-kernel-xpu build that has each op (shared/research, kernels note section 1.0; the
#: releases after v0.1.0 are published on GitHub only, so later ones are named by their PR).
MINIMUM_BUILD = {
    "embedding_lora_a_fwd": "sgl-kernel-xpu v0.1.0",
    "sgemm_lora_a_fwd": "sgl-kernel-xpu v0.1.0",
    "sgemm_lora_b_fwd": "an sgl-kernel-xpu build with PR #356 (probably 0.2.0)",
    "qkv_lora_b_fwd": "an sgl-kernel-xpu build with PR #393 (probably 0.2.0)",
    "gate_up_lora_b_fwd": "an sgl-kernel-xpu build with PR #490 (gate_up_lora_b_fwd)",
    "chunked_sgmv_lora_shrink_fwd": "an sgl-kernel-xpu build with PR #506 (chunked SGMV shrink)",
    "chunked_sgmv_lora_expand_fwd": "an sgl-kernel-xpu build with chunked_sgmv_lora_expand_fwd (after PR #506)",
}

#: Schema argument names that differ from the provider interface's names, per op.
ALIASES = {
    "sgemm_lora_a_fwd": {"stack_num": "num_slices"},
    "chunked_sgmv_lora_shrink_fwd": {"x": "input_x"},
    "chunked_sgmv_lora_expand_fwd": {"x": "input_x"},
}


def _output_shape(op: str, kwargs: dict[str, Any]) -> tuple[tuple[int, ...], torch.dtype]:
    if op == "embedding_lora_a_fwd":
        return (kwargs["input_ids"].shape[0], kwargs["weights"].shape[1]), kwargs["weights"].dtype
    x = kwargs["input_x"]
    if op == "qkv_lora_b_fwd":
        return (x.shape[0], kwargs["qkv_lora_b"].shape[1]), x.dtype
    if op == "gate_up_lora_b_fwd":
        return (x.shape[0], 2 * kwargs["output_dim"]), x.dtype
    return (x.shape[0], kwargs["weights"].shape[1]), x.dtype


@dataclasses.dataclass(frozen=True)
class KernelOp:
    """One op found in the installed build."""

    op: str  #: provider-interface name
    kernel_name: str  #: name under ``torch.ops.sgl_kernel``
    arguments: tuple[str, ...]  #: schema argument names after ``output``

    @property
    def schema_note(self) -> str:
        return f"torch.ops.sgl_kernel.{self.kernel_name}({', '.join(self.arguments)})"


def kernel_build() -> tuple[Optional[Any], str]:
    """``(sgl_kernel module or None, description)``; importing it registers the ops."""
    try:
        module = importlib.import_module("sgl_kernel")
    except Exception as exc:  # noqa: BLE001 - a broken build is as unusable as a missing one
        return None, f"sgl_kernel is not importable ({type(exc).__name__}: {exc})"
    return module, f"sgl_kernel {getattr(module, '__version__', 'unknown version')}"


def _schema_arguments(kernel_name: str) -> Optional[list]:
    try:
        return list(getattr(torch.ops.sgl_kernel, kernel_name).default._schema.arguments)
    except (AttributeError, RuntimeError):  # no such op, or no default overload
        return None


def detect_op(op: str) -> tuple[Optional[KernelOp], str]:
    """Find ``op`` in the loaded build. Returns ``(KernelOp or None, reason)``: found when every
    schema argument after ``output`` is, by its name (:data:`ALIASES` applied), a parameter of the
    interface's ``op`` (:func:`.base.parameters`) or optional."""
    aliases, known = ALIASES.get(op, {}), parameters(op)
    for kernel_name in KERNEL_NAMES[op]:
        arguments = _schema_arguments(kernel_name)
        if arguments is None:
            continue
        names = [a.name for a in arguments]
        if not names or names[0] != "output":
            return None, f"torch.ops.sgl_kernel.{kernel_name} has an unknown schema (no leading output)"
        unknown = [
            a.name
            for a in arguments[1:]
            if aliases.get(a.name, a.name) not in known and not a.type.kind() == "OptionalType"
        ]
        if unknown:
            return None, f"torch.ops.sgl_kernel.{kernel_name} needs unsupported argument(s) {', '.join(unknown)}"
        kernel = KernelOp(op, kernel_name, tuple(names[1:]))
        return kernel, f"found {kernel.schema_note}"
    return None, f"not in the installed build (first in {MINIMUM_BUILD[op]})"


def has_kernel_for_device(kernel: KernelOp, device_type: str) -> bool:
    """Whether the build registered an implementation of ``kernel`` for ``device_type`` (e.g. ``xpu``)."""
    dispatch_key = {"xpu": "XPU", "cpu": "CPU", "cuda": "CUDA"}.get(device_type, device_type.upper())
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"sgl_kernel::{kernel.kernel_name}", dispatch_key)


def bind(kernel: KernelOp) -> Callable[..., torch.Tensor]:
    """A function with the provider-interface signature (keywords) that calls the raw kernel."""
    raw = getattr(torch.ops.sgl_kernel, kernel.kernel_name).default
    op = kernel.op
    names = [ALIASES.get(op, {}).get(name, name) for name in kernel.arguments]

    def call(**kwargs: Any) -> torch.Tensor:
        shape, dtype = _output_shape(op, kwargs)
        device = (kwargs.get("input_x") if "input_x" in kwargs else kwargs["input_ids"]).device
        output = torch.zeros(shape, dtype=dtype, device=device)
        raw(output, *(kwargs.get(name) for name in names))
        return output

    call.__name__ = op
    call.__qualname__ = f"native.{op}"
    return call


def capture_verdict(verdict: Optional[Verdict], graph_native: str) -> tuple[Optional[bool], str]:
    """Whether a native op runs inside graphs (None: not tried yet), and why, from its trial
    capture's ``verdict`` (None: none yet) and ``SGLANG_XPU_LORA_GRAPH_NATIVE=graph_native``."""
    if graph_native == "always":
        return True, f"{GRAPH_NATIVE_ENV}=always: runs inside graphs untried"
    if graph_native == "never":
        return False, f"{GRAPH_NATIVE_ENV}=never"
    if verdict is None:
        return None, "capture safety is decided by a trial capture at graph set-up"
    return verdict.capture_safe, verdict.reason


class NativeProvider(Provider):
    """The sgl-kernel-xpu ops: per op, when the installed build has it (:func:`detect_op`) and
    registers a kernel for the serving device; inside graphs as its trial capture decides."""

    def offers(self, device_kind: Optional[str], kernels: str, graph_verdicts: Mapping) -> dict[str, Offer]:
        graph_native = graph_native_choice()
        module, build = kernel_build()
        offers = {}
        for op in OP_NAMES:
            kernel, reason = detect_op(op) if module else (None, build)
            if kernel is not None and device_kind is not None and not has_kernel_for_device(kernel, device_kind):
                kernel, reason = None, f"{kernel.schema_note} has no {device_kind} kernel"
            if kernel is None:
                offers[op] = Offer(None, reason)
                continue
            safe, why = capture_verdict(graph_verdicts.get(op), graph_native)
            offers[op] = Offer(bind(kernel), reason, safe, why, kernel)
        return offers

    def unavailable_error(self, op: str, device_kind: Optional[str], reason: str) -> str:
        return (
            f"{KERNELS_ENV}=native: sgl-kernel-xpu op {op} is unavailable: {reason}. Install "
            f"{MINIMUM_BUILD[op]} or newer, or set {KERNELS_ENV}=auto to use another provider for it"
        )

    def bind_trial(self, kernel: KernelOp) -> Callable[..., torch.Tensor]:
        return bind(kernel)


PROVIDER = NativeProvider(
    name="native", title="native op", contracts_over_max_rank=True, expands_read_spaced_slices=True,
    capture_by_trial=True, may_sync_with_host=True,
)
