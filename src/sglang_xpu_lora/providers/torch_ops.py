"""Portable PyTorch provider: the seven sgl-kernel-xpu LoRA ops on any device.

Same signatures and semantics as sgl-kernel-xpu ``python/sgl_kernel/lora.py`` (see
:mod:`sglang_xpu_lora.providers.base` for the shared contract). Two routing strategies, chosen by
the device of the tensors and, on CPU, the problem size (:func:`routes_on_host`); both give the
same numbers:

* **On the device** (any accelerator: XPU, CUDA...): no loop over segments or requests, no host
  synchronisation, no data-dependent shapes. Each token row is mapped to its pool slot on the
  device (``searchsorted`` over ``seg_indptr``, then a scatter through ``permutation``), so every op
  is a fixed sequence of kernels whose shapes depend only on tensor shapes and can be captured in a
  CUDA/XPU graph. **Shrink** (``x @ A^T``) multiplies every row by all ``max_loras`` slots in one
  GEMM and gathers the row's own slot: ``(T, K) @ (K, L*N)``. **Expand** (``@ B^T``) places each
  row's rank vector in its slot's block of a ``(T, L*R)`` matrix and runs one GEMM against all
  slots' B. Both spend ``L`` times the FLOPs of a grouped GEMM in exchange for one large GEMM and
  a handful of kernels (the same idea as SGLang's ``torch_native`` graph path, minus its per-slot
  loop and masked copies).
* **On the host** (CPU tensors, where reading an index tensor is a memory load, not a device
  synchronisation; tiny problems excepted, see :func:`routes_on_host`): segments are read with
  ``tolist()``, consecutive segments of one slot are merged into runs, and each run is one GEMM
  against its own slot only (a grouped GEMM, as the XPU kernels do). A permuted run's rows are gathered and its results scattered per run, so a
  decode batch of ``T`` requests over ``n`` adapters costs ``n`` GEMMs per slice, not ``T``
  (SGLang's ``torch_native`` issues one per segment), and the output is written once: on a CPU
  these ops are bound by memory traffic, not FLOPs.

Common semantics: like the XPU kernels, the GEMM ops contract over the full ``max_rank`` and ignore
``lora_ranks``; rows that belong to no segment get no LoRA contribution; ``scalings`` is applied in
fp32 after the expand GEMM, then ``base_output`` is added and the sum cast to ``input_x.dtype``.

Raises ``ValueError`` for shape mismatches that can be checked without reading index tensors.
Index contents (slot ids, offsets) are trusted, as in a kernel.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Callable, Optional, Sequence

import torch

name = "torch"


#: On CPU, problems at most this small take the device routing (see :func:`routes_on_host`).
SMALL_PROBLEM_WEIGHTS = 1 << 18  #: elements of all slots' weights
SMALL_PROBLEM_MACS = 1 << 22  #: multiply-adds of the device routing's all-slots GEMM


def routes_on_host(x: torch.Tensor, weights: torch.Tensor, count_runs: Callable[[], int]) -> bool:
    """Whether an op on ``x`` (T, ...) and ``weights`` (L, ...) routes on the host (else on the device).

    False on any device but CPU: the ops route on the device, sync-free and graph-capturable. True
    for CPU tensors, since reading index tensors in host memory is no synchronisation, unless the
    problem is small (``weights.numel() <= SMALL_PROBLEM_WEIGHTS`` and ``T * weights.numel() <=
    SMALL_PROBLEM_MACS``) and its batch has several runs of one adapter (``count_runs()``, read on
    the host only then): the device routing's fixed few kernels then cost less than a GEMM call per
    run (tiny models, where per-call overhead dominates).
    """
    if x.device.type != "cpu":
        return False
    size = weights.numel()
    return size > SMALL_PROBLEM_WEIGHTS or size * x.shape[0] > SMALL_PROBLEM_MACS or count_runs() <= 1


# --- LoRA-B mirrors for the device path ---------------------------------------------------

_mirrors: Optional[dict] = None  #: buffer key -> (weakref to buffer, (L, R, N) mirror); None when off


def keep_weight_mirrors() -> None:
    """Keep a transposed ``(L, R, N)`` mirror of each LoRA-B buffer the device-routed expand reads.

    The expand GEMM needs every slot's B as one ``(L*R, N)`` matrix; SGLang's pool stores B as
    ``(L, N, R)``, so without a mirror every expand makes a transposed copy of B (the largest cost
    of a decode step at small batch sizes on a GPU). Mirrors are made on first use outside graph
    capture and must be refreshed, in place, whenever a slot of a buffer is written:
    :func:`refresh_weight_mirrors`, which the plugin's memory-pool patch calls after every adapter
    load. Turned on by that patch for pools of backends that use these ops; never on for direct use
    of the ops, since a caller writing B in place would leave a mirror stale. Costs the memory of
    the mirrored B buffers (only buffers the device routing reads; the host routing needs none).
    """
    global _mirrors
    if _mirrors is None:
        _mirrors = {}


@torch.no_grad()
def refresh_weight_mirrors(slot: int) -> None:
    """Copy slot ``slot`` of every mirrored LoRA-B buffer into its mirror, in place (graphs
    captured with a mirror keep reading the same memory). Buffers of other pools get an idempotent
    copy, buffers with fewer slots are skipped, and mirrors of freed buffers are dropped."""
    for key, (buffer_ref, mirror) in list((_mirrors or {}).items()):
        weights = buffer_ref()
        if weights is None:
            del _mirrors[key]
        elif slot < weights.shape[0]:
            mirror[slot].copy_(weights[slot].t())


# --- routing on the device: sync-free, capturable -------------------------------------------


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


class _DeviceRoutes:
    """A batch's routing on the device: each row's slot, and what the GEMMs derive from it.

    ``slots``: (T,) int64, -1 outside all segments. :meth:`one_hot` and :meth:`row_scale` are
    computed on first use and kept, so a cached instance serves every layer of a batch.
    """

    def __init__(self, slots: torch.Tensor, num_slots: int):
        self.slots, self.num_slots = slots, num_slots
        self.slot_index = slots.clamp(min=0)  #: (T,) int64, 0 outside segments
        self.outside = (slots < 0).unsqueeze(1)  #: (T, 1) bool
        self._one_hot: dict = {}
        self._row_scale: dict = {}

    def one_hot(self, dtype: torch.dtype) -> torch.Tensor:
        """(T, L) in ``dtype``: 1 at the row's slot, all zero outside segments."""
        if dtype not in self._one_hot:
            slot_ids = torch.arange(self.num_slots, device=self.slots.device)
            self._one_hot[dtype] = (self.slots.unsqueeze(1) == slot_ids).to(dtype)
        return self._one_hot[dtype]

    def row_scale(self, scalings: torch.Tensor) -> torch.Tensor:
        """(T, 1) fp32: ``scalings[slot]`` per row, 0 outside segments."""
        key = id(scalings)
        if key not in self._row_scale:
            scale = scalings.to(torch.float32)[self.slot_index].unsqueeze(1).masked_fill(self.outside, 0)
            self._row_scale[key] = (scalings, scale)  # keeps ``scalings`` alive
        return self._row_scale[key][1]


