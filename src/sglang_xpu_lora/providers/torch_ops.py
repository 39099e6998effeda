"""Portable PyTorch provider: the seven sgl-kernel-xpu LoRA ops on any device.

Same signatures and semantics as sgl-kernel-xpu ``python/sgl_kernel/lora.py`` (see
:mod:`sglang_xpu_lora.providers.base` for the shared contract). Design:

* **No loop over segments or requests, no host synchronisation, no data-dependent shapes.** Each
  token row is mapped to its pool slot on the device (``searchsorted`` over ``seg_indptr``, then a
  scatter through ``permutation``), so every op is a fixed sequence of kernels whose shapes depend
  only on tensor shapes: it can be captured in a CUDA/XPU graph.
* **Shrink** (``x @ A^T``) multiplies every row by all ``max_loras`` slots in one GEMM and gathers
  the row's own slot: ``(T, K) @ (K, L*N)``. **Expand** (``@ B^T``) places each row's rank vector
  in its slot's block of a ``(T, L*R)`` matrix and runs one GEMM against all slots' B. Both spend
  ``L`` times the FLOPs of a per-segment grouped GEMM in exchange for one large GEMM, which is the
  better trade on small ranks (the same idea as SGLang's ``torch_native`` graph path, minus its
  per-slot loop and masked copies).
* Like the XPU kernels, the GEMM ops contract over the full ``max_rank`` and ignore ``lora_ranks``;
  rows that belong to no segment get no LoRA contribution; ``scalings`` is applied in fp32 after
  the expand GEMM, then ``base_output`` is added and the sum cast to ``input_x.dtype``.

Raises ``ValueError`` for shape mismatches that can be checked on the host without reading device
memory. Index contents (slot ids, offsets) are trusted, as in a kernel.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

name = "torch"


def _row_slots(
    seg_indptr: torch.Tensor,
    weight_indices: torch.Tensor,
    num_rows: int,
    permutation: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Pool slot of every physical token row: ``(num_rows,)`` int64, ``-1`` outside all segments.

    Segment ``s`` covers logical positions ``[seg_indptr[s], seg_indptr[s + 1])``; with a
    permutation, logical position ``i`` is physical row ``permutation[i]``. Positions outside
    ``[seg_indptr[0], seg_indptr[-1])`` belong to no segment. In a replayed decode graph the rows
    past the live batch are padding and ``permutation`` entries past ``seg_indptr[-1]`` are left
    over from earlier batches: they are ignored, whatever rows they point at.
    """
    device = seg_indptr.device
    num_segments = seg_indptr.numel() - 1
    positions = torch.arange(num_rows, device=device, dtype=seg_indptr.dtype)
    # Last segment whose start is <= position; empty segments are skipped by right=True.
    segment = torch.searchsorted(seg_indptr.contiguous(), positions, right=True) - 1
    inside = (positions >= seg_indptr[0]) & (positions < seg_indptr[-1])
    slot = weight_indices[: max(num_segments, 0)].to(torch.int64)[segment.clamp(0, max(num_segments - 1, 0))]
    logical = torch.where(inside, slot, -1) if num_segments > 0 else torch.full_like(segment, -1, dtype=torch.int64)
    if permutation is None:
        return logical
    # Scatter through the permutation; stale entries (logical -1) are sent to row 0 and lose
    # against any real slot under amax, so they can neither clear nor overwrite a live row.
    targets = torch.where(inside, permutation[:num_rows].to(torch.int64), 0)
    physical = torch.full((num_rows,), -1, dtype=torch.int64, device=device)
    return physical.scatter_reduce(0, targets, logical, reduce="amax")


