"""What every provider is: the seven sgl-kernel-xpu LoRA ops (:class:`LoRAOpsProvider`, the one
written source of their signatures) and what a provider says about itself to the selection
(:class:`Provider`, :class:`Offer`).

Signatures and semantics mirror the Python wrappers in sgl-kernel-xpu ``python/sgl_kernel/lora.py``
(see ``shared/research/sgl-kernel-xpu-ops-and-plugin-conventions.md`` section 1). Common contract:

* ``seg_indptr``: ``(num_segments + 1,)`` int32, token-row boundaries, ``seg_indptr[0] == 0``,
  non-decreasing; empty segments are allowed. Rows at or past ``seg_indptr[-1]`` belong to no
  segment and receive no LoRA contribution.
* ``weight_indices``: ``(num_segments,)`` int32, the pool slot of each segment.
* ``lora_ranks``: ``(max_loras,)``, the real rank ``r`` of each slot. The caller must keep rank
  tails zero (A rows from ``num_slices * r`` on, B columns from ``r`` on; the plugin's pool patch
  zeroes each slot before a load): the native GEMM ops (and the portable ones routed on the
  device) contract over the full ``max_rank`` without reading it, the portable ops routed on the
  host contract over each slot's rank, SGLang's Triton kernels read only ``[0, r)``; only the
  embedding op masks the rank tail.
* ``scalings``: ``(max_loras,)`` float32, ``lora_alpha / r`` per slot, applied in the B (expand) stage.
* ``permutation`` (chunked ops): ``(num_tokens,)`` int32 logical-to-physical row map; segments then
  describe logical order. ``None`` means segments are in physical row order.
* Stacked A weights are SGLang's packed layout: a rank-``r`` slot holds slice ``p`` at rows
  ``[p * r, (p + 1) * r)``. Every shrink computes ``x @ A^T`` over all ``num_slices * max_rank``
  rows, so its output is packed the same way (slice ``p`` at columns ``[p * r, (p + 1) * r)``,
  zero from ``num_slices * r`` on). One-slice B ops read that as it is. The multi-slice B ops
  (``qkv_lora_b_fwd``, ``gate_up_lora_b_fwd``, ``chunked_sgmv_lora_expand_fwd`` with
  ``num_slices > 1``) differ by provider: SGLang's Triton kernels read the packed output, the
  native and portable ones read slice ``p`` at columns ``[p * max_rank, (p + 1) * max_rank)``, as
  :func:`.slice_layout.spaced_slices` lays it out (the backend calls it between the two).
* The B ops of the Triton provider (:mod:`.triton_ops`) and of the portable provider
  (:mod:`.torch_ops`) add into ``base_output`` in place and return it, as SGLang's kernels and its
  ``torch_native`` backend do; the native ops return new tensors and only read ``base_output``.
  Callers use the returned tensor and do not reuse ``base_output``.
* Called through an :class:`~.selection.OpSelection` table, every op also takes the keyword
  ``batch_info`` (SGLang's ``LoRABatchInfo`` of the batch), which only the Triton provider reads.

The portable and Triton providers write the seven ops out as functions with these signatures (the
Triton ones with a keyword-only ``batch_info`` added, and ``launches``, a launch cache, where they
launch a kernel; the portable GEMM ops with ``routing``); the native provider binds each kernel to
them by name (:func:`parameters`). ``tests/unit/test_provider_interface.py`` compares every
provider's ops with :class:`LoRAOpsProvider` (:func:`signature_mismatch`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, Mapping, Optional, Protocol, Union

import torch

#: The op names every provider exports, in the order the sgl-kernel-xpu builds added them.
OP_NAMES = (
    "embedding_lora_a_fwd",
    "sgemm_lora_a_fwd",
    "sgemm_lora_b_fwd",
    "qkv_lora_b_fwd",
    "gate_up_lora_b_fwd",
    "chunked_sgmv_lora_shrink_fwd",
    "chunked_sgmv_lora_expand_fwd",
)


class LoRAOpsProvider(Protocol):
    """The seven LoRA ops with these exact signatures: what a provider module exports, and the
    type of the selection's op tables (which also pass ``batch_info``)."""

    def embedding_lora_a_fwd(
        self,
        input_ids: torch.Tensor,
        weights: torch.Tensor,
        vocab_size: int,
        seg_indptr: torch.Tensor,
        weight_indices: torch.Tensor,
        lora_ranks: torch.Tensor,
        extra_embeddings: Optional[torch.Tensor] = None,
        seg_lens: Optional[torch.Tensor] = None,
        max_len: Optional[int] = None,
    ) -> torch.Tensor: ...

    def sgemm_lora_a_fwd(
        self,
        input_x: torch.Tensor,
        weights: torch.Tensor,
        num_slices: int,
        seg_indptr: torch.Tensor,
        weight_indices: torch.Tensor,
        lora_ranks: torch.Tensor,
        seg_lens: Optional[torch.Tensor] = None,
    ) -> torch.Tensor: ...

    def sgemm_lora_b_fwd(
        self,
        input_x: torch.Tensor,
        weights: torch.Tensor,
        seg_indptr: torch.Tensor,
        weight_indices: torch.Tensor,
        lora_ranks: torch.Tensor,
        scalings: torch.Tensor,
        seg_lens: Optional[torch.Tensor] = None,
        base_output: Optional[torch.Tensor] = None,
    ) -> torch.Tensor: ...

    def qkv_lora_b_fwd(
        self,
        input_x: torch.Tensor,
        qkv_lora_b: torch.Tensor,
        output_offset: torch.Tensor,
        max_qkv_out_dim: int,
        seg_indptr: torch.Tensor,
        weight_indices: torch.Tensor,
        lora_ranks: torch.Tensor,
        scalings: torch.Tensor,
        seg_lens: Optional[torch.Tensor] = None,
        base_output: Optional[torch.Tensor] = None,
    ) -> torch.Tensor: ...

    def gate_up_lora_b_fwd(
        self,
        input_x: torch.Tensor,
        gate_up_lora_b: torch.Tensor,
        output_dim: int,
        seg_indptr: torch.Tensor,
        weight_indices: torch.Tensor,
        lora_ranks: torch.Tensor,
        scalings: torch.Tensor,
        seg_lens: Optional[torch.Tensor] = None,
        base_output: Optional[torch.Tensor] = None,
    ) -> torch.Tensor: ...

    def chunked_sgmv_lora_shrink_fwd(
        self,
        input_x: torch.Tensor,
        weights: torch.Tensor,
        num_slices: int,
        num_segments: int,
        seg_indptr: torch.Tensor,
        weight_indices: torch.Tensor,
        lora_ranks: torch.Tensor,
        permutation: Optional[torch.Tensor] = None,
    ) -> torch.Tensor: ...

    def chunked_sgmv_lora_expand_fwd(
        self,
        input_x: torch.Tensor,
        weights: torch.Tensor,
        slice_offsets: torch.Tensor,
        max_slice_size: int,
        num_slices: int,
        num_segments: int,
        seg_indptr: torch.Tensor,
        weight_indices: torch.Tensor,
        lora_ranks: torch.Tensor,
        scalings: torch.Tensor,
        permutation: Optional[torch.Tensor] = None,
        base_output: Optional[torch.Tensor] = None,
    ) -> torch.Tensor: ...


