"""What each LoRA op of a batch takes, prepared once per batch for ``IntelXpuLoRABackend``.

SGLang calls the backend's ``run_*`` methods once per LoRA module per layer (a few hundred times per
decode step); everything that depends only on the batch is built here, in ``prepare_lora_batch``
or graph set-up, so a ``run_*`` call looks up its :class:`BatchRoute` and calls one of its module callables:

* the ops of the op table (eager, or capture-safe inside graphs) bound to the batch
  (``OpSelection.bind_batch``): index tensors, scalings and SGLang's batch info are already in
  them, so per call only the module's tensors and host integers are passed, positionally (for the
  Triton provider, SGLang's kernels are called as ``TritonLoRABackend`` calls them);
* which op serves each module, and whether its input needs the slice gather of the native and
  portable multi-slice expands, decided once per route;
* for the permuted ops served by a provider with chunked kernels of its own
  (``Provider.chunked_decode_kernels``; Triton: SGLang's), the choice between its dense kernels
  (for Triton ``sgemm_lora_a_fwd`` and the B kernels, over one segment per slot) and its chunked
  ones (for Triton the ``csgmv`` backend's chunked-SGMV kernels, over segments of at most
  ``chunk_size`` tokens, :func:`chunk_segments`), by a host integer only: the op's row count (:class:`ChunkedDecodeRule`),
  fixed per captured graph, so the choice is the same at capture and replay. Shrink and expand of
  a module always take the same branch (same rule, same rows), so the chunked expand reads a chunked
  shrink's output and the dense expand a dense shrink's (both write the packed intermediate
  ``slice p`` at columns ``p * rank``, rows of live segments only).

Nothing here reads device memory on the host: the chunk routing is built with device kernels into
persistent buffers when a graph may read it (their addresses are captured), into fresh tensors
otherwise.
"""

from __future__ import annotations

import dataclasses
import types
from typing import TYPE_CHECKING, Callable, Optional

import torch

from sglang_xpu_lora.providers import slice_layout
from sglang_xpu_lora.providers.base import ChunkedDecodeKernels
from sglang_xpu_lora.providers.graph_capture import capturing

if TYPE_CHECKING:
    from sglang.srt.lora.utils import LoRABatchInfo


@dataclasses.dataclass(frozen=True)
class ChunkedDecodeRule:
    """When a permuted (decode) batch whose provider has chunked kernels (Triton: SGLang's
    chunked-SGMV kernels) runs them rather than its dense ones: from ``min_tokens`` rows on (None: never), in chunks of
    ``chunk_size`` tokens (16, 32, 64 or 128: the kernels' ``BLOCK_M``; SGLang's ``csgmv`` backend
    uses 16 by default, ``--max-lora-chunk-size``)."""

    min_tokens: Optional[int] = None
    chunk_size: int = 16

    def __post_init__(self):
        if self.chunk_size not in (16, 32, 64, 128):
            raise ValueError(f"chunk_size must be 16, 32, 64 or 128 (the kernels' block rows), got {self.chunk_size}")
        if self.min_tokens is not None and self.min_tokens < 1:
            raise ValueError(f"min_tokens must be a positive row count or None, got {self.min_tokens}")

    def applies(self, rows: int) -> bool:
        return self.min_tokens is not None and rows >= self.min_tokens


def max_chunks(num_tokens: int, num_slots: int, chunk_size: int) -> int:
    """An upper bound of the chunks of ``num_tokens`` tokens over ``num_slots`` slot segments:
    ``sum(ceil(n_s / c)) <= floor(T / c) + min(L, T)``."""
    return num_tokens // chunk_size + min(num_slots, num_tokens)


