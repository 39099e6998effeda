"""Routing on the device: sync-free and graph-capturable, for accelerators and CPU problems where it costs less.

No loop over segments or requests, no host synchronisation, no data-dependent shapes. Each token
row is mapped to its pool slot on the device (:func:`row_slots`: ``searchsorted`` over
``seg_indptr``, then a scatter through ``permutation``), so every op is a fixed sequence of kernels
whose shapes depend only on tensor shapes and can be captured in a CUDA/XPU graph.

Each GEMM takes one of two forms, chosen per op from host-known shapes only (rows ``T``, slots
``L``, the weights' ``(N, D)``, the slices; :func:`gathers_rows`), never from index contents:

* **every slot**: one GEMM of every row with every slot's weights, then each row **gathers** its
  own slot's product (shrink: ``(T, K) @ (K, L*N)``; expand: ``(T, R) @ (R, N)`` per slot). It reads
  each slot's weights once, so it suits batches with many rows per slot, but its FLOPs and its
  ``(T, L, N)`` products grow with ``L`` (``--max-loras-per-batch``) whatever the batch uses;
* **gathered rows**: each row's own slot weights are gathered (``weights[slot[t]]``, ``(T, N, D)``)
  and one batched GEMM multiplies each row with them. Its cost is ``T`` rows' weights, whatever
  ``L``: a small decode batch costs the same at 8 slots and at 256.

Either way a row's result comes from its own slot's weights only, never a sum over slots: whatever
another slot holds (NaN, Inf, a previous tenant's weights), no other row reads it, and rows outside
every segment are set to zero (or ``base_output``) by selection, not by multiplying with zero. Both
forms read LoRA-B in the pool's own ``(L, N, R)`` layout (no transposed copy) and run in row chunks
whose intermediates stay within :data:`MAX_PRODUCT_ELEMENTS`. The same selection makes a slot that
the loader stream is rewriting (``--enable-lora-overlap-loading``: SGLang never loads into a slot a
running batch uses) harmless to the batches in flight: their rows never keep its products.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def row_slots(
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
    if num_segments <= 0:
        return torch.full((num_rows,), -1, dtype=torch.int64, device=device)
    positions = torch.arange(num_rows, device=device, dtype=seg_indptr.dtype)
    # Last segment whose start is <= position; empty segments are skipped by right=True.
    segment = torch.searchsorted(seg_indptr.contiguous(), positions, right=True) - 1
    inside = (positions >= seg_indptr[0]) & (positions < seg_indptr[-1])
    slot = weight_indices[:num_segments].to(torch.int64)[segment.clamp(0, num_segments - 1)]
    logical = torch.where(inside, slot, -1)
    if permutation is None:
        return logical
    # Scatter through the permutation; stale entries (logical -1) are sent to row 0 and lose
    # against any real slot under amax, so they can neither clear nor overwrite a live row.
    targets = torch.where(inside, permutation[:num_rows].to(torch.int64), 0)
    physical = torch.full((num_rows,), -1, dtype=torch.int64, device=device)
    return physical.scatter_reduce(0, targets, logical, reduce="amax")


#: Both GEMM forms handle their rows in chunks whose intermediates (all-slot products, or gathered
#: weights) stay within this many elements (64M: 128 MiB in bf16), so a long prefill does not
#: allocate ``T * L * N`` at once. Decode batches up to a few hundred tokens are one chunk. Chunks are
#: fixed by shapes: graph-capturable.
MAX_PRODUCT_ELEMENTS = 1 << 26

#: Elements the gathered form moves per gathered weight: the gather reads and writes it, the batched
#: GEMM reads it again.
GATHER_PASSES = 3


#: On CPU, what the device routing's forms cost, in elements gathered (about 0.5 ns each on the
#: 2-core CI machine, fp32, 2026-12-04): the gathered form's fixed cost (its few small kernels) ...
CPU_GATHER_FIXED = 100_000
#: ... and how many of the every-slot GEMM's multiply-adds cost as much as one gathered element.
CPU_MACS_PER_ELEMENT = 16


def cpu_form_costs(rows: int, slots: int, out_dim: int, depth: int) -> tuple[int, int]:
    """``(every slot, gathered rows)``: what each form of a GEMM of ``rows`` rows with their slots'
    ``(out_dim, depth)`` weights costs on CPU, in gathered elements (:data:`CPU_GATHER_FIXED`,
    :data:`CPU_MACS_PER_ELEMENT`). On CPU the every-slot GEMM's ``rows * slots * out_dim * depth``
    multiply-adds dominate it; the gathered form moves ``rows * out_dim * depth`` elements after a
    fixed cost. Measured with a shrink of the tiny Llama's shapes (``(24, 128)``, 8-2048 rows, 8
    and 64 slots): at 64 rows over 64 slots the every-slot form took 399 µs, the gathered 137 µs;
    at 64 rows over 8 slots 65 and 134 µs."""
    per_row = out_dim * depth
    return rows * slots * per_row // CPU_MACS_PER_ELEMENT, CPU_GATHER_FIXED + rows * per_row


def gathers_rows(rows: int, slots: int, out_dim: int, depth: int, products: int = 1, *, on_cpu: bool = False) -> bool:
    """Whether a GEMM of ``rows`` rows with their slots' ``(out_dim, depth)`` weights gathers each
    row's own weights (else every slot's product is computed and each row keeps its own).

    From host-known shapes only (graph-capturable, no device read). On an accelerator, the elements
    each form moves. Every slot: each slot's weights once (``slots * out_dim * depth``), and ``rows
    * slots * out_dim * products`` products written and read back (``products``: the slices each
    row's input is multiplied as, when the column bands are known only on the device). Gathered
    rows: :data:`GATHER_PASSES` passes over ``rows * out_dim * depth`` gathered weights and its own
    ``rows * out_dim * products`` products, whatever ``slots``. The FLOPs are ``slots`` times
    fewer too. Decode batches with fewer rows than about a third of the slots gather. On CPU
    (``on_cpu``), where the every-slot GEMM's multiply-adds dominate: :func:`cpu_form_costs`.
    """
    if on_cpu:
        every_slot, gathered = cpu_form_costs(rows, slots, out_dim, depth)
        return gathered < every_slot
    every_slot = slots * out_dim * depth + 2 * rows * slots * out_dim * products
    gathered = GATHER_PASSES * rows * out_dim * depth + 2 * rows * out_dim * products
    return gathered < every_slot


def _in_row_chunks(num_rows: int, per_row: int, compute, like: torch.Tensor, width: int) -> torch.Tensor:
    """``compute(rows)`` (a slice of rows -> (C, width)) over ``num_rows`` rows in chunks of at most
    :data:`MAX_PRODUCT_ELEMENTS` ``// per_row`` rows (static: shapes only); one chunk is returned as
    is, several are written into a new (T, width) tensor of ``like``'s dtype."""
    chunk = max(1, MAX_PRODUCT_ELEMENTS // max(1, per_row))
    if num_rows <= chunk:
        return compute(slice(0, num_rows))
    out = like.new_empty((num_rows, width))
    for start in range(0, num_rows, chunk):
        rows = slice(start, min(start + chunk, num_rows))
        out[rows] = compute(rows)
    return out


class DeviceRoutes:
    """A batch's routing on the device: each row's slot, and what the GEMMs derive from it.

    ``slots``: (T,) int64, -1 outside all segments (:func:`row_slots`). :meth:`row_scale` is
    computed on first use and kept, so a cached instance serves every layer of a batch.
    """

    def __init__(self, slots: torch.Tensor):
        self.slot_index = slots.clamp(min=0)  #: (T,) int64, 0 outside segments
        self.outside = (slots < 0).unsqueeze(1)  #: (T, 1) bool
        self._row_scale: dict = {}

    def row_scale(self, scalings: torch.Tensor) -> torch.Tensor:
        """(T, 1) fp32: ``scalings[slot]`` per row, 0 outside segments."""
        key = id(scalings)
        if key not in self._row_scale:
            scale = scalings.to(torch.float32)[self.slot_index].unsqueeze(1).masked_fill(self.outside, 0)
            self._row_scale[key] = (scalings, scale)  # keeps ``scalings`` alive, so its id stays valid
        return self._row_scale[key][1]

    def own(self, every_slot: torch.Tensor) -> torch.Tensor:
        """Each row's own slot from ``every_slot`` (T, L, N): (T, N), zero outside segments."""
        return _gather_own(every_slot, self.slot_index, self.outside)


def _gather_own(every_slot: torch.Tensor, slot_index: torch.Tensor, outside: torch.Tensor) -> torch.Tensor:
    """``every_slot[t, slot_index[t]]`` for each row t of (T, L, N): (T, N), zero where ``outside``.

    A selection, not a product with a one-hot row: no other slot's value (NaN, Inf) reaches the row.
    """
    num_rows, _, width = every_slot.shape
    own = every_slot.gather(1, slot_index.view(num_rows, 1, 1).expand(num_rows, 1, width))
    return own.view(num_rows, width).masked_fill(outside, 0)


def shrink(x: torch.Tensor, weights: torch.Tensor, routes: DeviceRoutes) -> torch.Tensor:
    """``out[t] = x[t] @ weights[slot[t]]^T``, zero outside segments; (T, N) in x's dtype.

    x: (T, K); weights: (L, N, K). Every slot: one GEMM ``(T, K) @ (K, L*N)``, then each row gathers
    its slot. Gathered rows (:func:`gathers_rows`): ``weights[slot[t]]`` per row, one batched GEMM.
    """
    num_rows, hidden = x.shape
    num_slots, out_dim, _ = weights.shape
    if gathers_rows(num_rows, num_slots, out_dim, hidden, on_cpu=x.device.type == "cpu"):

        def compute(rows):
            own = weights.index_select(0, routes.slot_index[rows])  # (C, N, K): each row's own slot
            product = torch.bmm(own, x[rows].unsqueeze(2)).view(own.shape[0], out_dim)
            return product.masked_fill(routes.outside[rows], 0)

        return _in_row_chunks(num_rows, out_dim * hidden, compute, x, out_dim)
    flat = weights.reshape(num_slots * out_dim, hidden).t()

    def every_slot(rows):
        products = torch.mm(x[rows], flat)
        return _gather_own(products.view(-1, num_slots, out_dim), routes.slot_index[rows], routes.outside[rows])

    return _in_row_chunks(num_rows, num_slots * out_dim, every_slot, x, out_dim)


def expand(
    x: torch.Tensor,
    weights: torch.Tensor,
    routes: DeviceRoutes,
    scalings: torch.Tensor,
    num_slices: int,
    base_output: Optional[torch.Tensor],
    *,
    bands: Optional[Sequence[tuple[int, int]]] = None,
    slice_offsets: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``out[t, band_p] = scalings[l] * x[t, p*R:(p+1)*R] @ weights[l, band_p]^T (+ base)``.

    ``l`` is the row's slot; x: (T, S * R); weights: (L, N, R); scalings: (L,); base_output:
    optional (T, N). Returns (T, N) in x's dtype: the GEMM is rounded to x's dtype, scaled and added
    to ``base_output`` in fp32, into ``base_output`` itself (returned) when it has x's dtype. Bands
    come from host ``bands`` when known statically (consecutive, tiling ``[0, N)``), else from the
    device tensor ``slice_offsets`` (``(S + 1,)``), without reading it on the host (see
    :func:`_own_products`). Every slot (:func:`_own_products`) or gathered rows
    (:func:`_gathered_products`), by :func:`gathers_rows`; rows go in chunks of at most
    :data:`MAX_PRODUCT_ELEMENTS` elements of intermediates.
    """
    num_rows = x.shape[0]
    num_slots, out_dim, _ = weights.shape
    column_slice = None
    if bands is None:  # (N,): the slice of each output column; num_slices past the last offset
        column_slice = torch.searchsorted(
            slice_offsets[1:].contiguous().to(torch.int64), torch.arange(out_dim, device=x.device), right=True
        )
    products = num_slices if bands is None else 1
    if gathers_rows(num_rows, num_slots, out_dim, weights.shape[2], products, on_cpu=x.device.type == "cpu"):
        form, per_row = _gathered_products, out_dim * (weights.shape[2] + products)
    else:
        form, per_row = _own_products, num_slots * out_dim * products
    out = _in_row_chunks(
        num_rows, per_row,
        lambda rows: form(x[rows], weights, routes.slot_index[rows], routes.outside[rows], num_slices, bands, column_slice),
        x, out_dim,
    )
    scale = routes.row_scale(scalings)
    if base_output is None:
        return torch.mul(out, scale).to(x.dtype)
    if base_output.dtype != x.dtype:
        return torch.addcmul(base_output.to(torch.float32), out, scale).to(x.dtype)
    if base_output.dtype == torch.float32:
        return base_output.addcmul_(out, scale)
    return base_output.copy_(torch.addcmul(base_output.to(torch.float32), out, scale))


def _own_products(x, weights, slot_index, outside, num_slices, bands, column_slice) -> torch.Tensor:
    """(C, N) in x's dtype: each row's expand GEMM with its own slot, zero outside segments.

    With host ``bands``: per band, one batched GEMM of the row's slice with every slot,
    ``(L, C, band)``, then the row's slot. Else one GEMM gives every slice's product with every
    slot over all columns, ``(C, S, L, N)``, and each element gathers its row's slot and its
    column's slice (``column_slice``, (N,)); columns past the last offset get zero.
    """
    num_rows = x.shape[0]
    num_slots, out_dim, max_rank = weights.shape
    if bands is None:
        every = torch.mm(x.reshape(num_rows * num_slices, max_rank), weights.reshape(num_slots * out_dim, max_rank).t())
        which = column_slice.clamp(max=num_slices - 1) * num_slots + slot_index.unsqueeze(1)  # (C, N) into S*L
        own = every.view(num_rows, num_slices * num_slots, out_dim).gather(1, which.unsqueeze(1)).squeeze(1)
        return own.masked_fill(outside | (column_slice == num_slices), 0)
    x_slices = x.reshape(num_rows, num_slices, max_rank)
    parts = [  # static: one per stacked projection
        _gather_own(torch.matmul(x_slices[:, p], weights[:, start:end].transpose(1, 2)).transpose(0, 1), slot_index, outside)
        for p, (start, end) in enumerate(bands)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _gathered_products(x, weights, slot_index, outside, num_slices, bands, column_slice) -> torch.Tensor:
    """:func:`_own_products` from each row's own slot weights, gathered: ``weights[slot[t]]``
    (C, N, R), then per band one batched GEMM of the row's slice with them. Without host bands,
    one batched GEMM gives every slice's product over all columns, ``(C, N, S)``, and each column
    takes its slice's; columns past the last offset get zero. No other slot is read."""
    num_rows = x.shape[0]
    _, out_dim, max_rank = weights.shape
    own = weights.index_select(0, slot_index)  # (C, N, R)
    x_slices = x.reshape(num_rows, num_slices, max_rank)
    if bands is None:
        every_slice = torch.bmm(own, x_slices.transpose(1, 2))  # (C, N, S)
        which = column_slice.clamp(max=num_slices - 1).view(1, out_dim, 1).expand(num_rows, out_dim, 1)
        mine = every_slice.gather(2, which).view(num_rows, out_dim)
        return mine.masked_fill(outside | (column_slice == num_slices), 0)
    parts = [  # static: one per stacked projection
        torch.bmm(own[:, start:end], x_slices[:, p].unsqueeze(2)).view(num_rows, end - start)
        for p, (start, end) in enumerate(bands)
    ]
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)).masked_fill(outside, 0)
