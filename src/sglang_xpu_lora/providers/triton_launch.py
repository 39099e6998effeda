"""The linears of eager batches on SGLang's Triton LoRA kernels, launched from their compiled handles.

Outside graphs a LoRA'd linear of a small batch costs host time, not device time: on an H200 one
layer's four linears take 120-180 µs of base GEMMs and about 25 µs of LoRA kernels, yet 330-410 µs
through SGLang's ``triton`` backend (``benchmarks/results/layer-cuda.json``, eager rows). Per launch,
SGLang's wrapper (``sgemm_lora_a_fwd`` and the B ops in ``sglang.kernels.ops.lora.dense``: asserts,
output allocation, grid) and Triton's ``JITFunction.run`` (argument binding, specialization key,
cache lookup) took 62 µs on that machine's host, the compiled kernel's own launcher 11 µs.

:class:`TritonLinearLaunches` runs one linear (the base GEMM, the shrink, the expand into the base
output) as those wrappers do, with the same kernels and grids, and their tiles except in batches
with long segments (:data:`LONG_SEGMENT_TILES`), from what
``forward_with_base`` receives, and launches each kernel through :class:`CompiledLaunches`: the
first launch of a specialization goes through Triton's ``JITFunction.run`` (which compiles and
returns the ``CompiledKernel``), later ones call the compiled kernel's launcher with the arguments
``JITFunction.run`` would pass it. The key that picks a compiled kernel is finer than Triton's own
specialization: every integer argument exactly, every tensor's dtype and 16-byte alignment
(what Triton specializes pointers on), the batch's ``permutation`` being None or not, so a launch
never reaches a kernel compiled for other arguments; compiled kernels are kept per device, as
Triton keeps them. The direct launch repeats the launcher call of the installed Triton's
``JITFunction.run``, checked in its source (:func:`launches_like_jit_run`): a Triton that launches
otherwise gets every launch through ``JITFunction.run``. Triton's interpreter (``TRITON_INTERPRET=1``)
has no compiled kernels: there every launch goes through the interpreted function.

The math is that of SGLang's Triton backend, per row ``t`` of segment ``s`` (slot
``w = weight_indices[s]``, rank ``r = lora_ranks[w]``): shrink ``a_t = x_t @ A[w, :n r].T`` (slice
``p`` at columns ``[p r, (p + 1) r)``), expand ``out_t[band p] += scalings[w] * a_t[p r : (p + 1) r]
@ B[w, band p, :r].T``; rows of rank-0 slots untouched.
"""

from __future__ import annotations

import functools
import inspect
import logging
import types
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional

import torch
import triton
from triton.runtime import driver
from triton.runtime.jit import JITFunction

try:
    from triton import knobs
except ImportError:  # Triton < 3.4: its JITFunction.run launches otherwise (launches_like_jit_run)
    knobs = None

from sglang_xpu_lora.upstream import targets
from sglang_xpu_lora.upstream.compat import resolve

if TYPE_CHECKING:
    from sglang.srt.lora.utils import LoRABatchInfo

logger = logging.getLogger(__name__)

class Tiles(NamedTuple):
    """The constexpr tiles of one launch of the four kernels: rows per program (``BLOCK_S``, the
    same in all four) and per kernel its ``(BLOCK_N, BLOCK_K)`` as the kernel names them."""

    rows: int
    shrink: tuple  # sgemm_lora_a: BLOCK_N (SGLang's wrapper: BLOCK_R), BLOCK_K
    expand_one: tuple  # sgemm_lora_b: BLOCK_N, BLOCK_K (the wrapper: BLOCK_R)
    expand_bands: tuple  # qkv_lora_b and gate_up_lora_b: BLOCK_N (the wrappers: BLOCK_OUT), BLOCK_K (BLOCK_R)


