"""SGLang's legacy Triton LoRA kernels, launched from their compiled handles.

Outside graphs a LoRA'd linear of a small batch costs host time, not device time: on an H200 one
layer's four linears take 120-180 µs of base GEMMs and about 25 µs of LoRA kernels, yet 330-410 µs
through SGLang's ``triton`` backend (``benchmarks/results/layer-cuda.json``, eager rows). Per launch,
SGLang's wrapper (``sgemm_lora_a_fwd`` and the B ops in ``sglang.kernels.ops.lora.dense``: asserts,
output allocation, grid) and Triton's ``JITFunction.run`` (argument binding, specialization key,
cache lookup) took 62 µs on that machine's host, the compiled kernel's own launcher 11 µs.

:class:`BatchLaunches` makes the launches of those wrappers for one batch, with the same kernels,
grids and argument lists, and their tiles except in batches with long segments
(:data:`LONG_SEGMENT_TILES`): the shrink, each expand, and the choice of the expand by the output
slices (:meth:`BatchLaunches.expand`). Two callers bind it to a batch
(:meth:`TritonLaunches.batch`): :class:`TritonLinearLaunches`, which runs one whole linear of an
eager batch (the base GEMM, the shrink, the expand into the base output) from what
``forward_with_base`` receives, and the Triton provider's batch-bound ops
(:func:`sglang_xpu_lora.providers.triton_ops.bind`: the per-op tier, eagerly and inside graphs;
the ops a route binds are the methods of one ``BatchLaunches``).

Where the compiled kernels live: in a :class:`TritonLaunches` (its :class:`CompiledLaunches`),
owned by whoever binds batches with it, never in this module. ``IntelXpuLoRABackend`` owns one
:class:`TritonLinearLaunches`, its launch cache, for both callers above, so two backends in one
process (target and draft) keep their own; a test or benchmark without a backend makes its own.

Each kernel is launched through :class:`CompiledLaunches`: the first launch of a specialization
goes through Triton's ``JITFunction.run`` (which compiles and returns the ``CompiledKernel``),
later ones call the compiled kernel's launcher with the arguments ``JITFunction.run`` would pass
it, on the current stream (so a launch inside a graph capture is recorded like any other; a first
launch there compiles, as SGLang's wrappers do). The key that picks a compiled kernel is finer than
Triton's own specialization: every integer argument exactly, every tensor's dtype and 16-byte alignment
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


class TritonLaunches:
    """SGLang's four legacy Triton LoRA kernels, each launched through its :class:`CompiledLaunches`
    (module docstring), which keep their compiled kernels across batches for as long as their owner
    keeps this object (a backend: its launch cache); :meth:`batch` binds them to one batch.

    ``kernels`` (tests): ``shrink``, ``expand_one``, ``expand_bands``, ``expand_two`` instead of
    SGLang's (:func:`_kernels`), each launched through ``launches(kernel)``. The batch tensors'
    dtypes and alignment and whether the batch is permuted are part of every key, so a compiled
    kernel serves every batch of its specialization.
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

    def batch(self, info: LoRABatchInfo) -> BatchLaunches:
        """The kernels bound to the batch ``info``: SGLang's ``LoRABatchInfo`` (``seg_lens``,
        ``seg_indptr``, ``weight_indices`` ``(bs,)`` int32, ``lora_ranks`` ``(slots,)`` int32,
        ``scalings`` ``(slots,)`` float32, ``permutation`` ``(tokens,)`` int or None, host ``bs``
        and ``max_len``), read now: the launches use its tensors and host integers as they are
        at this call (SGLang's wrappers read them at each call; the backend binds after SGLang
        prepared the batch, and again for every batch, graph batch infos included)."""
        return BatchLaunches(self, info)