def _stacked_weights(weights: torch.Tensor) -> torch.Tensor:
    """LoRA-B ``(L, N, R)`` as ``(L*R, N)`` (row ``l*R + r`` holds ``B[l, :, r]``) for the expand GEMM:
    the buffer's mirror when :func:`keep_weight_mirrors` is on, else a transposed copy."""
    num_slots, out_dim, max_rank = weights.shape
    if _mirrors is None:
        return weights.transpose(1, 2).reshape(num_slots * max_rank, out_dim)
    key = (weights.data_ptr(), tuple(weights.shape), tuple(weights.stride()), weights.dtype, weights.device)
    entry = _mirrors.get(key)
    if entry is None or entry[0]() is not weights:
        if _capturing(weights.device):  # a mirror made here would be refilled by every replay
            return weights.transpose(1, 2).reshape(num_slots * max_rank, out_dim)
        entry = _mirrors[key] = (weakref.ref(weights), weights.transpose(1, 2).contiguous())
    return entry[1].view(num_slots * max_rank, out_dim)


def _shrink_on_device(x: torch.Tensor, weights: torch.Tensor, routes: _DeviceRoutes) -> torch.Tensor:
    """``out[t] = x[t] @ weights[slot[t]]^T``, zero outside segments; (T, N) in x's dtype.

    Every slot's product in one GEMM ``(T, K) @ (K, L*N)``, then each row gathers its own slot's
    block (a gather, not a product with the one-hot row: another slot's overflow must not reach it).
    """
    num_rows, hidden = x.shape
    num_slots, out_dim, _ = weights.shape
    every_slot = torch.mm(x, weights.reshape(num_slots * out_dim, hidden).t()).view(num_rows, num_slots, out_dim)
    own = every_slot.gather(1, routes.slot_index.view(num_rows, 1, 1).expand(num_rows, 1, out_dim))
    return own.view(num_rows, out_dim).masked_fill(routes.outside, 0)


