"""The expand kernels' slice geometry, built on the layer's device (any device).

SGLang 0.5.23's ``grouped_lora_b`` / ``per_row_lora_b`` (``kernels/ops/lora/common/lora_b.py``)
take a ``SliceGeometry`` (a public NamedTuple): an int32 device table of each slice's weight rows
``[S + 1]`` and destination columns ``[S]``, and the host launch facts derived from them. SGLang's
builder, ``slice_geometry``, raises off CUDA (it opens ``torch.cuda.device``), so the dense tier
builds the same NamedTuple itself, by the same rules, on whatever device the layer is on, and keeps
the tables for the life of its runner (graphs keep pointers to them).
"""

from __future__ import annotations

import torch
import triton
from sglang.kernels.ops.lora.common.lora_b import SliceGeometry

from sglang_xpu_lora.providers.graph_capture import capturing


def _validated(offsets, block_size_n: int) -> tuple[int, ...]:
    """``offsets`` as a tuple of increasing int32 prefixes from 0.

    Raises:
        ValueError: for a block size that is not a positive power of two, or offsets that are not
            increasing non-negative int32 prefixes starting at zero.
    """
    if type(block_size_n) is not int or block_size_n <= 0 or block_size_n & (block_size_n - 1):
        raise ValueError(f"BLOCK_SIZE_N {block_size_n!r} is not a positive power of two")
    rows = tuple(offsets)
    if (
        len(rows) < 2 or any(type(o) is not int for o in rows) or rows[0] != 0
        or any(lo >= hi for lo, hi in zip(rows, rows[1:])) or rows[-1] >= 2**31
    ):
        raise ValueError(f"slice offsets {rows!r} are not increasing int32 prefixes starting at zero")
    return rows


def build_slice_geometry(offsets, block_size_n: int, device: torch.device) -> SliceGeometry:
    """SGLang's ``SliceGeometry`` for output slices ``offsets`` (host ints ``[S + 1]``: slice ``s``
    spans weight rows and output columns ``[offsets[s], offsets[s + 1])``) and column tile
    ``block_size_n``, its table on ``device``.

    As SGLang's ``_build_geometry``: ``num_column_tiles`` = sum over slices of
    ``cdiv(width, block_size_n)``; ``uniform_width`` the common width (0 if the widths differ);
    ``out_stride`` the common spacing of the destination columns (0 if irregular); ``full_tiles``
    whether every width is a multiple of the tile.

    Raises:
        ValueError: bad offsets or block size (:func:`_validated`).
        RuntimeError: when first needed inside a graph capture (the table's host-to-device copy
            cannot be captured: run the layer eagerly once first, as every warm-up does).
    """
    rows = _validated(offsets, block_size_n)
    device = torch.device(device)
    if capturing(device):
        raise RuntimeError(
            f"slice geometry {rows} (BLOCK_SIZE_N {block_size_n}) was first needed inside a graph capture "
            f"on {device}; warm the layer up eagerly first"
        )
    columns = rows[:-1]
    widths = [hi - lo for lo, hi in zip(rows, rows[1:])]
    uniform = widths[0] if len(set(widths)) == 1 else 0
    stride = columns[1] if len(columns) > 1 else uniform
    regular = stride > 0 and all(c == s * stride for s, c in enumerate(columns))
    head = -(-len(rows) // 4) * 4  # the destination columns 16-byte aligned, as SGLang's table
    table = torch.tensor(list(rows) + [0] * (head - len(rows)) + list(columns), dtype=torch.int32, device=device)
    return SliceGeometry(
        slice_offsets=table[: len(rows)],
        out_offsets=table[head:],
        num_slices=len(widths),
        num_column_tiles=sum(triton.cdiv(w, block_size_n) for w in widths),
        uniform_width=uniform,
        out_stride=stride if regular else 0,
        full_tiles=all(w % block_size_n == 0 for w in widths),
        block_size_n=block_size_n,
    )


class SliceGeometries:
    """The geometries one runner has used, per (offsets, BLOCK_SIZE_N, device); never evicted,
    because captured graphs read their tables."""

    def __init__(self) -> None:
        self._built: dict = {}

    def get(self, offsets: tuple, block_size_n: int, device: torch.device) -> SliceGeometry:
        """The geometry of ``offsets`` at ``block_size_n`` on ``device`` (built on first use,
        :func:`build_slice_geometry`)."""
        key = (offsets, block_size_n, device)
        geometry = self._built.get(key)
        if geometry is None:
            geometry = self._built[key] = build_slice_geometry(offsets, block_size_n, device)
        return geometry