#: SGLang's wrappers' tiles, checked against their source by the compat guard
#: (``targets.REQUIRED_SOURCE``), for batches whose longest segment is under :data:`LONG_SEGMENT_ROWS`.
SGLANG_TILES = Tiles(rows=16, shrink=(16, 256), expand_one=(256, 16), expand_bands=(64, 16))
#: Tiles for batches with a segment of :data:`LONG_SEGMENT_ROWS` rows or more (prefill, and decode
#: batches with many rows of one adapter): 64 rows per program, so each program reads an adapter's
#: weights for 4x the rows, and 128 output columns per program of the banded expands. On an H200
#: (7 candidates of rows, shrink and expand tiles; the layer at 512 and 2048 prefill tokens, both
#: shapes, ranks 16 and 64, 1 and 8 adapters) they took 0.71-0.94x the layer time of SGLang's tiles
#: (median 0.83x), the best of the candidates and never slower
#: (``benchmarks/launch_tiles.py``, ``benchmarks/results/launch-tiles-cuda.json``).
LONG_SEGMENT_TILES = Tiles(rows=64, shrink=(16, 256), expand_one=(256, 16), expand_bands=(128, 16))
LONG_SEGMENT_ROWS = 64


@functools.cache
def _kernels() -> types.SimpleNamespace:
    """SGLang's Triton kernels (``triton.jit`` functions), through the compat targets, which check
    their argument lists (``targets.REQUIRED_KERNEL_ARGUMENTS``)."""
    return types.SimpleNamespace(
        shrink=resolve(targets.TRITON_SGEMM_LORA_A_KERNEL),
        expand_one=resolve(targets.TRITON_SGEMM_LORA_B_KERNEL),
        expand_bands=resolve(targets.TRITON_QKV_LORA_B_KERNEL),
        expand_two=resolve(targets.TRITON_GATE_UP_LORA_B_KERNEL),
    )


#: The launcher call of Triton's ``JITFunction.run`` that :meth:`CompiledLaunches.launch` repeats
#: (Triton 3.4 to 3.8), without whitespace: the stream of the current device, then all the
#: kernel's arguments, constexprs included. Earlier releases passed the non-constexpr arguments
#: alone, ``kernel.metadata`` or ``CompiledKernel``'s hooks; a release that launches otherwise gets
#: every launch through ``JITFunction.run`` (:func:`launches_like_jit_run`).
JIT_RUN_LAUNCH = (
    "device=driver.active.get_current_device()",
    "stream=driver.active.get_current_stream(device)",
    "kernel.run(grid_0,grid_1,grid_2,stream,kernel.function,kernel.packed_metadata,launch_metadata,"
    "knobs.runtime.launch_enter_hook,knobs.runtime.launch_exit_hook,*bound_args.values())",
)


def launches_like_jit_run() -> bool:
    """Whether the installed Triton's ``JITFunction.run`` launches a compiled kernel as
    :meth:`CompiledLaunches.launch` does (:data:`JIT_RUN_LAUNCH`, read in its source); when not,
    every launch goes through ``JITFunction.run`` (logged once)."""
    return knobs is not None and _launches_like(JITFunction.run)


@functools.cache
def _launches_like(run) -> bool:
    try:
        source = "".join(inspect.getsource(run).split())
    except (OSError, TypeError):
        source = ""
    matches = all(text in source for text in JIT_RUN_LAUNCH)
    if not matches:
        logger.warning(
            "sglang-xpu-lora: Triton %s's JITFunction.run does not launch compiled kernels as the eager "
            "LoRA linears' direct launches expect; every launch goes through JITFunction.run", triton.__version__,
        )
    return matches


def _aligned(tensor: torch.Tensor) -> bool:
    """What Triton specializes a pointer argument on: its address divisible by 16."""
    return tensor.data_ptr() % 16 == 0