def chunk_segments(
    seg_indptr: torch.Tensor,
    weight_indices: torch.Tensor,
    chunk_size: int,
    num_chunks: int,
    out: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split per-slot segments (SGLang's decode routing: tokens sorted by slot, one segment per
    slot) into segments of at most ``chunk_size`` tokens, as SGLang's ``csgmv`` backend chunks them.

    Args:
        seg_indptr: ``(L + 1,)`` int32 boundaries of the ``L`` slot segments (logical order).
        weight_indices: ``(L,)`` int32 slot of each segment.
        chunk_size: tokens per chunk at most.
        num_chunks: the number of chunk segments to produce, at least the real count
            (:func:`max_chunks`); the ones past it are empty (start == end == ``seg_indptr[-1]``),
            which the chunked kernels skip.
        out: optional persistent ``((num_chunks + 1,), (num_chunks,))`` int32 buffers to fill in place.

    Returns:
        ``(chunk_indptr (num_chunks + 1,), chunk_weight_indices (num_chunks,))`` int32, on
        ``seg_indptr``'s device; device kernels only (no host synchronisation, capture-safe).
    """
    num_slots = weight_indices.shape[0]
    starts, ends = seg_indptr[:-1].long(), seg_indptr[1:].long()
    chunks = (ends - starts + chunk_size - 1) // chunk_size  # per slot
    last_chunk = torch.cumsum(chunks, 0)  # exclusive end of each slot's chunks
    j = torch.arange(num_chunks, device=seg_indptr.device)
    slot = torch.searchsorted(last_chunk, j, right=True)
    live = slot < num_slots
    slot = slot.clamp_(max=num_slots - 1)
    chunk_start = starts[slot] + (j - (last_chunk[slot] - chunks[slot])) * chunk_size
    total = ends[-1:]
    indptr = torch.cat([torch.where(live, chunk_start, total), total]).to(torch.int32)
    slots = torch.where(live, weight_indices[slot].long(), 0).to(torch.int32)
    if out is None:
        return indptr, slots
    out[0].copy_(indptr)
    out[1].copy_(slots)
    return out


class ChunkedRouting:
    """The chunk segments of one permuted batch, the chunked kernels that run them (``kernels``, of
    the provider serving the batch's permuted ops) and the batch infos they read, per row count
    (``max_len`` = the chunk size, the kernels' block rows)."""

    def __init__(
        self, kernel_info: LoRABatchInfo, indptr: torch.Tensor, weight_indices: torch.Tensor, num_slots: int,
        rule: ChunkedDecodeRule, kernels: ChunkedDecodeKernels,
    ):
        self._kernel_info: LoRABatchInfo = kernel_info
        self._indptr, self._weight_indices = indptr, weight_indices
        self._num_slots, self.rule, self.kernels = num_slots, rule, kernels
        self._infos: dict = {}

    def batch_info(self, rows: int):
        """The chunked batch info for an op over ``rows`` rows: the first :func:`max_chunks` chunk
        segments (the launch grid, fixed per captured graph), the others being empty."""
        info = self._infos.get(rows)
        if info is None:
            count = min(max_chunks(rows, self._num_slots, self.rule.chunk_size), self._weight_indices.shape[0])
            info = self._infos[rows] = dataclasses.replace(
                self._kernel_info, bs=count, num_segments=count, max_len=self.rule.chunk_size,
                seg_indptr=self._indptr[: count + 1], weight_indices=self._weight_indices[:count], seg_lens=None,
            )
        return info


#: The expands whose native and portable implementations read a multi-slice shrink output with
#: slice ``p`` at columns ``p * max_lora_rank`` (:mod:`sglang_xpu_lora.providers.slice_layout`).
MULTI_SLICE_EXPANDS = ("qkv_lora_b_fwd", "gate_up_lora_b_fwd", "chunked_sgmv_lora_expand_fwd")


#: The bound ops (and chunked-expand forms, ``batch_binding.UNIFORM_BAND_FORMS``) a route calls,
#: for permuted batches and for contiguous ones: only these are bound.
PERMUTED_ROUTE_OPS = (
    "chunked_sgmv_lora_shrink_fwd", "chunked_sgmv_lora_expand_fwd", "chunked_expand_one_band", "chunked_expand_two_bands",
)
CONTIGUOUS_ROUTE_OPS = (
    "sgemm_lora_a_fwd", "sgemm_lora_b_fwd", "qkv_lora_b_fwd", "gate_up_lora_b_fwd", "chunked_sgmv_lora_expand_fwd",
)


class BatchRoute:
    """How the LoRA modules of one batch info (``info``) are computed in this batch.

    Built once per batch from the op table's batch-bound ops (``OpSelection.bind_batch`` of
    :data:`PERMUTED_ROUTE_OPS` or :data:`CONTIGUOUS_ROUTE_OPS`,
    :mod:`sglang_xpu_lora.providers.batch_binding`); the backend's ``run_*`` methods call its four
    module callables, which take only per-call tensors and host integers:

    * ``shrink(x, weights, num_slices)``: x ``(s, K)``, weights ``(L, num_slices * R, K)`` ->
      ``(s, num_slices * R)``, packed (slice ``p`` at columns ``p * rank``);
    * ``expand(x, weights, base_output)``: one slice; x ``(s, R)``, weights ``(L, N, R)`` ->
      ``(s, N)``;
    * ``expand_slices(x, weights, slice_offsets, max_slice_size, num_slices, base_output)``:
      ``num_slices`` bands at device ``slice_offsets`` ``(num_slices + 1,)`` int32 (q/k/v, MLA's 2,
      GDN's 4); x ``(s, num_slices * R)``, weights ``(L, N, R)`` -> ``(s, N)``;
    * ``expand_gate_up(x, weights, output_dim, base_output)``: two equal bands; weights
      ``(L, 2 * output_dim, R)`` -> ``(s, 2 * output_dim)``.

    Which op serves each, decided here once: contiguous batches (``info.permutation`` None) the
    prefill ops (``qkv_lora_b_fwd`` for exactly 3 slices, the chunked expand for other counts),
    permuted ones the chunked ops, or with ``chunked`` (:class:`ChunkedRouting`, a provider with
    chunked kernels) those kernels from the rule's row count on, shrink and expand alike. Where the
    op serving a multi-slice expand reads spaced slices (``spaced``, native and portable ops), its
    input goes through :func:`slice_layout.spaced_slices` first, with an index built once per row
    count and slice count in this batch (one built while a graph is being captured is kept apart:
    it is part of that graph). Where no adaptation is needed the module callable is the bound op
    itself (for permuted one-slice and gate/up modules, the chunked expand's uniform-band forms,
    ``batch_binding.UNIFORM_BAND_FORMS``). ``uniform_offsets(num_slices, slice_size)`` gives the
    persistent ``[0, n, 2n, ...]`` offsets the chunked-SGMV kernels read for those modules.
    """

    __slots__ = (
        "info", "permuted", "shrink", "expand", "expand_slices", "expand_gate_up",
        "_ops", "_spaced", "_spacing", "_chunked", "_uniform_offsets", "_gate_up",
    )

    def __init__(
        self,
        info,
        ops: types.SimpleNamespace,
        spaced: frozenset,
        uniform_offsets: Callable[[int, int], torch.Tensor],
        chunked: Optional[ChunkedRouting] = None,
    ):
        if chunked is not None and "chunked_sgmv_lora_expand_fwd" in spaced:
            raise ValueError(
                "the chunked kernels read packed slices: a route whose chunked expand reads spaced slices cannot chunk"
            )
        self.info, self.permuted = info, info.permutation is not None
        self._ops, self._spaced, self._chunked, self._uniform_offsets = ops, spaced, chunked, uniform_offsets
        self._spacing: dict = {}  # (rows, num_slices, capturing) -> spacing index
        if self.permuted:
            gate_up_spaced = "chunked_sgmv_lora_expand_fwd" in spaced
            if chunked is not None:
                self.shrink, self.expand = self._shrink_csgmv, self._expand_csgmv
                self.expand_slices, self._gate_up = self._expand_slices_csgmv, self._expand_gate_up_csgmv
            else:
                self.shrink, self.expand = ops.chunked_sgmv_lora_shrink_fwd, ops.chunked_expand_one_band
                self.expand_slices = self._expand_slices_chunked_sgmv if gate_up_spaced else ops.chunked_sgmv_lora_expand_fwd
                self._gate_up = ops.chunked_expand_two_bands
        else:
            self.shrink, self.expand = ops.sgemm_lora_a_fwd, ops.sgemm_lora_b_fwd
            self._gate_up, gate_up_spaced = ops.gate_up_lora_b_fwd, "gate_up_lora_b_fwd" in spaced
            self.expand_slices = self._expand_slices_contiguous
        self.expand_gate_up = self._expand_gate_up_spaced if gate_up_spaced else self._gate_up

    # --- the slice gather before native / portable multi-slice expands ------------------------

    def _spaced_input(self, x: torch.Tensor, num_slices: int) -> torch.Tensor:
        """``x`` (packed) with slice ``p`` moved to columns ``p * max_lora_rank``, zero rank tails."""
        rows = x.shape[0]
        key = (rows, num_slices, capturing(x.device))
        index = self._spacing.get(key)
        if index is None:
            info = self.info
            permutation = None if info.permutation is None else info.permutation[:rows]
            index = self._spacing[key] = slice_layout.spacing_index(
                info.seg_indptr, info.weight_indices, info.lora_ranks, rows, num_slices, x.shape[1] // num_slices, permutation,
            )
        return slice_layout.spaced_slices(x, index)

    def _expand_gate_up_spaced(self, x, weights, output_dim, base_output):
        return self._gate_up(self._spaced_input(x, 2), weights, output_dim, base_output)

    def _expand_slices_chunked_sgmv(self, x, weights, slice_offsets, max_slice_size, num_slices, base_output):
        """The chunked expand, its input spaced first where its provider reads spaced slices."""
        if num_slices > 1 and "chunked_sgmv_lora_expand_fwd" in self._spaced:
            x = self._spaced_input(x, num_slices)
        return self._ops.chunked_sgmv_lora_expand_fwd(x, weights, slice_offsets, max_slice_size, num_slices, base_output)

    def _expand_slices_contiguous(self, x, weights, slice_offsets, max_slice_size, num_slices, base_output):
        """``qkv_lora_b_fwd`` for exactly 3 slices, the chunked expand for other counts."""
        if num_slices == 3:
            if "qkv_lora_b_fwd" in self._spaced:
                x = self._spaced_input(x, 3)
            return self._ops.qkv_lora_b_fwd(x, weights, slice_offsets, max_slice_size, base_output)
        return self._expand_slices_chunked_sgmv(x, weights, slice_offsets, max_slice_size, num_slices, base_output)

    # --- permuted batches on SGLang's chunked-SGMV kernels (ChunkedDecodeRule) -------------------

    def _shrink_csgmv(self, x, weights, num_slices):
        rows = x.shape[0]
        if self._chunked.rule.applies(rows):
            return self._chunked.kernels.shrink(x, weights, num_slices, batch_info=self._chunked.batch_info(rows))
        return self._ops.chunked_sgmv_lora_shrink_fwd(x, weights, num_slices)

    def _expand_slices_csgmv(self, x, weights, slice_offsets, max_slice_size, num_slices, base_output):
        rows = x.shape[0]  # the shrink's rows: both take the same branch
        if self._chunked.rule.applies(rows):
            return self._chunked.kernels.expand(
                x, weights, slice_offsets, max_slice_size, base_output, batch_info=self._chunked.batch_info(rows)
            )
        return self._ops.chunked_sgmv_lora_expand_fwd(x, weights, slice_offsets, max_slice_size, num_slices, base_output)

    def _expand_csgmv(self, x, weights, base_output):
        out_dim = weights.shape[-2]
        return self._expand_slices_csgmv(x, weights, self._uniform_offsets(1, out_dim), out_dim, 1, base_output)

    def _expand_gate_up_csgmv(self, x, weights, output_dim, base_output):
        return self._expand_slices_csgmv(x, weights, self._uniform_offsets(2, output_dim), output_dim, 2, base_output)
