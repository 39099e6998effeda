"""SGLang's Triton LoRA ops as benchmark peers on a CUDA GPU: the dense SGMV ops of the ``triton``
backend and the chunked-SGMV ops of the ``csgmv`` backend, given the same routing as the case, on
SGLang's packed pool with the adapters' real ranks, the B ops adding into the case's base outputs
as SGLang's layers pass them.

On a GPU machine without SGLang, ``benchmarks/prepare_gpu_carry.sh`` assembles the op files from
the local SGLang install with the small stand-ins in ``benchmarks/gpu_standins`` (LoRABatchInfo,
envs, get_device_name, cached_triton_kernel) into ``.carry/site``.
"""

from __future__ import annotations

from typing import Callable

import torch

CSGMV_CHUNK = 16


def _batch_info(case, *, permutation, seg_indptr, weight_indices, max_len, lora_ranks=None):
    from sglang.srt.lora.utils import LoRABatchInfo

    num_segments = weight_indices.numel()
    return LoRABatchInfo(
        use_cuda_graph=False, bs=num_segments, num_segments=num_segments, seg_indptr=seg_indptr,
        weight_indices=weight_indices, lora_ranks=case.ranks if lora_ranks is None else lora_ranks,
        scalings=case.scalings, max_len=max_len, seg_lens=seg_indptr[1:] - seg_indptr[:-1], permutation=permutation,
    )


def dense_batch_info(case, lora_ranks=None):
    """The batch info of SGLang's ``triton`` backend for the case (decode: one segment per slot with
    the tokens sorted by slot, ``max_len`` = tokens; prefill: one segment per request)."""
    max_len = case.tokens if case.mode == "decode" else max(case.request_lens)
    return _batch_info(case, permutation=case.permutation, seg_indptr=case.seg_indptr,
                       weight_indices=case.weight_indices, max_len=max_len, lora_ranks=lora_ranks)


def _csgmv_segments(case):
    """Tokens sorted by slot, split into chunks of at most CSGMV_CHUNK tokens (as csgmv does)."""
    slots = [s for s, n in zip(case.request_slots, case.request_lens) for _ in range(n)]
    order = sorted(range(len(slots)), key=lambda i: slots[i])
    bounds, weight_indices, start = [0], [], 0
    while start < len(order):
        end = start
        while end < len(order) and end - start < CSGMV_CHUNK and slots[order[end]] == slots[order[start]]:
            end += 1
        bounds.append(end)
        weight_indices.append(slots[order[start]])
        start = end
    device = case.device
    return (
        torch.tensor(order, dtype=torch.int32, device=device),
        torch.tensor(bounds, dtype=torch.int32, device=device),
        torch.tensor(weight_indices, dtype=torch.int32, device=device),
    )


def peers(case) -> dict[str, Callable[[str], torch.Tensor]]:
    from sglang.kernels.ops.lora.dense.chunked_sgmv_expand import chunked_sgmv_lora_expand_forward
    from sglang.kernels.ops.lora.dense.chunked_sgmv_shrink import chunked_sgmv_lora_shrink_forward
    from sglang.kernels.ops.lora.dense.gate_up_lora_b import gate_up_lora_b_fwd
    from sglang.kernels.ops.lora.dense.qkv_lora_b import qkv_lora_b_fwd
    from sglang.kernels.ops.lora.dense.sgemm_lora_a import sgemm_lora_a_fwd
    from sglang.kernels.ops.lora.dense.sgemm_lora_b import sgemm_lora_b_fwd

    dense_info = dense_batch_info(case)
    permutation, bounds, chunk_slots = _csgmv_segments(case)
    csgmv_info = _batch_info(case, permutation=permutation, seg_indptr=bounds, weight_indices=chunk_slots, max_len=CSGMV_CHUNK)

    def triton(name):
        a, b, outs = case.weights[name]
        mid = sgemm_lora_a_fwd(case.inputs[name], a, dense_info, stack_num=len(outs))
        if len(outs) == 3:
            return qkv_lora_b_fwd(mid, b, dense_info, case.offsets[name], max(outs), case.base_output(name))
        if len(outs) == 2:
            return gate_up_lora_b_fwd(mid, b, dense_info, outs[0], case.base_output(name))
        return sgemm_lora_b_fwd(mid, b, dense_info, case.base_output(name))

    def csgmv(name):
        a, b, outs = case.weights[name]
        mid = chunked_sgmv_lora_shrink_forward(case.inputs[name], a, csgmv_info, len(outs))
        return chunked_sgmv_lora_expand_forward(mid, b, csgmv_info, case.offsets[name], max(outs), case.base_output(name))

    return {"triton": triton, "csgmv": csgmv}