class CompiledLaunches:
    """Launches of one Triton kernel (``kernel``, a ``triton.jit`` function), from its compiled
    kernel once one exists for the caller's ``key``.

    ``launch(key, grid, args)``: ``args`` are all the kernel's arguments, positionally (constexprs
    included), ``grid`` three host integers. ``key`` must determine everything Triton specializes
    the kernel on for these ``args`` (the integers, the tensors' dtypes and 16-byte alignment,
    which arguments are None, the constexprs): the first launch of a key goes through
    ``JITFunction.run``, which compiles or finds the kernel, launches it and returns it; later
    launches of the key call its launcher as ``JITFunction.run`` does, on the current stream of the
    current device, with Triton's launch hooks and metadata (profilers see them as usual).

    Compiled kernels are kept per current device, as ``JITFunction.run`` keeps them (a compiled
    kernel's handle is loaded on one device). An interpreted kernel (``TRITON_INTERPRET=1``), or
    any kernel where the installed Triton launches otherwise (:func:`launches_like_jit_run`), is
    launched through ``kernel[grid]`` every time. ``current_device``, ``current_stream(device)``:
    what picks the compiled kernel and what the launcher is given as the stream, by default
    Triton's driver's current device and its current stream (as ``JITFunction.run`` asks for them).
    """

    __slots__ = ("kernel", "_handles", "_current_device", "_current_stream")

    def __init__(
        self, kernel, current_device: Optional[Callable[[], object]] = None,
        current_stream: Optional[Callable[[object], object]] = None,
    ):
        self.kernel = kernel
        #: (device, key) -> compiled kernel; None where every launch goes through ``kernel[grid]``.
        self._handles: Optional[dict] = {} if isinstance(kernel, JITFunction) and launches_like_jit_run() else None
        if self._handles is not None:
            current_device = current_device or driver.active.get_current_device
            current_stream = current_stream or driver.active.get_current_stream
        self._current_device, self._current_stream = current_device, current_stream

    @property
    def compiled_keys(self) -> int:
        """How many specializations have a compiled kernel here, over all devices (0 for an
        interpreted kernel)."""
        return 0 if self._handles is None else len(self._handles)

    def launch(self, key, grid: tuple, args: tuple) -> None:
        handles = self._handles
        if handles is None:
            self.kernel[grid](*args)
            return
        device = self._current_device()
        compiled = handles.get((device, key))
        if compiled is None:
            compiled = self.kernel.run(*args, grid=grid, warmup=False)
            if compiled is not None:
                handles[(device, key)] = compiled
            return
        stream = self._current_stream(device)
        runtime = knobs.runtime
        compiled.run(
            grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata,
            compiled.launch_metadata(grid, stream, *args), runtime.launch_enter_hook, runtime.launch_exit_hook, *args,
        )