def _expand_on_device(
    x: torch.Tensor,
    weights: torch.Tensor,
    routes: _DeviceRoutes,
    scalings: torch.Tensor,
    num_slices: int,
    base_output: Optional[torch.Tensor],
    *,
    bands: Optional[Sequence[tuple[int, int]]] = None,
    slice_offsets: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``out[t, band_p] = scalings[l] * x[t, p*R:(p+1)*R] @ weights[l, band_p]^T (+ base)``.

    ``l`` is the row's slot. Each row's rank vectors are spread into their slot's block
    (``(T, S, L, R)``, zero elsewhere), so one GEMM against all slots' B serves all rows. Bands come
    from host ``bands`` when known statically (one GEMM per band, into its columns), else from the
    device tensor ``slice_offsets`` (``(S + 1,)``), without reading it on the host: either one
    GEMM gives every slice's product over all columns and each column keeps its own slice's (when
    ``T < L*R``), or B is masked to each slice's columns (a block-diagonal ``(S*L*R, N)`` matrix)
    for one GEMM. B is read as ``(L*R, N)`` (see :func:`keep_weight_mirrors`).
    """
    num_rows = x.shape[0]
    num_slots, out_dim, max_rank = weights.shape
    one_hot = routes.one_hot(x.dtype).view(num_rows, 1, num_slots, 1)
    spread = one_hot * x.reshape(num_rows, num_slices, 1, max_rank)  # (T, S, L, R), contiguous
    stacked = _stacked_weights(weights)  # (L*R, N): row l*R + r holds B[l, :, r]
    if bands is None:
        column_slice = torch.searchsorted(
            slice_offsets[1:].contiguous().to(torch.int64), torch.arange(out_dim, device=x.device), right=True
        )
        mask = column_slice == torch.arange(num_slices, device=x.device).unsqueeze(1)  # (S, N)
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        width = num_slots * max_rank
        if num_rows < width:  # select from the (S, T, N) products: smaller than masking B
            per_slice = spread.transpose(0, 1).reshape(num_slices * num_rows, width)
            products = torch.mm(per_slice, stacked).view(num_slices, num_rows, out_dim)
            out = torch.where(mask.unsqueeze(1), products, zero).sum(0, dtype=x.dtype)
        else:  # mask B per slice into one block-diagonal (S*L*R, N) matrix
            blocks = torch.where(mask.unsqueeze(1), stacked.unsqueeze(0), zero)
            out = torch.mm(spread.reshape(num_rows, num_slices * width), blocks.reshape(num_slices * width, out_dim))
    else:
        out = x.new_empty((num_rows, out_dim)) if _tile(bands, out_dim) else x.new_zeros((num_rows, out_dim))
        for p, (start, end) in enumerate(bands):  # static: the number of stacked projections
            torch.mm(spread[:, p].reshape(num_rows, num_slots * max_rank), stacked[:, start:end], out=out[:, start:end])
    scale = routes.row_scale(scalings)
    if base_output is None:
        return torch.mul(out, scale).to(x.dtype)
    return torch.addcmul(base_output.to(torch.float32), out, scale).to(x.dtype)


# --- routing on the host: grouped GEMMs over runs of one slot -------------------------------


@dataclasses.dataclass(frozen=True)
class _Runs:
    """A batch as runs of rows that share a slot, read on the host: ``((rows, slot), ...)``.

    ``rows`` is a ``slice`` of physical rows when the run is contiguous (no permutation, or an
    identity one), else the run's physical row indices ((n,) int64, from the permutation).
    """

    runs: tuple
    num_covered: int  #: rows in some run

    def covers(self, num_rows: int) -> bool:
        """Whether every one of ``num_rows`` rows is in a run."""
        return self.num_covered == num_rows


def _host_runs(seg_indptr, weight_indices, num_rows: int, permutation=None) -> _Runs:
    """Runs of a batch (see :func:`_row_slots` for the segment and permutation semantics):
    consecutive segments of one slot merge into one run; empty segments are dropped."""
    bounds = [min(max(b, 0), num_rows) for b in seg_indptr.tolist()]
    slots = weight_indices.tolist()
    runs: list = []
    for s in range(len(bounds) - 1):
        start, end, slot = bounds[s], bounds[s + 1], int(slots[s])
        if end <= start:
            continue
        if runs and runs[-1][2] == slot and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], end, slot)
        else:
            runs.append((start, end, slot))
    covered = runs[-1][1] - runs[0][0] if runs else 0
    if permutation is not None and runs:
        low, high = runs[0][0], runs[-1][1]
        order = permutation[low:high].to(torch.int64)
        if not torch.equal(order, torch.arange(low, high)):
            return _Runs(tuple((order[start - low : end - low], slot) for start, end, slot in runs), covered)
    return _Runs(tuple((slice(start, end), slot) for start, end, slot in runs), covered)


def _take(tensor: torch.Tensor, rows) -> torch.Tensor:
    """Rows of ``tensor``: a view for a slice, a gathered copy for an index tensor."""
    return tensor[rows] if isinstance(rows, slice) else tensor.index_select(0, rows)


def _put(out: torch.Tensor, rows, values: torch.Tensor) -> None:
    """``out[rows] = values`` (cast to out's dtype)."""
    if isinstance(rows, slice):
        out[rows].copy_(values)
    else:
        out.index_copy_(0, rows, values.to(out.dtype))


def _tile(bands: Sequence[tuple[int, int]], width: int) -> bool:
    """Whether ``bands`` are consecutive and cover ``[0, width)``."""
    edges = [edge for band in bands for edge in band]
    return edges[0] == 0 and edges[-1] == width and all(a == b for a, b in zip(edges[1:-1:2], edges[2::2]))


def _shrink_on_host(x: torch.Tensor, weights: torch.Tensor, batch: _Runs) -> torch.Tensor:
    """Host-routed :func:`_shrink_on_device`: one GEMM per run, written to its rows."""
    shape = (x.shape[0], weights.shape[1])
    out = x.new_empty(shape) if batch.covers(x.shape[0]) else x.new_zeros(shape)
    for rows, slot in batch.runs:
        if isinstance(rows, slice):
            torch.mm(x[rows], weights[slot].t(), out=out[rows])
        else:
            out.index_copy_(0, rows, torch.mm(x.index_select(0, rows), weights[slot].t()))
    return out


def _expand_on_host(
    x: torch.Tensor,
    weights: torch.Tensor,
    batch: _Runs,
    scalings: torch.Tensor,
    bands: Sequence[tuple[int, int]],
    base_output: Optional[torch.Tensor],
) -> torch.Tensor:
    """Host-routed :func:`_expand_on_device`: one GEMM per run and slice, in fp32.

    The output is written once: each run's rows are computed in an fp32 buffer (in fp32, the
    output rows themselves when contiguous, with the scaling as the GEMM's ``alpha`` and
    ``base_output`` as its ``beta = 1`` input) and stored once. A permuted run's rows are gathered
    and scattered per run, so its buffer stays small.

    Raises:
        ValueError: if the slice bands do not tile ``[0, N)`` (read from ``slice_offsets``).
    """
    num_rows, out_dim, max_rank = x.shape[0], weights.shape[1], weights.shape[2]
    _check(_tile(bands, out_dim), f"slice offsets {bands} must tile the {out_dim} output columns from 0")
    scale = scalings.tolist()
    if batch.covers(num_rows):
        result = x.new_empty((num_rows, out_dim))
    elif base_output is not None:
        result = base_output.to(x.dtype, copy=True)
    else:
        result = x.new_zeros((num_rows, out_dim))
    fp32 = x.dtype == torch.float32
    for rows, slot in batch.runs:
        x_run = _take(x, rows)
        base_run = None if base_output is None else _take(base_output, rows).to(torch.float32)
        in_place = fp32 and isinstance(rows, slice)
        acc = result[rows] if in_place else torch.empty((x_run.shape[0], out_dim), dtype=torch.float32)
        for p, (low, high) in enumerate(bands):
            x_p, b_t, acc_p = x_run[:, p * max_rank : (p + 1) * max_rank], weights[slot, low:high].t(), acc[:, low:high]
            if fp32 and base_run is None:
                acc_p.addmm_(x_p, b_t, beta=0, alpha=scale[slot])
            elif fp32:
                torch.addmm(base_run[:, low:high], x_p, b_t, alpha=scale[slot], out=acc_p)
            elif base_run is None:  # round the GEMM to x's dtype, as the device path does
                torch.mul(torch.mm(x_p, b_t).to(torch.float32), scale[slot], out=acc_p)
            else:
                torch.add(base_run[:, low:high], torch.mm(x_p, b_t).to(torch.float32), alpha=scale[slot], out=acc_p)
        if not in_place:
            _put(result, rows, acc)
    return result


# --- dispatch and the per-batch routing cache ---------------------------------------------

_batch_routes: Optional[dict] = None  #: routing of the current batch, see begin_batch()
_MAX_CACHED_ROUTES = 64


def begin_batch() -> None:
    """Start a new batch: forget the routing cached for the previous one.

    SGLang's LoRA layers call the ops with the same index tensors (``seg_indptr``,
    ``weight_indices``, ``permutation``) in every layer of a forward pass. After this call the
    ops compute each distinct routing once and reuse it until the next call, instead of once per
    op (eight times per decoder layer). ``IntelXpuLoRABackend`` calls it whenever it prepares a
    batch, before the index tensors are refilled; routing computed while a CUDA/XPU graph is being
    captured is kept apart from eager routing, so a captured graph recomputes it on every replay.
    Before the first call (direct use of the ops) every op computes its own routing.
    """
    global _batch_routes
    _batch_routes = {}


def _capturing(device: torch.device) -> bool:
    backend = getattr(torch, device.type, None)
    is_capturing = getattr(backend, "is_current_stream_capturing", None)
    return bool(is_capturing()) if is_capturing is not None else False


def _identity(tensor: Optional[torch.Tensor]):
    """Identity of an index tensor for the cache: the object, or for a view its base and window."""
    if tensor is None:
        return None
    if tensor._base is not None:
        return (id(tensor._base), tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))
    return id(tensor)


def _routes(x, weights, seg_indptr, weight_indices, permutation):
    """``_Runs`` (host routing) or ``_DeviceRoutes`` for an op's batch."""
    num_rows, num_slots = x.shape[0], weights.shape[0]
    key = (seg_indptr, weight_indices, permutation, num_rows, num_slots)

    def host_runs() -> _Runs:
        return _cached("host", *key, lambda: _host_runs(seg_indptr, weight_indices, num_rows, permutation))

    if routes_on_host(x, weights, lambda: len(host_runs().runs)):
        return host_runs()
    return _cached("device", *key,
                   lambda: _DeviceRoutes(_row_slots(seg_indptr, weight_indices, num_rows, permutation), num_slots))


def _cached(kind, seg_indptr, weight_indices, permutation, num_rows, num_slots, build):
    """``build()``, through the batch cache when it is on (see :func:`begin_batch`)."""
    if _batch_routes is None:
        return build()
    key = (kind, id(seg_indptr), id(weight_indices), _identity(permutation), num_rows, num_slots,
           _capturing(seg_indptr.device))
    cached = _batch_routes.get(key)
    if cached is None:
        if len(_batch_routes) >= _MAX_CACHED_ROUTES:
            _batch_routes.clear()
        cached = _batch_routes[key] = (build(), (seg_indptr, weight_indices, permutation))  # keeps ids valid
    return cached[0]


def _shrink(x, weights, seg_indptr, weight_indices, permutation=None) -> torch.Tensor:
    routes = _routes(x, weights, seg_indptr, weight_indices, permutation)
    if isinstance(routes, _Runs):
        return _shrink_on_host(x, weights, routes)
    return _shrink_on_device(x, weights, routes)


def _expand(
    x, weights, seg_indptr, weight_indices, permutation, scalings, num_slices, base_output, *, bands=None, slice_offsets=None
) -> torch.Tensor:
    routes = _routes(x, weights, seg_indptr, weight_indices, permutation)
    if isinstance(routes, _Runs):
        if bands is None:
            edges = slice_offsets.tolist()
            bands = list(zip(edges[:-1], edges[1:]))
        return _expand_on_host(x, weights, routes, scalings, bands, base_output)
    return _expand_on_device(
        x, weights, routes, scalings, num_slices, base_output, bands=bands, slice_offsets=slice_offsets
    )


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
    return _shrink(input_x, weights, seg_indptr, weight_indices)


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
    return _expand(
        input_x, weights, seg_indptr, weight_indices, None, scalings, 1, base_output, bands=[(0, weights.shape[1])]
    )


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
    return _expand(
        input_x, qkv_lora_b, seg_indptr, weight_indices, None, scalings, 3, base_output, slice_offsets=output_offset
    )


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
    bands = [(0, output_dim), (output_dim, 2 * output_dim)]
    return _expand(input_x, gate_up_lora_b, seg_indptr, weight_indices, None, scalings, 2, base_output, bands=bands)


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
    return _shrink(input_x, weights, seg_indptr, weight_indices, permutation)


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
    return _expand(
        input_x, weights, seg_indptr, weight_indices, permutation, scalings, num_slices, base_output,
        slice_offsets=slice_offsets,
    )
