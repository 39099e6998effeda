"""``IntelXpuLoRABackend``: SGLang's Triton LoRA batch bookkeeping, the selected providers' LoRA math.

SGLang hands every LoRA'd layer to the backend in one call, ``forward_with_base`` (its layers in
``srt/lora/layers.py``); behind it are two tiers (:meth:`IntelXpuLoRABackend.forward_with_base`):

* the **dense tier** (:mod:`sglang_xpu_lora.dense`): SGLang's ``triton_v2`` kernels per linear,
  overlapped with the base GEMM, plans from a table per device family, for the linears of graph
  batches and of eager batches from ``SGLANG_XPU_LORA_EAGER_DENSE_MIN_TOKENS`` tokens, wherever the
  selection names SGLang's Triton kernels (:meth:`IntelXpuLoRABackend.dense_serves`);
* the **compiled-handle launches** (:mod:`sglang_xpu_lora.providers.triton_launch`): the linears
  of smaller eager batches, on the same selection, on SGLang's legacy Triton kernels as its
  ``triton`` backend launches them (longer row tiles for long segments), each launch straight to
  the compiled kernel;
* the **per-op tier**, described below: the layer's ``apply_lora`` calls the ``run_*`` methods,
  each routed to one op of the provider selected for it; it serves everything else (the embedding,
  lm_head, native and portable ops; its Triton ops launch as the linears above do, through the
  same launch cache: one per backend, ``IntelXpuLoRABackend.triton_launches``).

At TP > 1 each makes one collective of base + LoRA per row-parallel linear.

The class inherits from SGLang 0.5.23's ``TritonLoRABackend`` everything that is not math:
``prepare_lora_batch`` (per-request segments for extend, TARGET_VERIFY through
``spec_info.draft_token_num``, per-slot routing with a permutation for decode), decode and prefill
graph batch-info initialisation (prefill slots sized by ``max_num_requests``), lm_head pruning and
pass routing. It overrides every ``run_*`` method to route each call to one op of the provider
selected for it (:mod:`sglang_xpu_lora.providers`): native sgl-kernel-xpu, SGLang's own Triton
kernels, or the portable PyTorch ops. The only data movement is placing a prefix-partition
layer's result into its leading output columns
(:func:`~sglang_xpu_lora.backend.module_ops.onto_leading_columns`) and, before a native or
portable multi-slice expand, moving the shrink output's slices to ``p * max_lora_rank`` (the batch
route's slice gather: one per layer, its index built once per batch).

The class is the table of contents; each job has its module:

* which provider runs each op: :mod:`sglang_xpu_lora.providers` (``select_ops``), logged once
  built (:mod:`.log_line`);
* graph set-up: the trial captures that decide which ops run natively inside graphs
  (:mod:`.graph_setup`);
* the pool check: :func:`sglang_xpu_lora.patches.mem_pool.require_zeroed_slots`, with the pool
  patch that zeroes the slots;
* per-batch routing: :mod:`.route_table` (the routes of the current batch) and
  :mod:`.batch_routes` (one route: the bound ops a module calls);
* the ``run_*`` ops: one route call each, the stacked projections in :mod:`.module_ops`.

Pool layout: SGLang's packed one for every provider (stacked LoRA-A slice ``p`` at row ``p * r``),
and every provider gets each slot's real rank (SGLang's Triton kernels read only ``[0, r)``). The
native and portable ops contract over the full ``max_lora_rank``, so when one is selected
(:attr:`needs_zeroed_slots`) the plugin's pool patch zeroes each slot before it is loaded.

What this backend does not compute: SGLang runs LoRA on MoE experts and the absorbed-MLA
``kv_b_proj`` correction itself, with its own Triton kernels, whatever ``SGLANG_XPU_LORA_KERNELS``
says; :meth:`IntelXpuLoRABackend.validate_lora_targets` names them when a model has them and
refuses them on a device without Triton (:mod:`sglang_xpu_lora.backend.outside_lora_math`).

Per-op work is prepared once per batch (:mod:`sglang_xpu_lora.backend.batch_routes`): each
``run_*`` call looks up the :class:`~sglang_xpu_lora.backend.batch_routes.BatchRoute` of its batch
info and calls its module callables (the table's ops bound to the batch, the slice gather decided
per route), passing only the module's tensors and host integers.

Routing (``info = self._sgemm_info(...)``):

* ``info.permutation is None`` (extend, TARGET_VERIFY, lm_head, contiguous segments): the prefill
  ops ``sgemm_lora_a_fwd``, ``sgemm_lora_b_fwd``, ``qkv_lora_b_fwd`` (exactly 3 slices) and
  ``gate_up_lora_b_fwd``.
* a permutation (decode, tokens grouped by slot): ``chunked_sgmv_lora_shrink_fwd`` /
  ``chunked_sgmv_lora_expand_fwd``.
* ``run_qkv_lora`` with ``n_slices != 3`` (DeepSeek MLA ``fused_qkv_a_proj_with_mqa``: 2, GDN
  ``in_proj_qkvz``: 4): chunked expand, with ``permutation=None`` for contiguous batches.
* prefix-partition layers (LoRA on the first output partitions only: Mamba2 ``in_proj``, LFM2
  ``in_proj``): the same ops over the leading columns of ``base_output``, the others untouched,
  as SGLang's Triton kernels do.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from sglang.srt.lora.backend.triton_backend import TritonLoRABackend
from sglang.srt.lora.dense.plan import DenseLoraKind
from sglang.srt.lora.utils import LoRABatchInfo, Phase
from sglang.srt.runtime_context import LoRABatchLayout

from sglang_xpu_lora.backend.batch_routes import BatchRoute
from sglang_xpu_lora.backend.graph_setup import TrialCaptures
from sglang_xpu_lora.backend.log_line import built_line
from sglang_xpu_lora.backend.module_ops import gate_up_projection, stacked_projection
from sglang_xpu_lora.backend.outside_lora_math import outside_lora_math
from sglang_xpu_lora.backend.route_table import RouteTable
from sglang_xpu_lora.dense.runner import DeviceDenseRunner
from sglang_xpu_lora.dense.workspace import DeviceLoraWorkspace, fork_join_captures
from sglang_xpu_lora.patches.mem_pool import require_zeroed_slots
from sglang_xpu_lora.providers import SelectionLog, select_ops, triton_support
from sglang_xpu_lora.providers.batch_binding import batch_arguments
from sglang_xpu_lora.providers.triton_launch import TritonLinearLaunches
from sglang_xpu_lora.settings import EAGER_DENSE_MIN_TOKENS_ENV, env_count


logger = logging.getLogger(__name__)

#: Outside graphs, batches of at least this many tokens run their linears on the dense tier; smaller
#: ones on the compiled-handle launches or the per-op tier (:meth:`IntelXpuLoRABackend.dense_serves`);
#: ``SGLANG_XPU_LORA_EAGER_DENSE_MIN_TOKENS`` overrides it. On an H200 (layer benchmark, prefill,
#: 2026-12-04) the dense tier took 0.88-0.94x the launches' layer time at 2048 tokens and rank 64,
#: 1.00-1.09x at rank 16, and 1.2-2.5x at 512 tokens (host-bound): ``layer-cuda-prefill-dense-everywhere.json``
#: against ``layer-cuda-prefill-triton-v2-large-run*.json`` in ``benchmarks/results/layer-cuda-runs/``.
EAGER_DENSE_MIN_TOKENS = 2048


def eager_dense_min_tokens() -> int:
    """From how many tokens an eager batch runs its linears on the dense tier: the validated
    ``SGLANG_XPU_LORA_EAGER_DENSE_MIN_TOKENS``, else :data:`EAGER_DENSE_MIN_TOKENS`.

    Raises:
        ValueError: for anything but a positive integer (:func:`~sglang_xpu_lora.settings.env_count`).
    """
    return env_count(EAGER_DENSE_MIN_TOKENS_ENV, EAGER_DENSE_MIN_TOKENS)


class IntelXpuLoRABackend(TritonLoRABackend):
    """Multi-LoRA backend for Intel XPU: sgl-kernel-xpu ops, SGLang's Triton kernels where those are
    missing or not capture-safe, portable PyTorch ops where neither runs.

    Requirements, declared in :data:`sglang_xpu_lora.backend.registration.INTEL_XPU`: device
    ``xpu`` unless ``SGLANG_XPU_LORA_KERNELS=torch`` (or the selected ops run on the device: a
    kernel build with CPU implementations, as the test emulator, or Triton), and, when a native or
    portable op is selected, pool slots zeroed before each load (zero rank tails), which the
    plugin's pool patch provides for managers that use this backend (:attr:`needs_zeroed_slots`).

    ``supports_dp_attention = False``: with DP attention SGLang routes TP-global sections through
    token-level global batch infos gathered across DP ranks; SGLang's XPU graph runner does not
    support DP-attention graphs (it asserts there is no gathered buffer) and that path has not been
    verified with these kernels, so ``LoRAManager`` rejects ``--enable-dp-attention`` at start-up
    rather than serving through an unverified route. ``supports_prefill_cuda_graph`` stays True
    (inherited): inside graphs every op runs on a capture-safe provider (a native op that a trial
    capture at graph set-up accepted, SGLang's Triton kernels, or the portable ops;
    :attr:`op_selection`, :meth:`_decide_graph_ops`).
    """

    name = "intel_xpu"
    supports_dp_attention = False
    #: A batch in which no row names an adapter runs the base layers alone: SGLang's layers skip
    #: ``forward_with_base`` when ``LoRABatchInfo.has_active_lora`` is False (``lora_active`` in
    #: ``srt/lora/layers.py``), and the decode graph runner records a second, ``nolora`` graph per
    #: batch size and replays it for such batches (``record_nolora_graph``), as for ``triton_v2``.
    skip_inactive_dense_lora = True

    def __init__(self, max_loras_per_batch: int, device: torch.device, **kwargs):
        super().__init__(max_loras_per_batch, device, **kwargs)
        #: What this backend logged of its selections (each line once per backend).
        self.selection_log = SelectionLog()
        #: Which provider runs each op, outside and inside graphs (raises for an unusable choice).
        self.op_selection = select_ops(device, log=self.selection_log)
        #: Trial captures at graph set-up and their verdicts (:mod:`sglang_xpu_lora.backend.graph_setup`).
        self.trial_captures = TrialCaptures()
        #: This backend's launch cache: SGLang's legacy Triton kernels launched from their compiled
        #: handles, kept across batches (:mod:`sglang_xpu_lora.providers.triton_launch`), through
        #: which the per-op tier's Triton ops (bound with it to each batch: :attr:`routes`) and the
        #: linears of eager batches below the dense tier's threshold (:meth:`forward_with_base`)
        #: launch; None where the selection never runs those kernels (trial captures at graph
        #: set-up move ops from them to native ones, never onto them).
        self.triton_launches = TritonLinearLaunches() if self.op_selection.uses_launch_cache else None
        #: The routes of the current batch (:mod:`sglang_xpu_lora.backend.route_table`).
        self.routes = RouteTable(self.device)
        #: The memory pool of the ``LoRAManager`` that built this backend, handed over by the
        #: plugin's pool hook (:meth:`use_memory_pool`); None until then.
        self.lora_memory_pool = None
        self._pool_check_pending = False
        #: The dense tier (:mod:`sglang_xpu_lora.dense`): SGLang's ``triton_v2`` kernels behind
        #: :meth:`forward_with_base`, for the linears of batches whose shrink the selection gives to
        #: SGLang's Triton kernels (:meth:`dense_serves`); None where the selection never does.
        self.dense = (
            DeviceDenseRunner(DeviceLoraWorkspace(), max_loras=max_loras_per_batch, device=self.device)
            if self._dense_tier_selected() else None
        )
        if self.dense is not None:  # off CUDA decided by a trial capture at graph set-up
            self.dense.workspace.overlap_in_graphs = torch.device(self.device).type == "cuda"
        #: Whether the current batch's linears run on the dense tier, or on :attr:`triton_launches`
        #: (set per batch; both False: the per-op tier).
        self.dense_batch = self.launch_batch = False
        #: From how many tokens an eager batch runs on the dense tier (:meth:`dense_serves`).
        self.eager_dense_min_tokens = eager_dense_min_tokens()
        logger.info("%s", built_line(self.name, device, self.op_selection, self.dense))

    # --- the pool layout this backend's ops need -----------------------------------------------

    @property
    def needs_zeroed_slots(self) -> bool:
        """Whether pool slots must be zeroed before each load: an op of the selection contracts
        over the full ``max_lora_rank`` (:attr:`~sglang_xpu_lora.providers.OpSelection.needs_zeroed_slots`);
        what the plugin's pool patch asks through the spec (``INTEL_XPU.needs_zeroed_lora_slots``)."""
        return self.op_selection.needs_zeroed_slots

    def use_memory_pool(self, pool) -> None:
        """Take the ``LoRAMemoryPool`` of the manager that built this backend (called by the
        plugin's pool hook through the spec's ``receives_memory_pool``): checked before the first
        batch (:meth:`_check_memory_pool`), and the rank and dtype of the trial captures."""
        self.lora_memory_pool = pool

    def validate_lora_targets(self, base_model: torch.nn.Module, target_modules: set) -> None:
        """Name the LoRA math SGLang runs itself for these targets, and arm the pool check.

        Called by SGLang's ``LoRAManager.init_state`` before it wraps the layers. LoRA on MoE
        experts and the absorbed-MLA ``kv_b_proj`` correction never reach this backend's ops
        (:mod:`sglang_xpu_lora.backend.outside_lora_math`): they are logged once, so nobody reads
        ``SGLANG_XPU_LORA_KERNELS`` as covering them, and refused where SGLang's Triton kernels
        cannot run. The pool is built right after this call; from here on this backend serves only
        once it has checked that pool (:meth:`_check_memory_pool`, at the first batch or graph
        set-up).

        Raises:
            ValueError: LoRA targets SGLang would compute with Triton on a device without Triton.
        """
        super().validate_lora_targets(base_model, target_modules)
        outside = outside_lora_math(base_model, target_modules)
        if outside and not triton_support(self.device)[0]:
            raise ValueError(
                f"--lora-backend {self.name} on {torch.device(self.device).type}: "
                f"{'; '.join(outside)}, not in this backend's ops, and Triton does not run on this device. "
                "Serve on xpu, or use adapters without those target modules."
            )
        for what in outside:
            logger.info("%s: %s, not in this backend's ops (SGLANG_XPU_LORA_KERNELS does not apply)", self.name, what)
        self._pool_check_pending = True

    def _check_memory_pool(self) -> None:
        """Refuse to serve on a pool without the layout this backend's ops need.

        The earliest point the pool can be seen from here: SGLang builds the pool after the
        backend (``LoRAManager.__init__`` -> ``init_state``) and hands it to no backend method, so
        the check runs at the first ``prepare_lora_batch`` (or graph batch-info set-up) after
        :meth:`validate_lora_targets`. Zeroed slots are needed when any selected op contracts over
        the full ``max_lora_rank`` (``needs_zeroed_slots``, from the op selection); a no-op once
        checked. The pool patch says whether the pool zeroes them, on proof from both its hooks
        (:func:`~sglang_xpu_lora.patches.mem_pool.require_zeroed_slots`);
        ``Engine(lora_backend="intel_xpu")`` reaches this class without argparse, so this is the
        one check between a missing hook and wrong numbers.

        Raises:
            RuntimeError: naming what is missing and how to find out why (:func:`require_zeroed_slots`).
        """
        if not self._pool_check_pending:
            return
        if self.needs_zeroed_slots:
            require_zeroed_slots(self.lora_memory_pool, self.name)
        self._pool_check_pending = False

    def init_decode_cuda_graph_batch_info(self, max_bs_in_cuda_graph: int, num_tokens_per_req: int):
        """SGLang's Triton decode-graph batch info, after the pool check and the trial captures
        that decide which native ops run inside graphs (:meth:`_decide_graph_ops`)."""
        self._check_memory_pool()
        self._decide_graph_ops(max_bs_in_cuda_graph * num_tokens_per_req)
        super().init_decode_cuda_graph_batch_info(max_bs_in_cuda_graph, num_tokens_per_req)
        self._set_up_dense_graphs(max_bs_in_cuda_graph * num_tokens_per_req, prefill=False)

    def init_prefill_cuda_graph_batch_info(self, max_num_tokens: int, max_num_requests: Optional[int] = None):
        """SGLang's Triton prefill-graph batch info (slots sized by ``max_num_requests``), after
        the pool check and the trial captures (:meth:`_decide_graph_ops`)."""
        self._check_memory_pool()
        self._decide_graph_ops(max_num_tokens)
        super().init_prefill_cuda_graph_batch_info(max_num_tokens, max_num_requests)
        self._set_up_dense_graphs(max_num_tokens, prefill=True)

    def _set_up_dense_graphs(self, tokens: int, *, prefill: bool) -> None:
        """The dense tier's graph set-up: its persistent token map for ``tokens`` rows and, off
        CUDA, whether its base-GEMM overlap may fork inside graphs (a trial capture,
        :func:`~sglang_xpu_lora.dense.workspace.fork_join_captures`; SGLang's own ``triton_v2``
        captures it on CUDA)."""
        if self.dense is None:
            return
        self.dense.allocate_graph_token_slots(tokens, prefill=prefill)
        device = torch.device(self.device)
        if device.type != "cuda":
            self.dense.workspace.overlap_in_graphs = fork_join_captures(device)

    def _decide_graph_ops(self, tokens: int) -> None:
        """Decide by trial captures sized like this graph set-up (``tokens``) which ops the
        selection would run inside graphs by trial do (:meth:`TrialCaptures.decide`), and rebuild
        the op selection from the verdicts."""
        self.op_selection = self.trial_captures.decide(
            self.op_selection, self.device, tokens, self.max_loras_per_batch, self.lora_memory_pool, self.selection_log
        )

    # --- batch preparation ---------------------------------------------------------------------

    def prepare_lora_batch(self, forward_batch, weight_indices, lora_ranks, scalings, use_cuda_graph, use_prefill_cuda_graph=False):
        """SGLang's Triton batch preparation, then the kernels' index contract, once per batch.

        Also starts the batch's routes (:meth:`RouteTable.start_batch`: ops bound to the batch, with the
        portable ops' routing cache and the slice-spacing indices of this batch), so what depends
        only on the batch is computed once per batch rather than once per op; everything of the
        batch lives on this backend's routes, the compiled Triton kernels in its
        :attr:`triton_launches`, nothing in the process. The first batch after the
        manager built its pool checks the pool first (:meth:`_check_memory_pool`).
        """
        self._check_memory_pool()
        super().prepare_lora_batch(
            forward_batch, weight_indices, lora_ranks, scalings, use_cuda_graph,
            use_prefill_cuda_graph=use_prefill_cuda_graph,
        )
        self._int32_lora_ranks()
        graph = use_cuda_graph or use_prefill_cuda_graph
        self.routes.start_batch(self._batch_infos(), self.op_selection, self.triton_launches, build_now=graph)
        self.dense_batch = self.dense_serves(graph, self.batch_info.expected_tokens)
        self._begin_linear_launches(graph)
        if self.dense_batch:
            info = self.batch_info
            self.dense.begin_lora_batch(
                info, requests=info.num_segments, num_tokens=info.expected_tokens,
                phase=Phase.PREFILL if forward_batch.forward_mode.is_extend() else Phase.DECODE,
                graph=graph, prefill_graph=use_prefill_cuda_graph,
            )

    def _dense_tier_selected(self) -> bool:
        """Whether the selection puts the linears on the dense tier in either mode."""
        return any(self.op_selection.dense_tier_serves(use_graph) for use_graph in (False, True))

    def dense_serves(self, use_graph: bool, tokens: int) -> bool:
        """Whether the linears of a batch of ``tokens`` rows outside (``use_graph`` False) or inside
        graphs run on the dense tier: where the selection would run SGLang's Triton kernels
        (:meth:`~sglang_xpu_lora.providers.OpSelection.dense_tier_serves`; the native and portable
        ops stay per op), inside graphs always,
        outside them from :attr:`eager_dense_min_tokens` rows on (:data:`EAGER_DENSE_MIN_TOKENS`
        unless ``SGLANG_XPU_LORA_EAGER_DENSE_MIN_TOKENS`` says otherwise; below it the linears run on
        :attr:`triton_launches`, SGLang's legacy Triton kernels launched from compiled handles, with
        far less host work per launch: on an H200, with the dense tier in every eager batch, it took
        1.1-2.2x the best peer's layer time at 512 prefill tokens and 2.6-3.4x in eager decode
        (``benchmarks/results/layer-cuda-runs/layer-cuda-dense-everywhere.json``), and at 8192
        tokens 0.55-0.96x (``benchmarks/results/layer-cuda.json``; docs/performance.md)."""
        if self.dense is None or not self.op_selection.dense_tier_serves(use_graph):
            return False
        return use_graph or tokens >= self.eager_dense_min_tokens

    def reset_routing_cache(self) -> None:
        """SGLang's per-forward route reset (before every graph warm-up and capture forward), for the
        dense tier's routes too."""
        super().reset_routing_cache()
        if self.dense is not None:
            self.dense.reset_routes()

    def _begin_linear_launches(self, graph: bool) -> None:
        """Give this batch's linears to :attr:`triton_launches` where it serves them: an eager batch
        (``graph`` False) that is not a dense batch, on a selection that gives eager linears to
        SGLang's Triton kernels."""
        self.launch_batch = self.op_selection.dense_tier_serves(False) and not graph and not self.dense_batch
        if self.launch_batch:
            self.triton_launches.begin_batch(self._sgemm_info())

    def reset_batch_state(self):
        """SGLang's idle-forward reset; no batch for the dense tier or the linear launches either."""
        super().reset_batch_state()
        self.dense_batch = self.launch_batch = False
        if self.triton_launches is not None:
            self.triton_launches.end_batch()

    def prepare_lora_token_segments(self, **kwargs) -> None:
        """SGLang's explicit token segments (UNO speculative path), then the index contract."""
        self._check_memory_pool()
        super().prepare_lora_token_segments(**kwargs)
        self._int32_lora_ranks()
        self.routes.start_batch(self._batch_infos(), self.op_selection, self.triton_launches)
        self.dense_batch = False  # explicit segments: not the dense tier
        self._begin_linear_launches(graph=False)

    def _batch_infos(self) -> list:
        """This batch's distinct batch infos (request view, sgemm routing view, lm_head views)."""
        infos = [self.batch_info, self.sgemm_batch_info, self.lm_head_batch_info, *(self.lm_head_pass_batch_infos or ())]
        return list({id(info): info for info in infos if info is not None}.values())

    def _int32_lora_ranks(self) -> None:
        """SGLang's eager paths make ``lora_ranks`` int64 (its graph buffers are int32); the
        sgl-kernel-xpu embedding op reads int32 as passed. Convert every batch info of this batch
        once here rather than cast in every layer."""
        converted = {}
        for info in self._batch_infos():
            if info.lora_ranks.dtype != torch.int32:
                key = id(info.lora_ranks)
                if key not in converted:
                    converted[key] = info.lora_ranks.to(torch.int32)
                info.lora_ranks = converted[key]

    def _route(self, info: LoRABatchInfo) -> BatchRoute:
        """The route of ``info`` in this batch (:meth:`RouteTable.route`); the ``run_*`` methods
        call this only for another batch info than the last one
        (``routes.last_route if info is routes.last_info else self._route(info)``)."""
        return self.routes.route(info, self.op_selection, self.triton_launches)

    # --- SGLang BaseLoRABackend API --------------------------------------------------------

    def forward_with_base(
        self, layer, x, base_fn, lora_a, lora_b, output_offset, offsets, *, all_reduce=None,
        kind=DenseLoraKind.LINEAR, pruned_batch_info=None,
    ) -> torch.Tensor:
        """Base layer plus LoRA: SGLang's single entry for every LoRA'd layer (``srt/lora/layers.py``).

        x: ``(tokens, K)`` activations (token ids for the embedding); ``base_fn()`` the base layer's
        output ``(tokens, >= offsets[-1])``; ``lora_a`` ``(slots, stack * max_rank, K)``; ``lora_b``
        ``(slots, offsets[-1], max_rank)``; ``offsets`` host ints, the output slices' bounds.
        ``all_reduce`` (row-parallel linears at TP > 1): applied once, to base + LoRA (B is
        replicated, so the sum over ranks of each rank's ``base + B(A x)`` is the full result).

        Linears of a dense batch (:attr:`dense_batch`) run on the dense tier (SGLang's ``triton_v2``
        kernels, plan per call, overlapped with the base GEMM: :mod:`sglang_xpu_lora.dense`), those
        of a launch batch (:attr:`launch_batch`) on :attr:`triton_launches`; the embedding, lm_head
        (with its ``pruned_batch_info``, read by the layer) and every other batch run the layer's
        ``apply_lora``, i.e. the per-op ``run_*`` methods below.
        """
        if kind == DenseLoraKind.LINEAR:
            if self.launch_batch:
                return self.triton_launches.forward(x, base_fn, lora_a, lora_b, output_offset, offsets, all_reduce)
            if self.dense_batch:
                dense = self.dense
                plan = dense.plan_for(kind, lora_b.shape[-1], lora_a.shape[-1], offsets[-1], num_tokens=x.shape[0])
                return dense.apply(x, base_fn, plan, a=lora_a, b=lora_b, offsets=offsets, all_reduce=all_reduce)
        output = layer.apply_lora(base_fn(), x)
        return output if all_reduce is None else all_reduce(output)

    def run_lora_a_embedding(
        self,
        input_ids: torch.Tensor,
        weights: torch.Tensor,
        vocab_size: int,
        extra_embeddings: Optional[torch.Tensor] = None,
        *args,
        **kwargs,
    ) -> torch.Tensor:
        """LoRA-A embedding lookup. input_ids: (s,); weights: (L, R, vocab) -> (s, R).

        Uses the per-request view (DP-local), or in a prefill graph the fixed 16-token chunk view,
        as the Triton backend does. ``max_len`` (a host integer that sizes the XPU kernel's grid)
        comes from capture-safe bounds inside graphs: the captured per-request width for decode
        and TARGET_VERIFY graphs, the chunk size or the graph's token cap for prefill graphs.
        """
        info = self.get_batch_info(LoRABatchLayout.DP_LOCAL)
        max_len = info.max_len
        if info is self.prefill_cuda_graph_batch_info:
            if self.sgemm_batch_info is not None:
                info = self.sgemm_batch_info
                max_len = info.max_len
            else:
                max_len = self.prefill_cuda_graph_max_tokens
        return self.op_selection.for_graph(info.use_cuda_graph).embedding_lora_a_fwd(
            input_ids=input_ids,
            weights=weights,
            vocab_size=vocab_size,
            extra_embeddings=extra_embeddings,
            max_len=max_len,
            **batch_arguments("embedding_lora_a_fwd", info),
        )

    def run_lora_a_sgemm(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        pruned_batch_info: Optional[LoRABatchInfo] = None,
        stack_num: int = 1,
        *args,
        **kwargs,
    ) -> torch.Tensor:
        """Shrink. x: (s, K); weights: (L, stack_num * R, K) -> (s, stack_num * R), x's dtype."""
        info, routes = self._sgemm_info(pruned_batch_info), self.routes
        return (routes.last_route if info is routes.last_info else self._route(info)).shrink(x, weights, stack_num)

    def run_lora_b_sgemm(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        base_output: Optional[torch.Tensor] = None,
        pruned_batch_info: Optional[LoRABatchInfo] = None,
        *args,
        **kwargs,
    ) -> torch.Tensor:
        """Expand. x: (s, R); weights: (L, N, R) -> scalings * x @ B^T (+ base_output): (s, N).

        ``output_offset`` / ``output_offset_cpu`` from the layers are not needed: one slice
        spans all ``N`` output columns.
        """
        info, routes = self._sgemm_info(pruned_batch_info), self.routes
        return (routes.last_route if info is routes.last_info else self._route(info)).expand(x, weights, base_output)

    def run_qkv_lora(
        self,
        x: torch.Tensor,
        qkv_lora_a: torch.Tensor,
        qkv_lora_b: torch.Tensor,
        output_offset: torch.Tensor,
        max_qkv_out_dim: int,
        base_output: Optional[torch.Tensor] = None,
        n_slices: int = 3,
        *args,
        **kwargs,
    ) -> torch.Tensor:
        """Stacked projection with ``n_slices`` bands (q/k/v, or 2 and 4 for MLA and GDN).

        x: (s, K); qkv_lora_a: (L, n_slices * R, K); qkv_lora_b: (L, sum of bands, R);
        output_offset: (n_slices + 1,) device int32 band boundaries; max_qkv_out_dim: widest band.
        Returns (s, sum of bands).
        """
        info, routes = self._sgemm_info(), self.routes
        route = routes.last_route if info is routes.last_info else self._route(info)
        return stacked_projection(route, x, qkv_lora_a, qkv_lora_b, output_offset, max_qkv_out_dim, base_output, n_slices)

    def run_gate_up_lora(
        self,
        x: torch.Tensor,
        gate_up_lora_a: torch.Tensor,
        gate_up_lora_b: torch.Tensor,
        base_output: Optional[torch.Tensor] = None,
        *args,
        **kwargs,
    ) -> torch.Tensor:
        """Fused gate/up with two equal bands. x: (s, K); A: (L, 2R, K); B: (L, 2N, R) -> (s, 2N)."""
        info, routes = self._sgemm_info(), self.routes
        route = routes.last_route if info is routes.last_info else self._route(info)
        return gate_up_projection(route, x, gate_up_lora_a, gate_up_lora_b, base_output)
