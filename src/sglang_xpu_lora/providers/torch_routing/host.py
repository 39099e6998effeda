"""Routing on the host: grouped GEMMs over runs of one slot, for CPU tensors.

On a CPU, reading an index tensor is a memory load, not a device synchronisation. Segments are
read with ``tolist()``, consecutive segments of one slot are merged into runs, and each run is one
GEMM against its own slot only (a grouped GEMM, as the XPU kernels do). A permuted run's rows are
gathered and its results scattered per run, so a decode batch of ``T`` requests over ``n`` adapters
costs ``n`` GEMMs per slice, not ``T`` (SGLang's ``torch_native`` issues one per segment), and the
output is written once: on a CPU these ops are bound by memory traffic, not FLOPs.

Runs also carry their slot's rank, read from ``lora_ranks`` on the host, and the GEMMs contract
over it rather than over the pool's ``max_rank``: the rank tail is zero (the pool's contract), so
the result is the same and an adapter below ``--max-lora-rank`` costs its own rank, as in SGLang's
``torch_native`` backend. A run of a rank-0 slot (the base model's) does no GEMM.
Rows outside every run get zero (or ``base_output``); a slot's weights are read by its runs only.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import torch

Rows = Union[slice, torch.Tensor]  #: a run's physical rows: a slice, or (n,) int64 indices


@dataclasses.dataclass(frozen=True)
class HostRoutes:
    """A batch's routing read on the host: its runs of rows that share a slot, ``runs`` =
    ``((rows, slot, rank), ...)``.

    ``rows`` is a ``slice`` of physical rows when the run is contiguous (no permutation, or an
    identity one), else the run's physical row indices ((n,) int64, from the permutation);
    ``rank`` is the slot's ``lora_ranks`` entry clamped to ``[0, max_rank]``.
    """

    runs: tuple
    num_covered: int  #: rows in some run

    def covers(self, num_rows: int) -> bool:
        """Whether every one of ``num_rows`` rows is in a run."""
        return self.num_covered == num_rows


def read_runs(seg_indptr, weight_indices, lora_ranks, num_rows: int, max_rank: int, permutation=None) -> HostRoutes:
    """The runs of a batch, read on the host (see :func:`.device.row_slots` for the segment and
    permutation semantics): consecutive segments of one slot merge into one run; empty segments
    are dropped before any Python sees them, so the Python work is per non-empty segment: SGLang's
    decode batches route per slot (one segment per slot of ``--max-loras-per-batch``, most of them
    empty), and a slot no request names costs nothing here."""
    bounds = seg_indptr.clamp(0, num_rows)
    segments = torch.nonzero(bounds[1:] > bounds[:-1]).flatten()
    starts, ends = bounds[:-1][segments].tolist(), bounds[1:][segments].tolist()
    slots = weight_indices[segments].tolist()
    ranks = lora_ranks.tolist()
    merged: list = []
    for start, end, slot in zip(starts, ends, slots):
        if merged and merged[-1][2] == slot and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], end, slot)
        else:
            merged.append((start, end, slot))
    covered = merged[-1][1] - merged[0][0] if merged else 0

    def rank(slot: int) -> int:
        return min(max(int(ranks[slot]), 0), max_rank)

    if permutation is not None and merged:
        low, high = merged[0][0], merged[-1][1]
        order = permutation[low:high].to(torch.int64)
        if not torch.equal(order, torch.arange(low, high)):
            return HostRoutes(tuple((order[start - low : end - low], slot, rank(slot)) for start, end, slot in merged), covered)
    return HostRoutes(tuple((slice(start, end), slot, rank(slot)) for start, end, slot in merged), covered)


def _take(tensor: torch.Tensor, rows: Rows) -> torch.Tensor:
    """Rows of ``tensor``: a view for a slice, a gathered copy for an index tensor."""
    return tensor[rows] if isinstance(rows, slice) else tensor.index_select(0, rows)


def _put(out: torch.Tensor, rows: Rows, values: torch.Tensor) -> None:
    """``out[rows] = values`` (cast to out's dtype)."""
    if isinstance(rows, slice):
        out[rows].copy_(values)
    else:
        out.index_copy_(0, rows, values.to(out.dtype))


def bands_tile(bands: Sequence[tuple[int, int]], width: int) -> bool:
    """Whether ``bands`` are consecutive and cover ``[0, width)``."""
    edges = [edge for band in bands for edge in band]
    return edges[0] == 0 and edges[-1] == width and all(a == b for a, b in zip(edges[1:-1:2], edges[2::2]))


def shrink(x: torch.Tensor, weights: torch.Tensor, routes: HostRoutes, num_slices: int) -> torch.Tensor:
    """``out[t] = x[t] @ weights[slot[t]]^T``, zero outside runs: one GEMM per run, over its rank.

    x: (T, K); weights: (L, S * R, K) in SGLang's packed layout (a rank-``r`` slot's slice ``p`` at
    rows ``[p * r, (p + 1) * r)``). Returns (T, S * R) in x's dtype, packed the same way: a run's
    GEMM covers the first ``S * r`` rows of its slot (a view of the pool, no copy) and its columns
    from ``S * r`` on are zero; a rank-0 run is none. A permuted run's rows are gathered once and
    its results scattered once.
    """
    num_rows, width = x.shape[0], weights.shape[1]
    max_rank = width // num_slices
    full = all(rank == max_rank for _, _, rank in routes.runs) and routes.covers(num_rows)
    out = x.new_empty((num_rows, width)) if full else x.new_zeros((num_rows, width))
    for rows, slot, rank in routes.runs:
        if rank == 0:
            continue
        columns = slice(0, num_slices * rank)
        a = weights[slot, columns]
        if isinstance(rows, slice):
            torch.mm(x[rows], a.t(), out=out[rows, columns])
            continue
        x_run = x.index_select(0, rows)
        run_out = x.new_empty((x_run.shape[0], width)) if rank == max_rank else x.new_zeros((x_run.shape[0], width))
        torch.mm(x_run, a.t(), out=run_out[:, columns])
        out.index_copy_(0, rows, run_out)
    return out


def expand(
    x: torch.Tensor,
    weights: torch.Tensor,
    routes: HostRoutes,
    scalings: Sequence[float],
    bands: Sequence[tuple[int, int]],
    base_output: Optional[torch.Tensor],
) -> torch.Tensor:
    """``out[t, band_p] = scalings[l] * x[t, p*R:p*R+rank] @ weights[l, band_p, :rank]^T (+ base)``:
    one GEMM per run and slice, in fp32.

    x: (T, S * R); weights: (L, N, R); scalings: the ``L`` slots' scale factors, read on the host
    (once per batch: ``scalings.tolist()`` of the batch info's); bands: ``S`` host ``(start, end)``
    column ranges. Returns
    (T, N) in x's dtype: ``base_output`` itself when given in x's dtype, the LoRA term added into
    it in place (as SGLang's ``torch_native`` backend and Triton kernels do: no second (T, N)
    tensor, so no fresh pages to fault in and no extra pass over the output), else a new tensor.
    In fp32 each run's GEMM writes its output rows directly (contiguous runs; the scaling is the
    GEMM's ``alpha``, the base its ``beta = 1`` input); a permuted run's rows are gathered into an
    fp32 buffer and scattered back once. Other dtypes round the GEMM to x's dtype before scaling,
    as the device routing does, and add it to the base in fp32.

    Raises:
        ValueError: if the slice bands do not tile ``[0, N)`` (read from ``slice_offsets``).
    """
    num_rows, out_dim, max_rank = x.shape[0], weights.shape[1], weights.shape[2]
    if not bands_tile(bands, out_dim):
        raise ValueError(f"slice offsets {bands} must tile the {out_dim} output columns from 0")
    if base_output is not None:
        result = base_output if base_output.dtype == x.dtype else base_output.to(x.dtype)
    elif routes.covers(num_rows):
        result = x.new_empty((num_rows, out_dim))
    else:
        result = x.new_zeros((num_rows, out_dim))
    fp32 = x.dtype == torch.float32
    for rows, slot, rank in routes.runs:
        if rank == 0:  # no LoRA: the base output (or zero), as the GEMM over no rank would give
            if base_output is None:
                result[rows] = 0
            continue
        x_run = _take(x, rows)
        in_place = fp32 and isinstance(rows, slice)
        if in_place:
            acc = result[rows]
        elif base_output is None:
            acc = torch.empty((x_run.shape[0], out_dim), dtype=torch.float32)
        else:
            acc = _take(result, rows).to(torch.float32)  # a copy: gathered rows, or a wider dtype
        for p, (low, high) in enumerate(bands):
            x_p, b_t, acc_p = x_run[:, p * max_rank : p * max_rank + rank], weights[slot, low:high, :rank].t(), acc[:, low:high]
            if fp32:
                acc_p.addmm_(x_p, b_t, beta=0 if base_output is None else 1, alpha=scalings[slot])
            elif base_output is None:  # round the GEMM to x's dtype, as the device path does
                torch.mul(torch.mm(x_p, b_t).to(torch.float32), scalings[slot], out=acc_p)
            else:
                acc_p.add_(torch.mm(x_p, b_t).to(torch.float32), alpha=scalings[slot])
        if not in_place:
            _put(result, rows, acc)
    return result
