"""Fused LoRA: shrink and expand of one linear in a single Triton kernel, for decode.

SGLang 0.5.23's dense LoRA (``srt/lora/dense/runner.py``) runs a linear's LoRA as two kernels, the
shrink (``lora_a``: ``x @ A[slot, :r].T`` into a bridge) and the expand (``lora_b``: ``scaling *
bridge @ B[slot, :, :r].T`` into the output), and overlaps the shrink with the base GEMM on a side
stream. In graph-captured decode on an H200 that costs, per linear, the expand after the GEMM (3-4
µs), a cross-stream wait (1-2 µs) and a shrink slowed by sharing the SMs with the GEMM (profile in
docs/performance.md). :func:`fused_per_row_lora` does both in one launch, with no bridge in memory:
one program per (token, output column tile), as SGLang's per-row expand is gridded. Each computes
its token's shrink for the one slice its columns belong to (``r`` dot products of length K, from
the token's own slot only) and multiplies it into its columns of B. No route. Every column tile of
a token re-reads that token's ``r x K`` block of A (from L2 after the first), so it pays only where
tokens x K x r are small.

It rounds the shrink to the activations' dtype (as a bridge in that dtype, and PEFT, round it).
A plan table row chooses it (:class:`FusedPlan`);
:meth:`sglang_xpu_lora.dense.runner.DeviceDenseRunner.apply` runs it.

The math is the per-token LoRA of S-LoRA/Punica's BGMV (Chen et al., "Punica: Multi-Tenant LoRA
Serving", 2023: one gather-matrix-vector product per token and adapter), at the slot's real rank
over SGLang's packed pool layout: slice ``s`` of a rank-``r`` slot is A rows ``[s r, (s + 1) r)``
and B's first ``r`` columns of the slice's rows.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import torch
import triton
import triton.language as tl
from sglang.kernels.ops.lora.common.lora_b import SliceGeometry, _slice_of_tile
from sglang.srt.lora.dense.plan import Overlap

#: The tile keys of a fused plan (all positive integers; the block sizes powers of two).
TILE_KEYS = ("BLOCK_SIZE_N", "BLOCK_SIZE_K", "num_warps", "num_stages")
#: The overlaps a fused plan can run with: in order after the base GEMM into its output (``none``),
#: or on the side stream into a delta added after the GEMM (``ab_delta``). SGLang's ``a`` overlaps
#: a separate shrink, which a fused plan does not have.
FUSED_OVERLAPS = (Overlap.NONE, Overlap.AB_DELTA)
#: The largest column tile and K step a plan may name: a tile's values times the pool rank must
#: stay under Triton's 2**20 elements per tensor, at ``--max-lora-rank`` up to 512 (larger tiles
#: fail to compile, at the first call that needs them).
MAX_TILE = 1024
#: The fused kernel forms a plan may name: one program per token and column tile (:func:`fused_per_row_lora`).
FUSED_FORMS = ("per_row",)


@dataclasses.dataclass(frozen=True)
class FusedPlan:
    """A plan row's choice of a fused kernel for a linear (the project's addition to SGLang's
    ``plans.json`` schema: ``"spec": {"fused": "per_row", "tiles": {...}, "overlap": "none" |
    "ab_delta"}``).

    Attributes:
        form: ``per_row`` (:func:`fused_per_row_lora`), the one of :data:`FUSED_FORMS`.
        overlap: ``Overlap.NONE`` or ``Overlap.AB_DELTA`` (:data:`FUSED_OVERLAPS`).
        tiles: ``BLOCK_SIZE_N`` (output columns per program), ``BLOCK_SIZE_K`` (input columns per
            step of the shrink), ``num_warps``, ``num_stages``.

    Raises:
        ValueError: an unknown form; a missing or unknown tile key, a tile that is not a positive
            integer, a block size that is not a power of two (at most :data:`MAX_TILE`), a
            ``num_warps`` Triton does not take, another overlap (an ``Overlap`` or its name).
    """

    form: str = "per_row"
    overlap: Overlap = Overlap.NONE
    tiles: Mapping[str, int] = dataclasses.field(
        default_factory=lambda: {"BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "num_warps": 4, "num_stages": 1}
    )

    def __post_init__(self) -> None:
        if self.form not in FUSED_FORMS:
            raise ValueError(f"a fused plan's form is one of {list(FUSED_FORMS)}, not {self.form!r}")
        allowed = [o.value for o in FUSED_OVERLAPS]
        try:  # the enum, also when given by name
            object.__setattr__(self, "overlap", Overlap(self.overlap))
        except ValueError:
            raise ValueError(f"a fused plan overlaps as {allowed}, not {self.overlap!r}") from None
        if self.overlap not in FUSED_OVERLAPS:
            raise ValueError(f"a fused plan overlaps as {allowed}, not {self.overlap.value!r}")
        if set(self.tiles) != set(TILE_KEYS):
            raise ValueError(f"fused tiles need exactly {list(TILE_KEYS)}, got {sorted(self.tiles)}")
        for key, value in self.tiles.items():
            if type(value) is not int or value <= 0:
                raise ValueError(f"fused.{key} must be a positive integer, not {value!r}")
            if key.startswith("BLOCK_SIZE_") and (value & (value - 1) or value > MAX_TILE):
                raise ValueError(f"fused.{key} must be a power of two up to {MAX_TILE}, not {value}")
        if self.tiles["num_warps"] not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"fused.num_warps must be a power of two up to 32, not {self.tiles['num_warps']}")

    def spec(self) -> dict:
        """The plan as a table row's JSON ``spec``."""
        return {"fused": self.form, "tiles": dict(self.tiles), "overlap": self.overlap.value}