def signature(op: str) -> inspect.Signature:
    """The interface signature of ``op`` (a name of :data:`OP_NAMES`), without ``self``.

    Raises:
        KeyError: for a name that is not one of the seven ops.
    """
    if op not in OP_NAMES:
        raise KeyError(f"{op!r} is not an op of the interface ({', '.join(OP_NAMES)})")
    method = inspect.signature(getattr(LoRAOpsProvider, op))
    return method.replace(parameters=list(method.parameters.values())[1:])


def parameters(op: str) -> tuple[str, ...]:
    """The interface's parameter names of ``op``, in order (what native detection binds a kernel's
    schema arguments to)."""
    return tuple(signature(op).parameters)


def signature_mismatch(op: str, function: Callable, keyword_only: tuple[str, ...] = ()) -> Optional[str]:
    """How ``function``'s signature differs from the interface's ``op`` (names, order, kinds,
    defaults and annotations as written), or None when it matches. ``keyword_only`` names the
    keyword-only parameters a provider adds after the interface's (the Triton ops' ``batch_info`` and
    ``launches``, the portable ops' ``routing``), compared by name and kind only."""
    expected = list(signature(op).parameters.values())
    expected += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY) for name in keyword_only]
    actual = list(inspect.signature(function).parameters.values())
    for position, (want, got) in enumerate(zip(expected, actual)):
        if want.name in keyword_only:  # a provider's own keyword: its name and kind are the contract
            got = got.replace(default=inspect.Parameter.empty, annotation=inspect.Parameter.empty)
        if (want.name, want.kind, want.default) != (got.name, got.kind, got.default) or (
            want.annotation is not inspect.Parameter.empty and str(want.annotation) != str(got.annotation)
        ):
            return f"{op}: parameter {position} is {_spelled(got)} where the interface has {_spelled(want)}"
    if len(expected) != len(actual):
        extra = [_spelled(p) for p in (actual[len(expected):] or expected[len(actual):])]
        return f"{op}: {'extra' if len(actual) > len(expected) else 'missing'} parameter(s) {', '.join(extra)}"
    return None


