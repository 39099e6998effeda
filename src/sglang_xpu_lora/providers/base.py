"""The op interface shared by every provider: the seven sgl-kernel-xpu LoRA ops.

Signatures and semantics mirror the Python wrappers in sgl-kernel-xpu ``python/sgl_kernel/lora.py``
(see ``shared/research/sgl-kernel-xpu-ops-and-plugin-conventions.md`` section 1). Common contract:

* ``seg_indptr``: ``(num_segments + 1,)`` int32, token-row boundaries, ``seg_indptr[0] == 0``,
  non-decreasing; empty segments are allowed. Rows at or past ``seg_indptr[-1]`` belong to no
  segment and receive no LoRA contribution.
* ``weight_indices``: ``(num_segments,)`` int32, the pool slot of each segment.
* ``lora_ranks``: ``(max_loras,)``, the real rank ``r`` of each slot. The caller must keep rank
  tails zero (A rows from ``stack_num * r`` on, B columns from ``r`` on; the plugin's pool patch
  zeroes each slot before a load): the native GEMM ops (and the portable ones routed on the
  device) contract over the full ``max_rank`` without reading it, the portable ops routed on the
  host contract over each slot's rank, SGLang's Triton kernels read only ``[0, r)``; only the
  embedding op masks the rank tail.
* ``scalings``: ``(max_loras,)`` float32, ``lora_alpha / r`` per slot, applied in the B (expand) stage.
* ``permutation`` (chunked ops): ``(num_tokens,)`` int32 logical-to-physical row map; segments then
  describe logical order. ``None`` means segments are in physical row order.
* Stacked A weights are SGLang's packed layout: a rank-``r`` slot holds slice ``p`` at rows
  ``[p * r, (p + 1) * r)``. Every shrink computes ``x @ A^T`` over all ``stack_num * max_rank``
  rows, so its output is packed the same way (slice ``p`` at columns ``[p * r, (p + 1) * r)``,
  zero from ``stack_num * r`` on). One-slice B ops read that as it is. The multi-slice B ops
  (``qkv_lora_b_fwd``, ``gate_up_lora_b_fwd``, ``chunked_sgmv_lora_expand_fwd`` with
  ``num_slices > 1``) differ by provider: SGLang's Triton kernels read the packed output, the
  native and portable ones read slice ``p`` at columns ``[p * max_rank, (p + 1) * max_rank)``, as
  :func:`.slice_layout.spaced_slices` lays it out (the backend calls it between the two).
* The B ops of the Triton provider (:mod:`.triton_ops`) and of the portable provider
  (:mod:`.torch_ops`) add into ``base_output`` in place and return it, as SGLang's kernels and its
  ``torch_native`` backend do; the native ops return new tensors and only read ``base_output``.
  Callers use the returned tensor and do not reuse ``base_output``.
* Called through an :class:`~.selection.OpSelection` table, every op also takes the keyword
  ``batch_info`` (SGLang's ``LoRABatchInfo`` of the batch), which only the Triton provider reads.
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch

#: The op names every provider exports, in the order the sgl-kernel-xpu builds added them.
OP_NAMES = (
    "embedding_lora_a_fwd",
    "sgemm_lora_a_fwd",
    "sgemm_lora_b_fwd",
    "qkv_lora_b_fwd",
    "gate_up_lora_b_fwd",
    "chunked_sgmv_lora_shrink_fwd",
    "chunked_sgmv_lora_expand_fwd",
)


class LoRAOpsProvider(Protocol):
    """A module or object that exports the seven LoRA ops with these exact signatures."""

    name: str

    def embedding_lora_a_fwd(
        self,
        input_ids: torch.Tensor,
        weights: torch.Tensor,
        vocab_size: int,
        seg_indptr: torch.Tensor,
        weight_indices: torch.Tensor,
        lora_ranks: torch.Tensor,
        extra_embeddings: Optional[torch.Tensor] = None,
        seg_lens: Optional[torch.Tensor] = None,
        max_len: Optional[int] = None,
    ) -> torch.Tensor: ...

    def sgemm_lora_a_fwd(
        self,
        input_x: torch.Tensor,
        weights: torch.Tensor,
        stack_num: int,
        seg_indptr: torch.Tensor,
        weight_indices: torch.Tensor,
        lora_ranks: torch.Tensor,
        seg_lens: Optional[torch.Tensor] = None,
    ) -> torch.Tensor: ...

    def sgemm_lora_b_fwd(
        self,
        input_x: torch.Tensor,
        weights: torch.Tensor,
        seg_indptr: torch.Tensor,
        weight_indices: torch.Tensor,
        lora_ranks: torch.Tensor,
        scalings: torch.Tensor,
        seg_lens: Optional[torch.Tensor] = None,
        base_output: Optional[torch.Tensor] = None,
    ) -> torch.Tensor: ...

    def qkv_lora_b_fwd(
        self,
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
    ) -> torch.Tensor: ...

    def gate_up_lora_b_fwd(
        self,
        input_x: torch.Tensor,
        gate_up_lora_b: torch.Tensor,
        output_dim: int,
        seg_indptr: torch.Tensor,
        weight_indices: torch.Tensor,
        lora_ranks: torch.Tensor,
        scalings: torch.Tensor,
        seg_lens: Optional[torch.Tensor] = None,
        base_output: Optional[torch.Tensor] = None,
    ) -> torch.Tensor: ...

    def chunked_sgmv_lora_shrink_fwd(
        self,
        input_x: torch.Tensor,
        weights: torch.Tensor,
        stack_num: int,
        num_segments: int,
        seg_indptr: torch.Tensor,
        weight_indices: torch.Tensor,
        lora_ranks: torch.Tensor,
        permutation: Optional[torch.Tensor] = None,
    ) -> torch.Tensor: ...

    def chunked_sgmv_lora_expand_fwd(
        self,
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
    ) -> torch.Tensor: ...