@triton.jit
def _column_tile(
    slice_offsets_ptr, out_offsets_ptr, pid_n,
    NUM_SLICES: tl.constexpr, UNIFORM_WIDTH: tl.constexpr, OUT_STRIDE: tl.constexpr, BLOCK_SIZE_N: tl.constexpr,
):
    """Column tile ``pid_n``: its slice, its ``BLOCK_SIZE_N`` columns within the slice (int64), the
    slice's first row of B and its width, and the slice's first output column, as SGLang's expand
    kernels map a tile (uniform slices from the constants, others by SGLang's ``_slice_of_tile``)."""
    if UNIFORM_WIDTH > 0:
        tiles_per_slice: tl.constexpr = (UNIFORM_WIDTH + BLOCK_SIZE_N - 1) // BLOCK_SIZE_N
        slice_id = pid_n // tiles_per_slice
        n_tile = pid_n % tiles_per_slice
        n_start = (slice_id * UNIFORM_WIDTH).to(tl.int64)
        width = tl.full((), UNIFORM_WIDTH, tl.int64)
    else:
        slice_id, n_tile, n_start, width = _slice_of_tile(slice_offsets_ptr, pid_n, NUM_SLICES, BLOCK_SIZE_N)
    if OUT_STRIDE > 0:
        out_start = (slice_id * OUT_STRIDE).to(tl.int64)
    else:
        out_start = tl.load(out_offsets_ptr + slice_id).to(tl.int64)
    columns = n_tile.to(tl.int64) * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N).to(tl.int64)
    return slice_id, columns, n_start, width, out_start