class TritonLinearLaunches:
    """One LoRA'd linear of an eager batch, base GEMM plus LoRA, on SGLang's Triton kernels
    launched from their compiled handles (module docstring).

    Per batch, :meth:`begin_batch` takes SGLang's batch info of the linears (the backend's
    ``_sgemm_info()``); :meth:`forward` then runs each linear with only its own tensors. The
    launches are those of SGLang's ``sgemm_lora_a_fwd`` (shrink), then, by the layer's output
    slices, ``sgemm_lora_b_fwd`` (one), ``gate_up_lora_b_fwd`` (two equal) or ``qkv_lora_b_fwd``
    (any other), adding into the base output in place, through its strides: a layer whose LoRA
    covers only its leading output columns (prefix partitions) gets them there, the others
    untouched. ``kernels`` (tests): ``shrink``, ``expand_one``, ``expand_bands``, ``expand_two``
    instead of SGLang's (:func:`_kernels`), each launched through ``launches(kernel)``. Compiled
    kernels are kept across batches (:class:`CompiledLaunches`): the batch
    tensors' dtypes and alignment and whether the batch is permuted are part of every key.
    """

    def __init__(self, kernels: Optional[types.SimpleNamespace] = None, launches=CompiledLaunches):
        #: The tiles of batches with a segment of :attr:`long_segment_rows` rows or more (the
        #: tile benchmark, ``benchmarks/launch_tiles.py``, sets other candidates here).
        self.long_segment_tiles, self.long_segment_rows = LONG_SEGMENT_TILES, LONG_SEGMENT_ROWS
        kernels = kernels or _kernels()
        self.shrink = launches(kernels.shrink)
        self.expand_one = launches(kernels.expand_one)
        self.expand_bands = launches(kernels.expand_bands)
        self.expand_two = launches(kernels.expand_two)
        self._batch: Optional[tuple] = None
        self.tiles: Optional[Tiles] = None

    def begin_batch(self, info: LoRABatchInfo) -> None:
        """Take the batch: ``info`` is SGLang's ``LoRABatchInfo`` of the linears (``seg_lens``,
        ``seg_indptr``, ``weight_indices`` ``(bs,)`` int32, ``lora_ranks`` ``(slots,)`` int32,
        ``scalings`` ``(slots,)`` float32, ``permutation`` ``(tokens,)`` int or None, host ``bs``
        and ``max_len``)."""
        indices = (info.seg_lens, info.seg_indptr, info.weight_indices, info.lora_ranks)
        permutation, scalings = info.permutation, info.scalings
        sorted_by_adapter = permutation is not None
        tensors = (*indices, scalings, *((permutation,) if sorted_by_adapter else ()))
        #: The tiles of this batch's launches.
        self.tiles = tiles = self.long_segment_tiles if info.max_len >= self.long_segment_rows else SGLANG_TILES
        specialization = (sorted_by_adapter, tuple((t.dtype, _aligned(t)) for t in tensors), tiles)
        row_tiles = triton.cdiv(info.max_len, tiles.rows)
        self._batch = (indices, permutation, sorted_by_adapter, scalings, tiles, row_tiles, info.bs, specialization)

    def end_batch(self) -> None:
        """Forget the batch (SGLang's idle-forward reset)."""
        self._batch = self.tiles = None

    def forward(
        self, x: torch.Tensor, base_fn: Callable[[], torch.Tensor], lora_a: torch.Tensor, lora_b: torch.Tensor,
        output_offset: torch.Tensor, offsets: tuple, all_reduce: Optional[Callable] = None,
    ) -> torch.Tensor:
        """``base_fn()`` plus this batch's LoRA, then ``all_reduce`` once (row-parallel linears at
        TP > 1).

        x: ``(tokens, K)``; ``base_fn()``: ``(tokens, >= offsets[-1])``, x's dtype; lora_a:
        ``(slots, n * max_rank, K)``; lora_b: ``(slots, offsets[-1], max_rank)``; output_offset:
        ``(n + 1,)`` int32 on the device (read for three or more slices, or two unequal ones; every
        SGLang layer of several slices has one), ``offsets`` the same host integers (``n`` output slices).
        Returns the base output with LoRA added in place.

        Raises:
            RuntimeError: no batch was begun (a LoRA forward outside a prepared batch).
        """
        batch = self._batch
        if batch is None:
            raise RuntimeError("a LoRA linear ran with no prepared batch (prepare_lora_batch was not called)")
        indices, permutation, sorted_by_adapter, scalings, tiles, row_tiles, bs, specialization = batch
        output = base_fn()
        max_rank, slices = lora_b.shape[-1], len(offsets) - 1
        stacked = lora_a.shape[-2]
        shrunk = torch.empty((x.shape[0], stacked), device=x.device, dtype=x.dtype)
        block_n, block_k = tiles.shrink
        ints = (stacked, lora_a.shape[-1], slices, *x.stride(), *lora_a.stride(), *shrunk.stride())
        self.shrink.launch(
            (x.dtype, lora_a.dtype, _aligned(x), _aligned(lora_a), ints, specialization),
            (row_tiles * triton.cdiv(stacked, block_n), bs, 1),
            (x, lora_a, shrunk, *ints, *indices, permutation, sorted_by_adapter, tiles.rows, block_n, block_k),
        )
        strides = (*shrunk.stride(), *lora_b.stride(), *output.stride())
        common = (x.dtype, lora_b.dtype, output.dtype, _aligned(shrunk), _aligned(lora_b), _aligned(output), specialization)
        if slices == 1:
            out_dim = lora_b.shape[-2]
            block_n, block_k = tiles.expand_one
            ints = (out_dim, max_rank, *strides)
            self.expand_one.launch(
                (ints, common), (row_tiles * triton.cdiv(out_dim, block_n), bs, 1),
                (shrunk, lora_b, output, *ints, *indices, permutation, sorted_by_adapter, tiles.rows, block_n, block_k,
                 scalings),
            )
        else:
            widths = [offsets[p + 1] - offsets[p] for p in range(slices)]
            widest = max(widths)
            block_n, block_k = tiles.expand_bands
            grid = (row_tiles * triton.cdiv(widest, block_n), slices, bs)
            ints = (max_rank, widest, *strides)
            if slices == 2 and widths[0] == widths[1]:
                self.expand_two.launch(
                    (ints, common), grid,
                    (shrunk, lora_b, output, *ints, *indices, permutation, sorted_by_adapter, tiles.rows, block_n,
                     block_k, scalings),
                )
            else:
                self.expand_bands.launch(
                    (ints, common, output_offset.dtype, _aligned(output_offset)), grid,
                    (shrunk, lora_b, output, *ints, *indices, output_offset, permutation, sorted_by_adapter, tiles.rows,
                     block_n, block_k, scalings),
                )
        return output if all_reduce is None else all_reduce(output)
