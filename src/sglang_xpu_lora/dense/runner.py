"""The dense tier: one LoRA'd linear as SGLang's ``triton_v2`` runs it, on any device.

:class:`DeviceDenseRunner` is SGLang 0.5.23's ``DenseLoraRunner`` (``srt/lora/dense/runner.py``):
per call it looks up a plan, then ``apply`` runs the base GEMM and the LoRA shrink (grouped
split-K, per-row or all-slots; ``sglang.kernels.ops.lora.common.lora_a``) and expand (grouped or
per-row; ``lora_b``), overlapped as the plan says, and adds LoRA into the base output in place
(``scalings[slot] * (x @ A[slot, :r].T) @ B[slot, :, :r].T`` for each token's slot, at the slot's
real rank ``r``; rows of no adapter or rank 0 untouched), with at most one collective of base + LoRA
for a row-parallel linear at TP > 1. What it replaces, so that it runs off CUDA too:

* the plan source: :class:`~sglang_xpu_lora.dense.plans.PlanTable` (own tables first, then
  SGLang's), instead of SGLang's table alone;
* the expand's slice geometry, built on the layer's device (:mod:`.geometry`) where SGLang's
  ``slice_geometry`` raises off CUDA;
* the aligned route above :data:`SMALL_ROUTE_ROWS` rows: SGLang's pure-Triton large builder
  (``build_route(capacity=0)``) where SGLang would call its CUDA-only JIT alignment kernel;
* the workspace (:class:`~sglang_xpu_lora.dense.workspace.DeviceLoraWorkspace`): capture
  detection and overlap on every device with streams.

And what it adds: a plan row may name :class:`~sglang_xpu_lora.dense.fused.FusedPlan`, the shrink
and expand of a linear in one kernel, per token (:mod:`sglang_xpu_lora.dense.fused`), which
:meth:`DeviceDenseRunner.apply` runs after the base GEMM or beside it into a delta.

Per batch, :meth:`DeviceDenseRunner.begin_lora_batch` maps each token to its adapter slot (-1: no
adapter, or rank 0) from SGLang's request view of the batch (``seg_indptr``, ``weight_indices``,
``lora_ranks``), with SGLang's own ``_compute_token_lora_mapping``; inside graphs into a persistent
buffer (:meth:`DeviceDenseRunner.allocate_graph_token_slots`), padding rows set to -1.
"""

from __future__ import annotations

import torch
from sglang.kernels.ops.lora.common.lora_b import grouped_lora_b, per_row_lora_b
from sglang.kernels.ops.lora.common.route_view import RouteView, RouteViewKind
from sglang.kernels.ops.lora.common.routing import build_route
from sglang.srt.lora.backend.base_backend import _compute_token_lora_mapping
from sglang.srt.lora.dense.plan import BFamily, DensePlan, Overlap
from sglang.srt.lora.dense.runner import Bridge, DenseLoraRunner
from sglang.srt.lora.utils import LoRABatchInfo, Phase

from sglang_xpu_lora.dense.fused import FusedPlan, fused_per_row_lora
from sglang_xpu_lora.dense.geometry import SliceGeometries
from sglang_xpu_lora.dense.plans import PlanTable
from sglang_xpu_lora.dense.workspace import DeviceLoraWorkspace

#: Routed rows up to which SGLang's single-program route builder runs (``_SMALL_ROUTE_MAX_PAIRS``
#: in ``kernels/ops/lora/common/routing.py``); above it the runner asks for the large builder.
SMALL_ROUTE_ROWS = 512


def large_aligned_route(runner: DenseLoraRunner, block_size: int) -> RouteView:
    """The adapter-aligned route of ``runner``'s batch (``runner.token_slots``: ``(tokens,)``
    int32 slot per token, -1 none) in blocks of ``block_size`` rows, from SGLang's pure-Triton large
    builder (``build_route(..., capacity=0)``: any capacity selects it in
    ``kernels/ops/lora/common/routing.py``), where ``DenseLoraRunner._build_route`` would call the
    CUDA-only JIT alignment kernel for more than :data:`SMALL_ROUTE_ROWS` rows. Its tensors live in
    ``runner.workspace`` under the names SGLang's runner gives them."""
    return build_route(
        runner.token_slots, max_loras=runner.max_loras, block_size=block_size, view=RouteViewKind.ALIGNED,
        workspace=runner.workspace, tensor_prefix=f"dense:sorted:{block_size}", capacity=0,
    )