@triton.jit
def _fused_per_row_kernel(
    x_ptr,
    a_ptr,
    b_ptr,
    out_ptr,
    token_slots_ptr,
    lora_ranks_ptr,
    scalings_ptr,
    slice_offsets_ptr,
    out_offsets_ptr,
    in_features,
    stride_xm,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    stride_bs,
    stride_bn,
    stride_br,
    stride_om,
    stride_on,
    RANK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    UNIFORM_WIDTH: tl.constexpr,
    OUT_STRIDE: tl.constexpr,
    FULL_TILES: tl.constexpr,
    ADD_INPLACE: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(token_slots_ptr + row)
    if slot < 0:  # no adapter (or graph padding): the row is left as it is
        return
    slot = slot.to(tl.int64)
    rank = tl.load(lora_ranks_ptr + slot).to(tl.int32)
    if rank == 0:
        return
    slice_id, n_offsets, n_start, width, out_start = _column_tile(
        slice_offsets_ptr, out_offsets_ptr, tl.program_id(1), NUM_SLICES, UNIFORM_WIDTH, OUT_STRIDE, BLOCK_SIZE_N
    )

    # Shrink: the slice's r rows of the slot's A against the token's activations, fp32 accumulate.
    # Rows at or past the slot's real rank are never read (they belong to the next slice, or hold
    # a previous adapter's tail); a lane mask on the rows keeps the loads vectorised along K.
    r_offsets = tl.arange(0, BLOCK_R)
    r_live = r_offsets < rank
    a_rows = a_ptr + slot * stride_as + (slice_id * rank + r_offsets).to(tl.int64)[:, None] * stride_ar
    x_row = x_ptr + row * stride_xm
    shrink = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k_begin in range(0, in_features, BLOCK_SIZE_K):
        k_offsets = k_begin + tl.arange(0, BLOCK_SIZE_K)
        k_live = k_offsets < in_features
        x_block = tl.load(x_row + k_offsets * stride_xk, mask=k_live, other=0.0).to(tl.float32)
        a_block = tl.load(a_rows + k_offsets[None, :] * stride_ak, mask=r_live[:, None] & k_live[None, :], other=0.0)
        shrink += tl.sum(a_block.to(tl.float32) * x_block[None, :], axis=1)
    # Round as a bridge in the activations' dtype (SGLang's) and PEFT's lora_A output do.
    shrink = shrink.to(x_ptr.dtype.element_ty).to(tl.float32)

    # Expand: the tile's columns of B (first r columns) times the shrink, scaled.
    if FULL_TILES:
        n_live = tl.full((BLOCK_SIZE_N,), 1, tl.int1)
    else:
        n_live = n_offsets < width
    # Load under the pool's static rank, then select the live rank: a lane mask on B's contiguous
    # rank axis would make the loads scalar (SGLang's expand does the same). Select, not multiply:
    # the lanes past the live rank may hold anything, NaN included.
    b_block = tl.load(
        b_ptr + slot * stride_bs + (n_start + n_offsets)[:, None] * stride_bn + r_offsets[None, :] * stride_br,
        mask=n_live[:, None] & (r_offsets < RANK)[None, :],
        other=0.0,
    )
    b_block = tl.where(r_live[None, :], b_block.to(tl.float32), 0.0)
    lora = tl.sum(b_block * shrink[None, :], axis=1) * tl.load(scalings_ptr + slot).to(tl.float32)
    out_ptrs = out_ptr + row * stride_om + (out_start + n_offsets) * stride_on
    if ADD_INPLACE:
        lora += tl.load(out_ptrs, mask=n_live, other=0.0).to(tl.float32)
    tl.store(out_ptrs, lora.to(out_ptr.dtype.element_ty), mask=n_live)


#: The most fp32 values of the shrink's A tile (``BLOCK_R x BLOCK_SIZE_K``) per thread.
A_TILE_VALUES_PER_THREAD = 32


def shrink_k_tile(block_k: int, block_r: int, num_warps: int) -> int:
    """The shrink's K step: ``block_k`` capped so that the A tile holds at most
    :data:`A_TILE_VALUES_PER_THREAD` fp32 values per thread (at least 16), so that one plan row
    serves every pool rank without spilling registers (as SGLang's expand caps its K tile at the
    rank, ``_k_tile``). Offline sm90 compiles (Triton 3.8, ``ptxas -v``) at pool rank 64 spilled
    registers with 64 values per thread (a 64 x 128 tile on 4 warps); with 32, no tile of the plan
    sweep's did."""
    return max(16, min(block_k, A_TILE_VALUES_PER_THREAD * 32 * num_warps // block_r))


def fused_per_row_lora(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    token_slots: torch.Tensor,
    *,
    lora_ranks: torch.Tensor,
    scalings: torch.Tensor,
    geometry: SliceGeometry,
    tiles: Mapping[str, int],
    add_inplace: bool,
) -> torch.Tensor:
    """Add (``add_inplace``) or write each token's LoRA into ``out``, shrink and expand in one kernel,
    one program per token and column tile.

    For token ``t`` of slot ``s = token_slots[t]`` with real rank ``r = lora_ranks[s] > 0`` and each
    slice ``p`` of ``geometry`` (rows ``[o_p, o_{p+1})`` of B, columns from ``out_offsets[p]`` of
    ``out``): ``out[t, cols_p] (+)= scalings[s] * B[s, o_p:o_{p+1}, :r] @ round(A[s, p r:(p + 1) r] @ x[t])``,
    ``round`` to ``x``'s dtype; rows of slot -1 or rank 0 are not written. The per-token GEMV of
    BGMV (Punica), at real ranks over SGLang's packed pool; the shrink's K step is capped by
    :func:`shrink_k_tile`.

    Args:
        x: ``(tokens, K)`` activations, fp32/fp16/bf16.
        a: ``(slots, slices * max_rank, K)`` LoRA-A, packed at each slot's real rank.
        b: ``(slots, offsets[-1], max_rank)`` LoRA-B.
        out: ``(tokens, >= N)``; written only on the columns of the geometry's slices.
        token_slots: ``(tokens,)`` int32 slot per token, -1 for none.
        lora_ranks: ``(slots,)`` int32 real ranks; scalings: ``(slots,)`` float32.
        geometry: SGLang's ``SliceGeometry`` of the output slices at ``tiles["BLOCK_SIZE_N"]``.
        tiles: :class:`FusedPlan`'s tiles.

    Returns ``out``.

    Raises:
        ValueError: the geometry's column tile differs from ``tiles``, or A does not hold one rank
            block per slice.
    """
    if geometry.block_size_n != tiles["BLOCK_SIZE_N"]:
        raise ValueError("fused BLOCK_SIZE_N must match its slice geometry")
    max_rank = b.shape[2]
    if a.shape[1] != geometry.num_slices * max_rank:
        raise ValueError(f"LoRA-A holds {a.shape[1]} rows, not {geometry.num_slices} slices x rank {max_rank}")
    if x.shape[0] == 0:
        return out
    block_r = triton.next_power_of_2(max_rank)
    warps = int(tiles["num_warps"])
    _fused_per_row_kernel[(x.shape[0], geometry.num_column_tiles)](
        x, a, b, out, token_slots, lora_ranks, scalings, geometry.slice_offsets, geometry.out_offsets,
        x.shape[1], x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2),
        b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1),
        RANK=max_rank, BLOCK_R=block_r, NUM_SLICES=geometry.num_slices, UNIFORM_WIDTH=geometry.uniform_width,
        OUT_STRIDE=geometry.out_stride, FULL_TILES=geometry.full_tiles, ADD_INPLACE=add_inplace,
        BLOCK_SIZE_N=int(tiles["BLOCK_SIZE_N"]), BLOCK_SIZE_K=shrink_k_tile(int(tiles["BLOCK_SIZE_K"]), block_r, warps),
        num_warps=warps, num_stages=int(tiles["num_stages"]),
    )
    return out
