"""What each LoRA op of a batch takes, prepared once per batch for ``IntelXpuLoRABackend``.

SGLang calls the backend's ``run_*`` methods once per LoRA module per layer (a few hundred times per
decode step); everything that depends only on the batch is built here, in ``prepare_lora_batch``
or graph set-up, so a ``run_*`` call looks up its :class:`BatchRoute` and calls its op(s):

* the op table (eager, or capture-safe inside graphs) and the index arguments every op takes
  (``seg_indptr``, ``weight_indices``, ``lora_ranks``, ``scalings``, ``batch_info``), as dicts;
* ``permutation[:rows]`` for the permuted (decode) ops, sliced once per row count;
* for the permuted ops served by SGLang's Triton kernels, the choice between its dense kernels
  (``sgemm_lora_a_fwd`` and the B kernels, over one segment per slot) and its chunked-SGMV kernels
  (the ``csgmv`` backend's, over segments of at most ``chunk_size`` tokens,
  :func:`chunk_segments`), by a host integer only: the op's row count (:class:`ChunkedDecodeRule`),
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
from typing import Optional

import torch

from sglang_xpu_lora.providers import triton_ops


@dataclasses.dataclass(frozen=True)
class ChunkedDecodeRule:
    """When a permuted (decode) batch on the Triton provider runs SGLang's chunked-SGMV kernels
    rather than its dense ones: from ``min_tokens`` rows on (None: never), in chunks of
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
    """The chunk segments of one permuted batch and the batch infos SGLang's chunked kernels read,
    per row count (``max_len`` = the chunk size, the kernels' block rows)."""

    def __init__(self, kernel_info, indptr: torch.Tensor, weight_indices: torch.Tensor, num_slots: int, rule: ChunkedDecodeRule):
        self._kernel_info, self._indptr, self._weight_indices = kernel_info, indptr, weight_indices
        self._num_slots, self.rule = num_slots, rule
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


class BatchRoute:
    """How the ops of one batch info (``info``) are called in this batch.

    ``ops`` is the op table of the batch (:meth:`OpSelection.for_graph`); ``kernel_info`` the batch
    info SGLang's Triton kernels read for it; ``chunked`` the chunk routing when the permuted ops
    may run the chunked kernels (:class:`ChunkedDecodeRule`), else None.
    """

    __slots__ = ("info", "ops", "index", "b_index", "permuted", "chunked", "_rows", "_permutation")

    def __init__(self, info, ops: types.SimpleNamespace, kernel_info, chunked: Optional[ChunkedRouting] = None):
        self.info, self.ops, self.chunked = info, ops, chunked
        self.index = dict(
            seg_indptr=info.seg_indptr, weight_indices=info.weight_indices, lora_ranks=info.lora_ranks,
            batch_info=kernel_info,
        )
        self.b_index = {**self.index, "scalings": info.scalings}
        self.permuted = info.permutation is not None
        self._rows, self._permutation = -1, None

    def permutation(self, rows: int) -> Optional[torch.Tensor]:
        """``info.permutation[:rows]`` (None for contiguous batches), sliced once per row count."""
        if not self.permuted:
            return None
        if rows != self._rows:
            self._rows, self._permutation = rows, self.info.permutation[:rows]
        return self._permutation

    def _chunked_info(self, rows: int):
        chunked = self.chunked
        return chunked.batch_info(rows) if chunked is not None and chunked.rule.applies(rows) else None

    def shrink(self, x: torch.Tensor, weights: torch.Tensor, stack_num: int) -> torch.Tensor:
        """(s, K) x (L, stack_num * R, K) -> (s, stack_num * R)."""
        if not self.permuted:
            return self.ops.sgemm_lora_a_fwd(input_x=x, weights=weights, stack_num=stack_num, **self.index)
        rows = x.shape[0]
        chunked = self._chunked_info(rows)
        if chunked is not None:
            return triton_ops.csgmv_shrink_fwd(x, weights, stack_num, batch_info=chunked)
        return self.ops.chunked_sgmv_lora_shrink_fwd(
            input_x=x, weights=weights, stack_num=stack_num, num_segments=self.info.num_segments,
            permutation=self.permutation(rows), **self.index,
        )

    def chunked_expand(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        slice_offsets: torch.Tensor,
        max_slice_size: int,
        num_slices: int,
        base_output: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """``num_slices`` bands at device ``slice_offsets`` (permuted batches, and contiguous ones
        with a slice count no other B op serves). x: (s, num_slices * R); weights: (L, N, R)."""
        rows = x.shape[0]
        chunked = self._chunked_info(rows) if self.permuted else None
        if chunked is not None:
            return triton_ops.csgmv_expand_fwd(x, weights, slice_offsets, max_slice_size, base_output, batch_info=chunked)
        return self.ops.chunked_sgmv_lora_expand_fwd(
            input_x=x, weights=weights, slice_offsets=slice_offsets, max_slice_size=max_slice_size,
            num_slices=num_slices, num_segments=self.info.num_segments, permutation=self.permutation(rows),
            base_output=base_output, **self.b_index,
        )
