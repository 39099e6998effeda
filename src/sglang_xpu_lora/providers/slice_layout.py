"""Where the slices of a stacked projection sit between shrink and expand, and the one gather that
moves them for the expands that contract every slice over ``max_rank``.

SGLang's pool writes a rank-``r`` adapter's stacked LoRA-A (qkv, gate_up, ...) packed: slice ``p``
at rows ``[p * r, (p + 1) * r)`` of its slot (``LoRAMemoryPool.load_lora_weight_to_buffer``), and
the plugin's pool patch zeroes the slot before each load, so rows from ``S * r`` on are zero. Every
shrink computes ``x @ A^T`` over all ``S * max_rank`` rows, so its output is packed the same way:
slice ``p`` at columns ``[p * r, (p + 1) * r)``, zero from ``S * r`` on. SGLang's Triton expands
read that as it is (they are given each slot's real rank). The sgl-kernel-xpu multi-slice expands
(``qkv_lora_b_fwd``, ``gate_up_lora_b_fwd``, ``chunked_sgmv_lora_expand_fwd`` with more than one
slice) and the portable ones, which mirror them, read slice ``p`` at columns
``[p * max_rank, (p + 1) * max_rank)`` and contract over ``max_rank`` (shared/research kernels note
sections 1.5-1.8). :func:`spaced_slices` gives them that: one gather per layer, with an index
(:func:`spacing_index`) that depends only on the batch, so it is built once per batch.

Both functions are device kernels with shapes fixed by tensor shapes: no host synchronisation,
capture-safe. One-slice ops need nothing: slice 0 starts at column 0 in both layouts, and LoRA-B
(``(L, N, max_rank)``, columns ``[0, r)`` written) is the same in both.
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang_xpu_lora.providers.torch_routing.device import row_slots


def spacing_index(
    seg_indptr: torch.Tensor,
    weight_indices: torch.Tensor,
    lora_ranks: torch.Tensor,
    num_rows: int,
    num_slices: int,
    max_rank: int,
    permutation: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Gather index from a packed shrink output to the max-rank-spaced one, per physical row.

    Args:
        seg_indptr, weight_indices, permutation: the batch's segments, as the shrink was given
            them (see :func:`.torch_routing.device.row_slots`).
        lora_ranks: ``(max_loras,)`` integer, each slot's real rank.
        num_rows: rows of the shrink output; num_slices: its slices ``S`` (> 1); max_rank: the
            pool's ``max_lora_rank`` (the output is ``(num_rows, S * max_rank)``).

    Returns:
        ``(num_rows, S * max_rank)`` int64: for a row of rank ``r`` (0 outside every segment),
        column ``p * max_rank + j`` reads packed column ``p * r + j`` for ``j < r``, else column
        ``S * max_rank - 1``, which is zero wherever ``r < max_rank`` (it lies at or past ``S * r``,
        in the zeroed slot tail), so the spaced rank tails are zero.
    """
    device = seg_indptr.device
    slots = row_slots(seg_indptr, weight_indices, num_rows, permutation)
    ranks = lora_ranks.to(device=device, dtype=torch.int64)[slots.clamp(min=0)].clamp(0, max_rank)
    ranks = ranks.masked_fill(slots < 0, 0).view(num_rows, 1, 1)
    within = torch.arange(max_rank, device=device).view(1, 1, max_rank)
    packed = torch.arange(num_slices, device=device).view(1, num_slices, 1) * ranks + within
    tail = num_slices * max_rank - 1
    return torch.where(within < ranks, packed, tail).view(num_rows, num_slices * max_rank)


def spaced_slices(packed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The shrink output ``packed`` ``(T, S * max_rank)`` with slice ``p`` moved to columns
    ``[p * max_rank, (p + 1) * max_rank)``, zero rank tails: ``(T, S * max_rank)``, packed's dtype.
    ``index`` is :func:`spacing_index` of the batch for ``T`` rows and ``S`` slices."""
    return packed.gather(1, index)