def _spelled(parameter: inspect.Parameter) -> str:
    """``parameter`` as written (string annotations unquoted), keyword-only ones marked ``*,``."""
    text = parameter.name
    if parameter.annotation is not inspect.Parameter.empty:
        text += f": {parameter.annotation}"
    if parameter.default is not inspect.Parameter.empty:
        text += f" = {parameter.default!r}"
    return f"*, {text}" if parameter.kind is inspect.Parameter.KEYWORD_ONLY else text


def ignoring_batch_info(function: Callable) -> Callable:
    """``function`` (an op with the interface's signature) with the op tables' calling convention:
    it also accepts the keyword ``batch_info`` and drops it."""

    @functools.wraps(function)
    def call(*args, batch_info=None, **kwargs):
        return function(*args, **kwargs)

    return call


Device = Union[str, torch.device, None]


def device_type(device: Device) -> Optional[str]:
    """``"xpu"``, ``"cuda"``, ``"cpu"``... for a device or device name; None when unknown."""
    return None if device is None else torch.device(device).type


@dataclasses.dataclass(frozen=True)
class Offer:
    """What one provider offers for one op on the serving device.

    ``function`` is the op with the op tables' calling convention (the interface's keywords plus
    ``batch_info``), None when the provider cannot serve the op there; ``reason`` says why (not).
    ``capture_safe``: whether it may run inside CUDA/XPU graphs (None: not decided yet, a trial
    capture decides it), with ``capture_reason`` saying why (empty when it needs no saying).
    ``kernel``: what a trial capture binds (the native provider's ``KernelOp``).
    """

    function: Optional[Callable[..., torch.Tensor]]
    reason: str
    capture_safe: Optional[bool] = True
    capture_reason: str = ""
    kernel: Optional[object] = None