class DeviceDenseRunner(DenseLoraRunner):
    """SGLang's ``DenseLoraRunner`` on any device (module docstring), built as SGLang builds its own:
    ``DeviceDenseRunner(DeviceLoraWorkspace(), max_loras=slots, device=device)``.

    :attr:`plans` is the plan source, by default :class:`PlanTable` for ``device`` (reads
    ``SGLANG_XPU_LORA_PLANS`` and the shipped tables); tests and the plan sweep replace it.

    Raises:
        ValueError: a bad plan table (:func:`~sglang_xpu_lora.dense.plans.read_rows`).
    """

    def __init__(self, workspace: DeviceLoraWorkspace, *, max_loras: int, device: torch.device, architecture=None):
        device = torch.device(device)
        super().__init__(workspace, max_loras=max_loras, device=device, architecture=architecture)
        self.device = device
        self.plans = PlanTable(device, self.architecture)
        self.geometries = SliceGeometries()
        self._graph_token_slots: dict = {}

    def allocate_graph_token_slots(self, tokens: int, *, prefill: bool) -> None:
        """Allocate the persistent token-to-slot buffer of the decode (``prefill`` False) or prefill
        graphs: ``tokens`` int32 entries, -1 at rest. Called at graph set-up, outside capture."""
        buffer = self._graph_token_slots.get(prefill)
        if buffer is None or buffer.numel() < tokens:
            self._graph_token_slots[prefill] = torch.full((tokens,), -1, dtype=torch.int32, device=self.device)

    def begin_lora_batch(self, info: LoRABatchInfo, *, requests: int, num_tokens: int, phase: Phase, graph: bool, prefill_graph: bool = False) -> None:
        """Bind one batch: ``info`` is SGLang's request view (``LoRABatchInfo``: ``seg_indptr``
        ``[requests + 1]`` int32 token offsets per request, ``weight_indices`` ``[requests]`` slot
        per request, ``lora_ranks`` ``[max_loras]`` int32, ``scalings`` ``[max_loras]`` float32,
        ``max_len`` the longest request), ``num_tokens`` the batch's live tokens. Inside graphs
        (``graph``) the token map goes into the persistent buffer, its rows past ``num_tokens``
        set to -1 (graph padding: no adapter).

        Raises:
            RuntimeError: a graph batch larger than the buffer of :meth:`allocate_graph_token_slots`.
        """
        if graph:
            token_slots = self._graph_token_slots.get(prefill_graph)
            if token_slots is None or token_slots.numel() < num_tokens:
                raise RuntimeError(
                    f"dense LoRA graph batch of {num_tokens} tokens: the graphs' token map holds "
                    f"{0 if token_slots is None else token_slots.numel()} (allocate_graph_token_slots at graph set-up)"
                )
            bucket = token_slots.numel()
        else:
            token_slots, bucket = torch.empty((num_tokens,), dtype=torch.int32, device=self.device), None
        _compute_token_lora_mapping(
            num_tokens, info.seg_indptr[: requests + 1], info.lora_ranks, info.weight_indices[:requests],
            token_slots, max_len=max(int(info.max_len), 1), bucket_len=bucket,
        )
        self.begin_batch(
            token_slots=token_slots, lora_ranks=info.lora_ranks, scalings=info.scalings, num_tokens=num_tokens,
            phase=phase, graph_mode=graph, is_prefill_graph=prefill_graph,
        )

    # --- what differs from SGLang's runner -------------------------------------------------------

    def plan_for(self, kind, max_rank: int, in_features: int = 0, out_features: int = 0, *, num_tokens: int):
        """The plan of one call from :attr:`plans` (kind, phase, tokens, pool rank, K, N)."""
        self.set_num_tokens(num_tokens)
        return self.plans.plan_for(kind, self.phase, num_tokens, max_rank, in_features, out_features)

    def _build_route(self, key: tuple) -> RouteView:
        """SGLang's aligned route; above :data:`SMALL_ROUTE_ROWS` rows :func:`large_aligned_route`,
        never the CUDA-only JIT alignment kernel."""
        if key[0] != "sorted" or self.token_slots.numel() <= SMALL_ROUTE_ROWS:
            return super()._build_route(key)
        return large_aligned_route(self, key[1])

    def run_b(
        self, bridge: Bridge, b: torch.Tensor, out: torch.Tensor, *, offsets: tuple, plan,
        add_inplace: bool = True, lora_ranks=None, scalings=None, bridge_slices: int = 0,
    ) -> torch.Tensor:
        """SGLang's expand (``DenseLoraRunner.run_b``) with the geometry built on ``b``'s device.

        ``bridge``: the shrink's output; ``plan``: SGLang's ``DensePlan`` (its expand family, tiles
        and route block); ``b``: ``(slots, offsets[-1], max_rank)``; ``out``:
        ``(tokens, >= offsets[-1])``, added into in place (``add_inplace``) or overwritten on the
        LoRA rows. Returns ``out``.
        """
        geometry = self.geometries.get(tuple(offsets), int(plan.b_tiles["BLOCK_SIZE_N"]), b.device)
        common = dict(
            geometry=geometry, config=plan.b_tiles, add_inplace=add_inplace, zero_sentinel=False,
            lora_ranks=self.lora_ranks if lora_ranks is None else lora_ranks,
            scalings=self.scalings if scalings is None else scalings,
            planes=bridge.planes, bridge_slices=bridge_slices,
        )
        if plan.b_family is BFamily.GROUPED:
            grouped_lora_b(bridge.tensor, b, out, self.route(plan.block_size), **common)
        else:
            per_row_lora_b(bridge.tensor, b, out, self.raw_route(), slot_planes=bridge.slot_planes, **common)
        return out

    def apply(self, x: torch.Tensor, base_fn, plan, *, a: torch.Tensor, b: torch.Tensor, offsets: tuple, all_reduce=None, **options) -> torch.Tensor:
        """Base output plus LoRA for one linear: SGLang's ``DenseLoraRunner.apply`` for a
        ``DensePlan``; for a :class:`~sglang_xpu_lora.dense.fused.FusedPlan`, its fused kernel
        (:mod:`sglang_xpu_lora.dense.fused`) after ``base_fn()`` into its output (overlap ``none``),
        or on the side stream into a zeroed delta that is added after the base GEMM (``ab_delta``, as
        SGLang's ``ab_delta`` adds its delta).

        ``x``: ``(tokens, K)``; ``a``: ``(slots, slices * max_rank, K)``; ``b``: ``(slots,
        offsets[-1], max_rank)``; ``offsets``: host ints, the output slices' bounds; ``all_reduce``:
        applied once to base + LoRA (row-parallel linears at TP > 1; B is replicated, and the fused
        kernel is linear in each rank's partial shrink, so the sum over ranks is the full result).
        ``options``: SGLang's other keywords (ranks and scalings overrides, bridge sharing,
        windowed or embedding shrinks), passed on for a ``DensePlan``.

        Raises:
            NotImplementedError: ``options`` with a fused plan (it serves plain linears only).
        """
        if not isinstance(plan, FusedPlan):
            return super().apply(x, base_fn, plan, a=a, b=b, offsets=offsets, all_reduce=all_reduce, **options)
        # SGLang's defaults (None, 0, False) mean "not given"; a tensor is always given.
        given = sorted(name for name, value in options.items() if not (value is None or (type(value) in (bool, int) and not value)))
        if given:
            raise NotImplementedError(f"a fused LoRA plan serves plain linears; it does not take {given}")
        self.set_num_tokens(x.shape[0])
        geometry = self.geometries.get(tuple(offsets), int(plan.tiles["BLOCK_SIZE_N"]), b.device)

        def lora_into(out: torch.Tensor, add_inplace: bool) -> torch.Tensor:
            return fused_per_row_lora(
                x, a, b, out, self.token_slots, lora_ranks=self.lora_ranks, scalings=self.scalings,
                geometry=geometry, tiles=plan.tiles, add_inplace=add_inplace,
            )

        if plan.overlap is Overlap.AB_DELTA:
            delta = self.workspace.tensor("dense:delta", (x.shape[0], offsets[-1]), dtype=x.dtype, device=x.device)
            delta.zero_()  # rows of no adapter are not written
            base = self.workspace.run_parallel(name="dense", device=x.device, compute=base_fn, side=lambda: lora_into(delta, False))
            base[:, : offsets[-1]].add_(delta)
        else:
            base = lora_into(base_fn(), True)
        return all_reduce(base) if all_reduce is not None else base
