"""The routes of one backend's current batch (:class:`RouteTable`): a
:class:`~sglang_xpu_lora.backend.batch_routes.BatchRoute` per batch info, built once per batch,
with what the routes share across batches (the persistent band offsets, whose addresses captured
graphs read).

Nothing of a batch is process state: each ``IntelXpuLoRABackend`` owns its table (target and draft
under speculative decoding keep their own), and state built while a graph is being captured is
that graph's, kept apart from eager state. The compiled kernels of the Triton ops are the
backend's too: its launch cache, passed in with its op selection, which each route's Triton ops
launch through.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Optional

import torch

from sglang_xpu_lora.backend.batch_routes import CONTIGUOUS_ROUTE_OPS, MULTI_SLICE_EXPANDS, PERMUTED_ROUTE_OPS, BatchRoute
from sglang_xpu_lora.providers import OpSelection
from sglang_xpu_lora.providers.graph_capture import capturing

if TYPE_CHECKING:
    from sglang.srt.lora.utils import LoRABatchInfo

    from sglang_xpu_lora.providers.triton_launch import TritonLaunches


class RouteTable:
    """The routes of the current batch on ``device``, keyed by batch info; the op selection and the
    launch cache (a :class:`~sglang_xpu_lora.providers.triton_launch.TritonLaunches`, None where the
    selection launches through none) are the backend's, passed in by each call that builds a route.

    Attributes:
        routes: ``id(batch info)`` -> its route in this batch (a route holds its info, so the ids
            stay unique).
        last_info, last_route: the batch info of the last route used and that route: the
            backend's ``run_*`` methods call :meth:`route` only for another batch info, so a
            layer's calls do no lookup.
        kept_uniform_offsets: ``(num_slices, slice_size)`` -> persistent ``[0, n, 2n, ...]`` int32.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.routes: dict = {}
        self.last_info: Optional[LoRABatchInfo] = None
        self.last_route: Optional[BatchRoute] = None
        self.kept_uniform_offsets: dict = {}

    def start_batch(
        self, infos: Iterable[LoRABatchInfo], selection: OpSelection, launches: Optional[TritonLaunches],
        build_now: bool = True,
    ) -> None:
        """Once per batch: forget the last batch's routes and, with ``build_now``, build the route of
        each of ``infos`` (bound ops), so the ``run_*`` calls only call their ops. Eager batches (``build_now`` False) build each route at its first use instead
        (:meth:`route`): no graph capture can be under way for them, and a decode batch's request
        view, which no LoRA module reads, then costs nothing. Graph batches build them all here,
        before any capture."""
        self.routes, self.last_info, self.last_route = {}, None, None
        if build_now:
            for info in infos:
                self.routes[id(info)] = self.make_route(info, selection, launches)

    def route(self, info: LoRABatchInfo, selection: OpSelection, launches: Optional[TritonLaunches]) -> BatchRoute:
        """The route prepared for ``info`` in this batch, or one built now (an eager batch's info at
        its first use, a view made later: same slots, same ranks); remembered as the last route."""
        route = self.routes.get(id(info))
        if route is None:
            route = self.routes[id(info)] = self.make_route(info, selection, launches)
        self.last_info, self.last_route = info, route
        return route

    def make_route(self, info: LoRABatchInfo, selection: OpSelection, launches: Optional[TritonLaunches]) -> BatchRoute:
        """The route of ``info``: its table's ops bound to it (SGLang's Triton kernels read the
        batch info as is: real ranks on the packed pool; they launch through ``launches``) and the
        expands that read spaced slices."""
        use_graph = info.use_cuda_graph
        names = PERMUTED_ROUTE_OPS if info.permutation is not None else CONTIGUOUS_ROUTE_OPS
        spaced = frozenset(op for op in MULTI_SLICE_EXPANDS if op in names and selection.reads_spaced_slices(op, use_graph))
        ops = selection.bind_batch(use_graph, info, self.uniform_offsets, names, launches)
        return BatchRoute(info, ops, spaced)

    def uniform_offsets(self, num_slices: int, slice_size: int) -> torch.Tensor:
        """``[0, n, 2n, ...]`` int32 on the device, built once per ``(num_slices, slice_size)`` and
        kept (a captured graph reads its address). Built during a capture (never before in eager),
        it is recorded in that graph and not kept, since its values exist only once the graph runs."""
        offsets = self.kept_uniform_offsets.get((num_slices, slice_size))
        if offsets is None:
            offsets = torch.arange(num_slices + 1, dtype=torch.int32, device=self.device) * slice_size
            if not capturing(offsets.device):
                self.kept_uniform_offsets[(num_slices, slice_size)] = offsets
        return offsets