@dataclasses.dataclass(frozen=True, eq=False)
class Provider:
    """What a provider says about itself to the selection (:mod:`.selection`), once, in its own
    module (``PROVIDER``); the selection derives pairing and pool layout from these flags and
    never names a provider.

    Attributes:
        name: its ``SGLANG_XPU_LORA_KERNELS`` value, and its name in logs and ``doctor``.
        title: how reasons name its ops ("no {title}: ...", "reads the {title} ... output").
        contracts_over_max_rank: its GEMM ops contract over the full ``max_lora_rank``, reading rank
            tails as zeros, so pool slots must be zeroed before each load.
        expands_read_spaced_slices: its multi-slice expands read slice ``p`` of their input at
            column ``p * max_lora_rank`` (else SGLang's packed ``p * rank``), so the backend
            re-spaces a packed shrink output before them (:mod:`.slice_layout`).
        shrink_feeds_only_own_expands: its shrinks leave rows and columns unwritten that only its
            own expands skip, so every expand reading its shrink's output is served by it too.
        capture_by_trial: whether its ops may run inside graphs is decided per op by a trial
            capture at graph set-up (:mod:`.capture_probe`, which calls :meth:`bind_trial`);
            otherwise its ops are capture-safe.
        may_sync_with_host: its ops may read device memory on the host (synchronise) in eager
            mode, unless a trial capture showed them sync-free; in eager decode under ``auto``
            a provider with ``avoids_host_syncs_in_eager_decode`` then serves the permuted ops.
        avoids_host_syncs_in_eager_decode: its permuted (decode) ops never synchronise with the
            host and cost less than a syncing provider's in eager decode, so they replace those of
            a provider that ``may_sync_with_host`` (:data:`.selection.EAGER_DECODE_AVOIDS_HOST_SYNCS`).
        last_resort: it runs anywhere and serves what nothing else serves (slowly): choosing it
            is logged as a warning, and it alone never lets ``intel_xpu`` run off ``xpu``.
        serves_dense_tier: where the selection gives it the linears' shrink, the backend runs
            those linears on the dense tier instead (:mod:`sglang_xpu_lora.dense`: SGLang's
            ``triton_v2`` kernels, which run wherever its Triton kernels run).
        caches_routing: its ops take a keyword-only ``routing``, the batch's
            :class:`~.torch_routing.cache.RoutingCache`, so each batch's routing is computed once
            for all of its layers (:mod:`.batch_binding` passes one per batch).
        uses_launch_cache: its batch-bound ops launch their kernels through a launch cache
            (:class:`.triton_launch.TritonLaunches`: compiled kernels, kept across batches) that
            the binding's caller owns and :meth:`bind_to_batch` receives; the backend owns one
            where its selection has such a provider (:attr:`.selection.OpSelection.uses_launch_cache`).
    """

    name: str
    title: str
    contracts_over_max_rank: bool
    expands_read_spaced_slices: bool
    shrink_feeds_only_own_expands: bool = False
    capture_by_trial: bool = False
    may_sync_with_host: bool = False
    avoids_host_syncs_in_eager_decode: bool = False
    last_resort: bool = False
    caches_routing: bool = False
    serves_dense_tier: bool = False
    uses_launch_cache: bool = False

    def offers(self, device_kind: Optional[str], kernels: str, graph_verdicts: Mapping) -> dict[str, Offer]:
        """An :class:`Offer` per op of :data:`OP_NAMES` on a device of type ``device_kind`` (None:
        unknown), under ``SGLANG_XPU_LORA_KERNELS=kernels``, with the trial captures' verdicts so
        far (op -> :class:`.capture_probe.Verdict`).

        Raises:
            ValueError: for an invalid setting the provider reads (``SGLANG_XPU_LORA_GRAPH_NATIVE``).
        """
        raise NotImplementedError

    def unavailable_error(self, op: str, device_kind: Optional[str], reason: str) -> str:
        """The start-up error when ``SGLANG_XPU_LORA_KERNELS`` forces this provider and it cannot
        serve ``op`` (``reason``: its offer's)."""
        return f"the {self.name} provider cannot serve {op} on {device_kind}: {reason}"

    def bind_to_batch(self, names: tuple, batch_info, launches) -> dict[str, Callable[..., torch.Tensor]]:
        """Its own binding of the ops (and chunked-expand forms) ``names`` of one batch's route to
        that batch (:mod:`.batch_binding`, one call per route and provider): name -> bound op, empty
        for the keyword binding every provider gets. ``launches``: the caller's launch cache
        (:attr:`uses_launch_cache`; None where it owns none)."""
        return {}

    def bind_trial(self, kernel: Any) -> Callable[..., torch.Tensor]:
        """The call a trial capture makes of ``kernel`` (its :attr:`Offer.kernel`): the op with the
        interface's keyword arguments (:mod:`.capture_probe`). Only for ``capture_by_trial``.

        Raises:
            NotImplementedError: for a provider whose capture safety is not decided by trial.
        """
        raise NotImplementedError(f"the {self.name} provider is not captured by trial")