class BatchLaunches:
    """SGLang's legacy Triton LoRA kernels bound to one batch (:meth:`TritonLaunches.batch`): the
    launches of SGLang's wrappers ``sgemm_lora_a_fwd`` (:meth:`shrink`), ``sgemm_lora_b_fwd``
    (:meth:`expand_one`), ``gate_up_lora_b_fwd`` (:meth:`expand_two`) and ``qkv_lora_b_fwd``
    (:meth:`expand_bands`), with their kernels, grids and argument lists, and their tiles except in
    batches with long segments (:data:`LONG_SEGMENT_TILES`, :attr:`tiles`). :meth:`expand` chooses
    among the expands by the output slices, the one place that choice is made.

    What the wrappers do besides launching is not repeated: no asserts, and every tensor is read
    through its strides. The expands add into ``output`` in place (SGLang's ``base_output``) and
    return it, or into new zeros for None, as the wrappers do. Every method takes its arguments in
    the wrapper's order, which is the order of the bound ops' per-call arguments
    (:data:`.batch_binding.BOUND_PARAMETERS`): the Triton provider binds the ops of a route to
    these methods of one ``BatchLaunches`` as they are (:func:`.triton_ops.bind`). Math: module
    docstring.
    """

    __slots__ = ("_launches", "_indices", "_permutation", "_sorted_by_adapter", "_scalings", "tiles", "_row_tiles",
                 "_bs", "_specialization")

    def __init__(self, launches: TritonLaunches, info: LoRABatchInfo):
        indices = (info.seg_lens, info.seg_indptr, info.weight_indices, info.lora_ranks)
        permutation, scalings = info.permutation, info.scalings
        sorted_by_adapter = permutation is not None
        tensors = (*indices, scalings, *((permutation,) if sorted_by_adapter else ()))
        #: The tiles of this batch's launches.
        self.tiles = tiles = launches.long_segment_tiles if info.max_len >= launches.long_segment_rows else SGLANG_TILES
        self._launches, self._indices, self._permutation = launches, indices, permutation
        self._sorted_by_adapter, self._scalings, self._bs = sorted_by_adapter, scalings, info.bs
        self._row_tiles = triton.cdiv(info.max_len, tiles.rows)
        self._specialization = (sorted_by_adapter, tuple((t.dtype, _aligned(t)) for t in tensors), tiles)

    def shrink(self, x: torch.Tensor, lora_a: torch.Tensor, num_slices: int) -> torch.Tensor:
        """SGLang's ``sgemm_lora_a_fwd``: ``x @ A[w, :num_slices * r].T`` per row.

        x: ``(tokens, K)``; lora_a: ``(slots, num_slices * max_rank, K)``, x's dtype.
        Returns ``(tokens, num_slices * max_rank)``, x's dtype, packed (slice ``p`` at columns
        ``[p r, (p + 1) r)``), written only for rows of slots of non-zero rank and up to
        ``num_slices * r`` columns; the rest uninitialised (the expands here do not read it).
        """
        tiles, stacked = self.tiles, lora_a.shape[-2]
        shrunk = torch.empty((x.shape[0], stacked), device=x.device, dtype=x.dtype)
        block_n, block_k = tiles.shrink
        ints = (stacked, lora_a.shape[-1], num_slices, *x.stride(), *lora_a.stride(), *shrunk.stride())
        self._launches.shrink.launch(
            (x.dtype, lora_a.dtype, _aligned(x), _aligned(lora_a), ints, self._specialization),
            (self._row_tiles * triton.cdiv(stacked, block_n), self._bs, 1),
            (x, lora_a, shrunk, *ints, *self._indices, self._permutation, self._sorted_by_adapter, tiles.rows, block_n,
             block_k),
        )
        return shrunk

    def expand(
        self, shrunk: torch.Tensor, lora_b: torch.Tensor, output_offset: torch.Tensor, max_slice: int, num_slices: int,
        output: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """The expand of ``num_slices`` output slices, chosen by them: one slice :meth:`expand_one`,
        two of ``max_slice`` columns each :meth:`expand_two`, any other :meth:`expand_bands`
        (reading ``output_offset``), as SGLang's layers choose among its wrappers.

        lora_b: ``(slots, N, max_rank)``, N the slices' widths summed; output_offset:
        ``(num_slices + 1,)`` int32 slice bounds on the device; max_slice: the widest slice. Other
        arguments and the result: :meth:`expand_bands`.
        """
        if num_slices == 1:
            return self.expand_one(shrunk, lora_b, output)
        if num_slices == 2 and 2 * max_slice == lora_b.shape[-2]:
            return self.expand_two(shrunk, lora_b, max_slice, output)
        return self.expand_bands(shrunk, lora_b, output_offset, max_slice, output, num_slices)

    def _expand_common(self, shrunk: torch.Tensor, lora_b: torch.Tensor, output: torch.Tensor) -> tuple:
        """The strides of an expand's tensors and the part of its key they share."""
        strides = (*shrunk.stride(), *lora_b.stride(), *output.stride())
        return strides, (shrunk.dtype, lora_b.dtype, output.dtype, _aligned(shrunk), _aligned(lora_b), _aligned(output),
                         self._specialization)

    def expand_one(self, shrunk: torch.Tensor, lora_b: torch.Tensor, output: Optional[torch.Tensor] = None) -> torch.Tensor:
        """SGLang's ``sgemm_lora_b_fwd``: ``output[:, :N] += scalings[w] * shrunk[:, :r] @ B[w, :, :r].T``
        per row.

        shrunk: ``(tokens, >= r)``; lora_b: ``(slots, N, max_rank)``; output: ``(tokens, >= N)`` (its
        leading N columns), shrunk's dtype, or None for a new zero ``(tokens, N)``. Returns ``output``.
        """
        if output is None:
            output = torch.zeros((shrunk.shape[0], lora_b.shape[-2]), device=shrunk.device, dtype=shrunk.dtype)
        strides, common = self._expand_common(shrunk, lora_b, output)
        out_dim, tiles = lora_b.shape[-2], self.tiles
        block_n, block_k = tiles.expand_one
        ints = (out_dim, lora_b.shape[-1], *strides)
        self._launches.expand_one.launch(
            (ints, common), (self._row_tiles * triton.cdiv(out_dim, block_n), self._bs, 1),
            (shrunk, lora_b, output, *ints, *self._indices, self._permutation, self._sorted_by_adapter, tiles.rows,
             block_n, block_k, self._scalings),
        )
        return output

    def expand_two(
        self, shrunk: torch.Tensor, lora_b: torch.Tensor, slice_size: int, output: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """SGLang's ``gate_up_lora_b_fwd``: two slices of ``slice_size`` columns, slice ``p`` reading
        ``shrunk[:, p r : (p + 1) r]``.

        shrunk: ``(tokens, >= 2 r)``; lora_b: ``(slots, 2 * slice_size, max_rank)``; output:
        ``(tokens, >= 2 * slice_size)``, shrunk's dtype, or None for a new zero one. Returns ``output``.
        """
        if output is None:
            output = torch.zeros((shrunk.shape[0], 2 * slice_size), device=shrunk.device, dtype=shrunk.dtype)
        strides, common = self._expand_common(shrunk, lora_b, output)
        tiles = self.tiles
        block_n, block_k = tiles.expand_bands
        ints = (lora_b.shape[-1], slice_size, *strides)
        self._launches.expand_two.launch(
            (ints, common), (self._row_tiles * triton.cdiv(slice_size, block_n), 2, self._bs),
            (shrunk, lora_b, output, *ints, *self._indices, self._permutation, self._sorted_by_adapter, tiles.rows,
             block_n, block_k, self._scalings),
        )
        return output

    def expand_bands(
        self, shrunk: torch.Tensor, lora_b: torch.Tensor, output_offset: torch.Tensor, max_slice: int,
        output: Optional[torch.Tensor] = None, num_slices: int = 3,
    ) -> torch.Tensor:
        """SGLang's ``qkv_lora_b_fwd`` (``num_slices`` 3 by default, as there): slices of any widths,
        slice ``p`` at output columns ``[output_offset[p], output_offset[p + 1])``, reading
        ``shrunk[:, p r : (p + 1) r]``.

        shrunk: ``(tokens, >= num_slices * r)``; lora_b: ``(slots, output_offset[-1], max_rank)``;
        output_offset: ``(num_slices + 1,)`` int32 on the device (its dtype is part of the key: Triton
        specializes the pointer on it); max_slice: the widest slice; output:
        ``(tokens, >= output_offset[-1])``, shrunk's dtype, or None for a new zero
        ``(tokens, lora_b.shape[-2])``. Returns ``output``.
        """
        if output is None:
            output = torch.zeros((shrunk.shape[0], lora_b.shape[-2]), device=shrunk.device, dtype=shrunk.dtype)
        strides, common = self._expand_common(shrunk, lora_b, output)
        tiles = self.tiles
        block_n, block_k = tiles.expand_bands
        ints = (lora_b.shape[-1], max_slice, *strides)
        self._launches.expand_bands.launch(
            (ints, common, output_offset.dtype, _aligned(output_offset)),
            (self._row_tiles * triton.cdiv(max_slice, block_n), num_slices, self._bs),
            (shrunk, lora_b, output, *ints, *self._indices, output_offset, self._permutation, self._sorted_by_adapter,
             tiles.rows, block_n, block_k, self._scalings),
        )
        return output


class TritonLinearLaunches(TritonLaunches):
    """A backend's launch cache (``IntelXpuLoRABackend.triton_launches``): the launches its per-op
    tier's Triton ops bind to each batch (:meth:`TritonLaunches.batch`), and one LoRA'd linear of
    an eager batch, base GEMM plus LoRA, on SGLang's Triton kernels launched from their compiled
    handles (module docstring).

    Per batch, :meth:`begin_batch` takes SGLang's batch info of the linears (the backend's
    ``_sgemm_info()``); :meth:`forward` then runs each linear with only its own tensors: the
    base GEMM, :meth:`BatchLaunches.shrink`, then :meth:`BatchLaunches.expand` by the layer's output
    slices, adding into the base output in place, through its strides: a layer whose LoRA covers
    only its leading output columns (prefix partitions) gets them there, the others untouched.
    Arguments: :class:`TritonLaunches`.
    """

    def __init__(self, kernels: Optional[types.SimpleNamespace] = None, launches=CompiledLaunches):
        super().__init__(kernels, launches)
        self._batch: Optional[BatchLaunches] = None

    @property
    def tiles(self) -> Optional[Tiles]:
        """The tiles of the current batch's launches (None without a batch)."""
        return None if self._batch is None else self._batch.tiles

    def begin_batch(self, info: LoRABatchInfo) -> None:
        """Take the batch ``info`` (:meth:`TritonLaunches.batch`)."""
        self._batch = self.batch(info)

    def end_batch(self) -> None:
        """Forget the batch (SGLang's idle-forward reset)."""
        self._batch = None

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
        output = base_fn()
        slices = len(offsets) - 1
        widest = offsets[1] if slices == 1 else max(offsets[p + 1] - offsets[p] for p in range(slices))
        batch.expand(batch.shrink(x, lora_a, slices), lora_b, output_offset, widest, slices, output)
        return output if all_reduce is None else all_reduce(output)