def _shrink(x: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``out[t] = x[t] @ weights[slots[t]]^T``, zero where ``slots[t] < 0``; (T, N) in x's dtype."""
    num_rows, hidden = x.shape
    num_slots, out_dim, _ = weights.shape
    every_slot = torch.matmul(x, weights.reshape(num_slots * out_dim, hidden).t())
    index = slots.clamp(min=0).view(num_rows, 1, 1).expand(num_rows, 1, out_dim)
    out = every_slot.view(num_rows, num_slots, out_dim).gather(1, index).squeeze(1)
    return out.masked_fill((slots < 0).unsqueeze(1), 0)


def _expand(
    x: torch.Tensor,
    weights: torch.Tensor,
    slots: torch.Tensor,
    scalings: torch.Tensor,
    num_slices: int,
    base_output: Optional[torch.Tensor],
    *,
    bands: Optional[Sequence[tuple[int, int]]] = None,
    slice_offsets: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``out[t, band_p] = scalings[l] * x[t, p*R:(p+1)*R] @ weights[l, band_p]^T (+ base)``.

    ``l = slots[t]``; bands come from host ``bands`` when known statically, else from the device
    tensor ``slice_offsets`` (``(num_slices + 1,)``) without reading it on the host.
    """
    num_rows = x.shape[0]
    num_slots, out_dim, max_rank = weights.shape
    slot_ids = torch.arange(num_slots, device=x.device)
    one_hot = (slots.unsqueeze(1) == slot_ids).to(x.dtype)  # (T, L); all zero outside segments
    # (L*R, out_dim): row l*R + r holds B[l, :, r]; one copy so the GEMM reads B contiguously.
    weights_t = weights.transpose(1, 2).reshape(num_slots * max_rank, out_dim)
    if bands is None:
        column_slice = torch.searchsorted(
            slice_offsets[1:].contiguous().to(torch.int64),
            torch.arange(out_dim, device=x.device),
            right=True,
        )
    out = torch.zeros((num_rows, out_dim), dtype=x.dtype, device=x.device)
    for p in range(num_slices):  # static: the number of stacked projections
        x_p = x[:, p * max_rank : (p + 1) * max_rank]
        x_spread = (one_hot.unsqueeze(2) * x_p.unsqueeze(1)).reshape(num_rows, num_slots * max_rank)
        if bands is not None:
            start, end = bands[p]
            out[:, start:end] = torch.matmul(x_spread, weights_t[:, start:end])
        else:
            out = torch.where(column_slice == p, torch.matmul(x_spread, weights_t), out)
    scale = torch.where(
        slots >= 0, scalings.to(torch.float32)[slots.clamp(min=0)], torch.zeros((), device=x.device)
    )
    result = out.to(torch.float32) * scale.unsqueeze(1)
    if base_output is not None:
        result = result + base_output.to(torch.float32)
    return result.to(x.dtype)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check_expand_input(input_x: torch.Tensor, weights: torch.Tensor, num_slices: int, base_output) -> None:
    _check(input_x.dim() == 2 and weights.dim() == 3, "input_x must be 2-D and weights 3-D")
    _check(
        input_x.shape[1] == num_slices * weights.shape[2],
        f"input_x.size(1)={input_x.shape[1]} must equal num_slices ({num_slices}) * "
        f"max_rank ({weights.shape[2]})",
    )
    if base_output is not None:
        _check(
            tuple(base_output.shape) == (input_x.shape[0], weights.shape[1]),
            f"base_output shape {tuple(base_output.shape)} must be "
            f"{(input_x.shape[0], weights.shape[1])}",
        )


def embedding_lora_a_fwd(
    input_ids: torch.Tensor,
    weights: torch.Tensor,
    vocab_size: int,
    seg_indptr: torch.Tensor,
    weight_indices: torch.Tensor,
    lora_ranks: torch.Tensor,
    extra_embeddings: Optional[torch.Tensor] = None,
    seg_lens: Optional[torch.Tensor] = None,
    max_len: Optional[int] = None,
) -> torch.Tensor:
    """LoRA-A embedding lookup: ``out[t, r] = weights[l, r, input_ids[t]]`` for ``r < rank[l]``.

    Args:
        input_ids: (T,) integer token ids.
        weights: (L, max_rank, vocab_size), fp32/fp16/bf16.
        vocab_size: base vocabulary size; ids in ``[vocab_size, vocab_size + E)`` read
            ``extra_embeddings[l, id - vocab_size, r]``; other ids (negative, out of range) give 0.
        seg_indptr, weight_indices, lora_ranks: see module contract; the rank tail ``r >= rank``
            is zero here (this op, unlike the GEMM ops, masks it in-kernel).
        extra_embeddings: optional (L, E, max_rank), dtype of weights.
        seg_lens, max_len: accepted for signature parity; unused (``max_len`` only sizes the XPU
            kernel's grid).
    Returns:
        (T, max_rank) in the dtype of weights. No scaling is applied.
    Source: sgl-kernel-xpu ``embedding_lora_a_fwd`` (``src/sycl/EmbeddingLoraAFwd.cpp``).
    """
    _check(weights.dim() == 3, "weights must be (num_loras, max_rank, vocab_size)")
    _check(
        weights.shape[2] == vocab_size,
        f"weights.size(2)={weights.shape[2]} must equal vocab_size={vocab_size}",
    )
    num_rows = input_ids.shape[0]
    max_rank = weights.shape[1]
    slots = _row_slots(seg_indptr, weight_indices, num_rows)
    slot = slots.clamp(min=0)
    ids = input_ids.to(torch.int64)
    out = weights[slot, :, ids.clamp(0, vocab_size - 1)]
    found = (ids >= 0) & (ids < vocab_size)
    if extra_embeddings is not None:
        num_extra = extra_embeddings.shape[1]
        in_extra = (ids >= vocab_size) & (ids < vocab_size + num_extra)
        extra = extra_embeddings[slot, (ids - vocab_size).clamp(0, max(num_extra - 1, 0))]
        out = torch.where(in_extra.unsqueeze(1), extra.to(out.dtype), out)
        found = found | in_extra
    rank = lora_ranks.to(torch.int64)[slot].clamp(0, max_rank)
    keep = (torch.arange(max_rank, device=ids.device) < rank.unsqueeze(1)) & (found & (slots >= 0)).unsqueeze(1)
    return torch.where(keep, out, torch.zeros((), dtype=out.dtype, device=out.device))


def sgemm_lora_a_fwd(
    input_x: torch.Tensor,
    weights: torch.Tensor,
    stack_num: int,
    seg_indptr: torch.Tensor,
    weight_indices: torch.Tensor,
    lora_ranks: torch.Tensor,
    seg_lens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Segmented LoRA shrink over contiguous segments: ``out[t] = x[t] @ weights[l]^T``.

    Args:
        input_x: (T, K).
        weights: (L, stack_num * max_rank, K), dtype of input_x; slice p at rows p * max_rank.
        stack_num: number of stacked slices (> 0, divides weights.size(1)).
    Returns:
        (T, stack_num * max_rank), dtype of input_x; zero rows outside every segment.
    Source: sgl-kernel-xpu ``sgemm_lora_a_fwd`` (``src/sycl/SGEMMLoraAFwd.cpp``).
    """
    _check(stack_num > 0 and weights.shape[1] % stack_num == 0, "weights.size(1) must be a multiple of stack_num > 0")
    _check(input_x.shape[1] == weights.shape[2], f"input_x.size(1)={input_x.shape[1]} != weights.size(2)={weights.shape[2]}")
    slots = _row_slots(seg_indptr, weight_indices, input_x.shape[0])
    return _shrink(input_x, weights, slots)


def sgemm_lora_b_fwd(
    input_x: torch.Tensor,
    weights: torch.Tensor,
    seg_indptr: torch.Tensor,
    weight_indices: torch.Tensor,
    lora_ranks: torch.Tensor,
    scalings: torch.Tensor,
    seg_lens: Optional[torch.Tensor] = None,
    base_output: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Segmented LoRA expand: ``out[t] = scalings[l] * x[t] @ weights[l]^T (+ base_output[t])``.

    Args:
        input_x: (T, max_rank). weights: (L, N, max_rank). scalings: (L,) float.
        base_output: optional (T, N), read only.
    Returns:
        A new (T, N) tensor in input_x's dtype.
    Source: sgl-kernel-xpu ``sgemm_lora_b_fwd`` (``src/sycl/SGEMMLoraBFwd.cpp``).
    """
    _check_expand_input(input_x, weights, 1, base_output)
    slots = _row_slots(seg_indptr, weight_indices, input_x.shape[0])
    return _expand(input_x, weights, slots, scalings, 1, base_output, bands=[(0, weights.shape[1])])


def qkv_lora_b_fwd(
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
) -> torch.Tensor:
    """Segmented expand for fused q/k/v: band p of the output uses column band p of input_x.

    Args:
        input_x: (T, 3 * max_rank). qkv_lora_b: (L, N_q + 2 * N_kv, max_rank).
        output_offset: (4,) int tensor ``[0, N_q, N_q + N_kv, N_q + 2 * N_kv]`` on the device; read
            on the device only. max_qkv_out_dim: the widest band (signature parity).
    Returns:
        A new (T, N_q + 2 * N_kv) tensor in input_x's dtype.
    Source: sgl-kernel-xpu ``qkv_lora_b_fwd`` (``src/sycl/QKVLoraBFwd.cpp``).
    """
    _check(output_offset.numel() == 4, f"output_offset must have 4 elements, got {output_offset.numel()}")
    _check_expand_input(input_x, qkv_lora_b, 3, base_output)
    slots = _row_slots(seg_indptr, weight_indices, input_x.shape[0])
    return _expand(input_x, qkv_lora_b, slots, scalings, 3, base_output, slice_offsets=output_offset)


def gate_up_lora_b_fwd(
    input_x: torch.Tensor,
    gate_up_lora_b: torch.Tensor,
    output_dim: int,
    seg_indptr: torch.Tensor,
    weight_indices: torch.Tensor,
    lora_ranks: torch.Tensor,
    scalings: torch.Tensor,
    seg_lens: Optional[torch.Tensor] = None,
    base_output: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Segmented expand for fused gate/up: two equal bands of width ``output_dim``.

    Args:
        input_x: (T, 2 * max_rank). gate_up_lora_b: (L, 2 * output_dim, max_rank).
    Returns:
        A new (T, 2 * output_dim) tensor in input_x's dtype.
    Source: sgl-kernel-xpu ``gate_up_lora_b_fwd`` (``src/sycl/GateUpLoraBFwd.cpp``).
    """
    _check(
        output_dim > 0 and gate_up_lora_b.shape[1] == 2 * output_dim,
        f"gate_up_lora_b.size(1)={gate_up_lora_b.shape[1]} must equal 2 * output_dim ({output_dim})",
    )
    _check_expand_input(input_x, gate_up_lora_b, 2, base_output)
    slots = _row_slots(seg_indptr, weight_indices, input_x.shape[0])
    bands = [(0, output_dim), (output_dim, 2 * output_dim)]
    return _expand(input_x, gate_up_lora_b, slots, scalings, 2, base_output, bands=bands)


def chunked_sgmv_lora_shrink_fwd(
    input_x: torch.Tensor,
    weights: torch.Tensor,
    stack_num: int,
    num_segments: int,
    seg_indptr: torch.Tensor,
    weight_indices: torch.Tensor,
    lora_ranks: torch.Tensor,
    permutation: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Chunked-SGMV shrink: like :func:`sgemm_lora_a_fwd`, with segments in permuted order.

    Args:
        input_x: (T, K), physical row order. permutation: optional (T,) logical-to-physical map
            (segments describe logical order); None means physical order.
        num_segments: ignored (the kernel uses ``seg_indptr.numel() - 1``).
    Returns:
        (T, stack_num * max_rank) in physical row order.
    Source: sgl-kernel-xpu ``chunked_sgmv_lora_shrink_fwd`` (``src/sycl/ChunkedSgmvLoraShrinkFwd.cpp``).
    """
    _check(stack_num > 0 and weights.shape[1] % stack_num == 0, "weights.size(1) must be a multiple of stack_num > 0")
    _check(input_x.shape[1] == weights.shape[2], f"input_x.size(1)={input_x.shape[1]} != weights.size(2)={weights.shape[2]}")
    slots = _row_slots(seg_indptr, weight_indices, input_x.shape[0], permutation)
    return _shrink(input_x, weights, slots)


def chunked_sgmv_lora_expand_fwd(
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
) -> torch.Tensor:
    """Chunked-SGMV expand over ``num_slices`` bands given by ``slice_offsets``.

    Args:
        input_x: (T, num_slices * max_rank), physical order. weights: (L, N_total, max_rank).
        slice_offsets: (num_slices + 1,) device int tensor, ``[0, ..., N_total]``; read on the
            device only. max_slice_size: widest band (signature parity).
        permutation: optional (T,) logical-to-physical map; None means physical order.
        base_output: optional (T, N_total), read only.
    Returns:
        A new (T, N_total) tensor in physical row order, input_x's dtype.
    Source: sgl-kernel-xpu ``chunked_sgmv_lora_expand_fwd`` (``src/sycl/ChunkedSgmvLoraExpandFwd.cpp``).
    """
    _check(
        slice_offsets.numel() == num_slices + 1,
        f"slice_offsets must have num_slices + 1 = {num_slices + 1} elements, got {slice_offsets.numel()}",
    )
    _check_expand_input(input_x, weights, num_slices, base_output)
    slots = _row_slots(seg_indptr, weight_indices, input_x.shape[0], permutation)
    return _expand(input_x, weights, slots, scalings, num_slices, base_output, slice_offsets=slice_offsets)
