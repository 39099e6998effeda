"""What each LoRA op of a batch takes, prepared once per batch for ``IntelXpuLoRABackend``.

SGLang calls the backend's ``run_*`` methods once per LoRA module per layer (a few hundred times per
decode step); everything that depends only on the batch is built here, in ``prepare_lora_batch``
or graph set-up, so a ``run_*`` call looks up its :class:`BatchRoute` and calls one of its module callables:

* the ops of the op table (eager, or capture-safe inside graphs) bound to the batch
  (``OpSelection.bind_batch``): index tensors, scalings and SGLang's batch info are already in
  them, so per call only the module's tensors and host integers are passed, positionally (for the
  Triton provider, SGLang's kernels are called as ``TritonLoRABackend`` calls them, by the methods
  of one ``BatchLaunches`` per route, through the backend's launch cache);
* which op serves each module, and whether its input needs the slice gather of the native and
  portable multi-slice expands, decided once per route.

Nothing here reads device memory on the host.
"""

from __future__ import annotations

import types

import torch

from sglang_xpu_lora.providers import slice_layout
from sglang_xpu_lora.providers.graph_capture import capturing


#: The expands whose native and portable implementations read a multi-slice shrink output with
#: slice ``p`` at columns ``p * max_lora_rank`` (:mod:`sglang_xpu_lora.providers.slice_layout`).
MULTI_SLICE_EXPANDS = ("qkv_lora_b_fwd", "gate_up_lora_b_fwd", "chunked_sgmv_lora_expand_fwd")


#: The bound ops (and chunked-expand forms, ``batch_binding.UNIFORM_BAND_FORMS``) a route calls,
#: for permuted batches and for contiguous ones: only these are bound.
PERMUTED_ROUTE_OPS = (
    "chunked_sgmv_lora_shrink_fwd", "chunked_sgmv_lora_expand_fwd", "chunked_expand_one_band", "chunked_expand_two_bands",
)
CONTIGUOUS_ROUTE_OPS = (
    "sgemm_lora_a_fwd", "sgemm_lora_b_fwd", "qkv_lora_b_fwd", "gate_up_lora_b_fwd", "chunked_sgmv_lora_expand_fwd",
)


class BatchRoute:
    """How the LoRA modules of one batch info (``info``) are computed in this batch.

    Built once per batch from the op table's batch-bound ops (``OpSelection.bind_batch`` of
    :data:`PERMUTED_ROUTE_OPS` or :data:`CONTIGUOUS_ROUTE_OPS`,
    :mod:`sglang_xpu_lora.providers.batch_binding`); the backend's ``run_*`` methods call its four
    module callables, which take only per-call tensors and host integers:

    * ``shrink(x, weights, num_slices)``: x ``(s, K)``, weights ``(L, num_slices * R, K)`` ->
      ``(s, num_slices * R)``, packed (slice ``p`` at columns ``p * rank``);
    * ``expand(x, weights, base_output)``: one slice; x ``(s, R)``, weights ``(L, N, R)`` ->
      ``(s, N)``;
    * ``expand_slices(x, weights, slice_offsets, max_slice_size, num_slices, base_output)``:
      ``num_slices`` bands at device ``slice_offsets`` ``(num_slices + 1,)`` int32 (q/k/v, MLA's 2,
      GDN's 4); x ``(s, num_slices * R)``, weights ``(L, N, R)`` -> ``(s, N)``;
    * ``expand_gate_up(x, weights, output_dim, base_output)``: two equal bands; weights
      ``(L, 2 * output_dim, R)`` -> ``(s, 2 * output_dim)``.

    Which op serves each, decided here once: contiguous batches (``info.permutation`` None) the
    prefill ops (``qkv_lora_b_fwd`` for exactly 3 slices, the chunked expand for other counts),
    permuted ones the chunked ops. Where the op serving a multi-slice expand reads spaced slices
    (``spaced``, native and portable ops), its input goes through :func:`slice_layout.spaced_slices`
    first, with an index built once per row count and slice count in this batch (one built while a
    graph is being captured is kept apart: it is part of that graph). Where no adaptation is needed the module callable is the bound op
    itself (for permuted one-slice and gate/up modules, the chunked expand's uniform-band forms,
    ``batch_binding.UNIFORM_BAND_FORMS``).
    """

    __slots__ = (
        "info", "permuted", "shrink", "expand", "expand_slices", "expand_gate_up",
        "_ops", "_spaced", "_spacing", "_gate_up",
    )

    def __init__(self, info, ops: types.SimpleNamespace, spaced: frozenset):
        self.info, self.permuted = info, info.permutation is not None
        self._ops, self._spaced = ops, spaced
        self._spacing: dict = {}  # (rows, num_slices, capturing) -> spacing index
        if self.permuted:
            gate_up_spaced = "chunked_sgmv_lora_expand_fwd" in spaced
            self.shrink, self.expand = ops.chunked_sgmv_lora_shrink_fwd, ops.chunked_expand_one_band
            self.expand_slices = self._expand_slices_chunked_sgmv if gate_up_spaced else ops.chunked_sgmv_lora_expand_fwd
            self._gate_up = ops.chunked_expand_two_bands
        else:
            self.shrink, self.expand = ops.sgemm_lora_a_fwd, ops.sgemm_lora_b_fwd
            self._gate_up, gate_up_spaced = ops.gate_up_lora_b_fwd, "gate_up_lora_b_fwd" in spaced
            self.expand_slices = self._expand_slices_contiguous
        self.expand_gate_up = self._expand_gate_up_spaced if gate_up_spaced else self._gate_up

    # --- the slice gather before native / portable multi-slice expands ------------------------

    def _spaced_input(self, x: torch.Tensor, num_slices: int) -> torch.Tensor:
        """``x`` (packed) with slice ``p`` moved to columns ``p * max_lora_rank``, zero rank tails."""
        rows = x.shape[0]
        key = (rows, num_slices, capturing(x.device))
        index = self._spacing.get(key)
        if index is None:
            info = self.info
            permutation = None if info.permutation is None else info.permutation[:rows]
            index = self._spacing[key] = slice_layout.spacing_index(
                info.seg_indptr, info.weight_indices, info.lora_ranks, rows, num_slices, x.shape[1] // num_slices, permutation,
            )
        return slice_layout.spaced_slices(x, index)

    def _expand_gate_up_spaced(self, x, weights, output_dim, base_output):
        return self._gate_up(self._spaced_input(x, 2), weights, output_dim, base_output)

    def _expand_slices_chunked_sgmv(self, x, weights, slice_offsets, max_slice_size, num_slices, base_output):
        """The chunked expand, its input spaced first where its provider reads spaced slices."""
        if num_slices > 1 and "chunked_sgmv_lora_expand_fwd" in self._spaced:
            x = self._spaced_input(x, num_slices)
        return self._ops.chunked_sgmv_lora_expand_fwd(x, weights, slice_offsets, max_slice_size, num_slices, base_output)

    def _expand_slices_contiguous(self, x, weights, slice_offsets, max_slice_size, num_slices, base_output):
        """``qkv_lora_b_fwd`` for exactly 3 slices, the chunked expand for other counts."""
        if num_slices == 3:
            if "qkv_lora_b_fwd" in self._spaced:
                x = self._spaced_input(x, 3)
            return self._ops.qkv_lora_b_fwd(x, weights, slice_offsets, max_slice_size, base_output)
        return self._expand_slices_chunked_sgmv(x, weights, slice_offsets, max_slice_size, num_slices, base_output)
