"""Emulator of sgl-kernel-xpu LoRA kernel builds on CPU and CUDA (development and tests only).

It registers the ``sgl_kernel`` LoRA op schemas of a chosen build under ``torch.ops.sgl_kernel``
with CPU and CUDA implementations (the ``device`` of the real ``XPU`` kernels is the tensors'
device: CPU for the tests, a CUDA GPU for graph-capture evidence) that behave like the real
kernels (sgl-kernel-xpu ``src/sycl/*Lora*.cpp``; shared/research kernels note section 1), quirks
included:

* GEMMs contract over the full ``max_rank`` and only range-check ``lora_ranks``, so an unzeroed
  rank tail, or a multi-slice expand given a shrink's packed output (slice ``p`` at ``p * r``, not
  ``p * max_rank``), gives visibly wrong numbers; only the embedding op clamps the rank;
* results go to the caller's ``output`` (``Tensor(a!) output`` first), ``base_output`` is only read;
* the same argument checks: tensors contiguous, one value dtype per call, ``seg_indptr`` starting
  at 0 and ending at ``num_tokens``, slot and rank ranges, exact offsets and widest-band sizes, and
  the embedding op's int32-only index tensors. Checks read device memory with ``.item()``/``.cpu()``
  like the real ones, which is why these ops cannot be captured in a graph.

The ``full-syncfree`` build has the same ops and schemas as ``full`` with the checks on values
done on the device (``torch._assert_async``: a device-side assert on CUDA) and the math
vectorised over the slots, so nothing reads device memory on the host and the ops can be captured
in CUDA graphs, as a build whose kernels validate on the device would be (vllm-xpu-kernels' LoRA
ops read adapter indices on the device; shared/research findings section 2). Like the embedding op
with ``max_len``, its ops accept rows past ``seg_indptr[-1]`` (graph padding): they get no LoRA.

One deliberate difference: float32 GEMMs are accepted (real builds take fp16/bf16 only), so the
float32 engine comparisons can run through the native code path on CPU.

Activated in every SGLang process by the ``sgl_kernel_emulator`` entry point of group
``sglang.srt.plugins`` when ``SGLANG_XPU_LORA_EMULATED_BUILD`` names a build; each call appends the
kernel name to the file named by ``SGLANG_XPU_LORA_EMULATOR_LOG`` when that is set.
"""

from __future__ import annotations

import collections
import os
from typing import Optional

import torch

BUILD_ENV = "SGLANG_XPU_LORA_EMULATED_BUILD"
LOG_ENV = "SGLANG_XPU_LORA_EMULATOR_LOG"

_T = "Tensor(a!) output"
SCHEMAS = {
    "embedding_lora_a_fwd": f"({_T}, Tensor input_ids, Tensor weights, int vocab_size, Tensor seg_indptr, "
    "Tensor weight_indices, Tensor lora_ranks, Tensor? extra_embeddings, Tensor? seg_lens) -> ()",
    "embedding_lora_a_fwd+max_len": f"({_T}, Tensor input_ids, Tensor weights, int vocab_size, Tensor seg_indptr, "
    "Tensor weight_indices, Tensor lora_ranks, Tensor? extra_embeddings, Tensor? seg_lens, int max_len) -> ()",
    "sgemm_lora_a_fwd": f"({_T}, Tensor input_x, Tensor weights, int stack_num, Tensor seg_indptr, "
    "Tensor weight_indices, Tensor lora_ranks, Tensor? seg_lens) -> ()",
    "sgemm_lora_b_fwd": f"({_T}, Tensor input_x, Tensor weights, Tensor seg_indptr, Tensor weight_indices, "
    "Tensor lora_ranks, Tensor scalings, Tensor? seg_lens, Tensor? base_output) -> ()",
    "qkv_lora_b_fwd": f"({_T}, Tensor input_x, Tensor qkv_lora_b, Tensor output_offset, int max_qkv_out_dim, "
    "Tensor seg_indptr, Tensor weight_indices, Tensor lora_ranks, Tensor scalings, Tensor? seg_lens, "
    "Tensor? base_output) -> ()",
    "gate_up_lora_b_fwd": f"({_T}, Tensor input_x, Tensor gate_up_lora_b, int output_dim, Tensor seg_indptr, "
    "Tensor weight_indices, Tensor lora_ranks, Tensor scalings, Tensor? seg_lens, Tensor? base_output) -> ()",
    "chunked_sgmv_lora_shrink_fwd": f"({_T}, Tensor x, Tensor weights, int num_slices, int num_segments, "
    "Tensor seg_indptr, Tensor weight_indices, Tensor lora_ranks, Tensor? permutation) -> ()",
    "chunked_sgmv_lora_expand_fwd": f"({_T}, Tensor x, Tensor weights, Tensor slice_offsets, int max_slice_size, "
    "int num_slices, int num_segments, Tensor seg_indptr, Tensor weight_indices, Tensor lora_ranks, "
    "Tensor scalings, Tensor? permutation, Tensor? base_output) -> ()",
}
SCHEMAS["chunked_sgmv_lora_shrink_forward"] = SCHEMAS["chunked_sgmv_lora_shrink_fwd"]

#: Emulated builds: kernel name -> schema key.
BUILDS = {
    # release v0.1.0: only the embedding and LoRA-A ops.
    "v0.1.0": {"embedding_lora_a_fwd": "embedding_lora_a_fwd", "sgemm_lora_a_fwd": "sgemm_lora_a_fwd"},
    # main after PRs #356 and #393: LoRA-B and QKV-B.
    "v0.2.0": {
        "embedding_lora_a_fwd": "embedding_lora_a_fwd",
        "sgemm_lora_a_fwd": "sgemm_lora_a_fwd",
        "sgemm_lora_b_fwd": "sgemm_lora_b_fwd",
        "qkv_lora_b_fwd": "qkv_lora_b_fwd",
    },
    # PR #506 as first described: gate_up and the shrink under its first name, no expand.
    "pr506-draft": {
        "embedding_lora_a_fwd": "embedding_lora_a_fwd",
        "sgemm_lora_a_fwd": "sgemm_lora_a_fwd",
        "sgemm_lora_b_fwd": "sgemm_lora_b_fwd",
        "qkv_lora_b_fwd": "qkv_lora_b_fwd",
        "gate_up_lora_b_fwd": "gate_up_lora_b_fwd",
        "chunked_sgmv_lora_shrink_forward": "chunked_sgmv_lora_shrink_forward",
    },
    # every op, the embedding with max_len.
    "full": {
        "embedding_lora_a_fwd": "embedding_lora_a_fwd+max_len",
        "sgemm_lora_a_fwd": "sgemm_lora_a_fwd",
        "sgemm_lora_b_fwd": "sgemm_lora_b_fwd",
        "qkv_lora_b_fwd": "qkv_lora_b_fwd",
        "gate_up_lora_b_fwd": "gate_up_lora_b_fwd",
        "chunked_sgmv_lora_shrink_fwd": "chunked_sgmv_lora_shrink_fwd",
        "chunked_sgmv_lora_expand_fwd": "chunked_sgmv_lora_expand_fwd",
    },
}
#: The ``full`` ops without host reads (see the module docstring).
BUILDS["full-syncfree"] = dict(BUILDS["full"])
SYNC_FREE_BUILDS = ("full-syncfree",)
#: Dispatch keys every build registers its ops for.
DISPATCH_KEYS = ("CPU", "CUDA")

_VALUE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_library: Optional[torch.library.Library] = None
installed_build: Optional[str] = None
#: Calls per kernel name in this process.
CALLS: collections.Counter = collections.Counter()


# --- checks, as in src/sycl/Utils.h (CHECK_INPUT) and each op's TORCH_CHECKs ----------------------


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(message)


def _check_input(name: str, tensor: torch.Tensor, device: torch.device) -> None:
    _check(tensor.device == device, f"{name} must be a XPU tensor (emulated on {device}), got one on {tensor.device}")
    _check(tensor.is_contiguous(), f"{name} must be contiguous")


def _check_values(output, *named) -> None:
    for name, tensor in named:
        if tensor is None:
            continue
        _check_input(name, tensor, output.device)
        _check(tensor.dtype in _VALUE_DTYPES, f"{name} must be float16, bfloat16 or float32, got {tensor.dtype}")
        _check(tensor.dtype == output.dtype, f"{name} dtype {tensor.dtype} must match output dtype {output.dtype}")


def _check_segment_metadata(seg_indptr, weight_indices, lora_ranks, device, int32_only):
    """The checks of the segment tensors that read no values: device, layout, dtypes, sizes."""
    for name, tensor in (("seg_indptr", seg_indptr), ("weight_indices", weight_indices), ("lora_ranks", lora_ranks)):
        _check_input(name, tensor, device)
        if int32_only:  # the embedding launcher reads data_ptr<int>() of the tensors as passed
            _check(tensor.dtype == torch.int32, f"expected scalar type Int but found {tensor.dtype} ({name})")
        else:
            _check(tensor.dtype in (torch.int32, torch.int64), f"{name} must be an integer tensor")
    _check(seg_indptr.dim() == 1 and seg_indptr.numel() >= 1, "seg_indptr must be 1-D and non-empty")
    _check(
        weight_indices.numel() == seg_indptr.numel() - 1,
        f"weight_indices.numel() ({weight_indices.numel()}) must equal seg_indptr.numel() - 1 ({seg_indptr.numel() - 1})",
    )


def _segments(seg_indptr, weight_indices, lora_ranks, num_tokens, num_loras, max_rank, device, *, int32_only=False, padded_tail=False):
    """Validate the segment metadata (host reads, like the kernels) and return (bounds, slots).

    ``padded_tail``: the capture-safe embedding (with ``max_len``) cannot compare
    ``seg_indptr[-1]`` with the token count on the host; rows past it (graph padding) get zeros.
    """
    _check_segment_metadata(seg_indptr, weight_indices, lora_ranks, device, int32_only)
    bounds = seg_indptr.to(torch.int64).tolist()
    _check(bounds[0] == 0, f"seg_indptr[0] must be 0, got {bounds[0]}")
    if padded_tail:
        _check(bounds[-1] <= num_tokens, f"seg_indptr[-1] ({bounds[-1]}) must not exceed num_tokens ({num_tokens})")
    else:
        _check(bounds[-1] == num_tokens, f"seg_indptr[-1] ({bounds[-1]}) must equal num_tokens ({num_tokens})")
    _check(all(a <= b for a, b in zip(bounds, bounds[1:])), "seg_indptr must be non-decreasing")
    slots = weight_indices.to(torch.int64).tolist()
    if slots:
        lo, hi = min(slots), max(slots)
        _check(0 <= lo and hi < num_loras, f"weight_indices must be in [0, {num_loras}), got [{lo}, {hi}]")
    ranks = lora_ranks.to(torch.int64)
    if ranks.numel():
        rmin, rmax = int(ranks.min().item()), int(ranks.max().item())
        _check(0 <= rmin and rmax <= max_rank, f"lora_ranks must be in [0, {max_rank}], got [{rmin}, {rmax}]")
    return bounds, slots


def _check_offsets(name: str, offsets: torch.Tensor, count: int, total: int, widest_name: str, widest: int, device):
    _check_input(name, offsets, device)
    _check(offsets.numel() == count, f"{name} must have {count} elements, got {offsets.numel()}")
    host = offsets.to(torch.int32).cpu().tolist()
    _check(host[0] == 0 and host[-1] == total, f"{name} must start at 0 and end at {total}, got {host}")
    _check(all(a <= b for a, b in zip(host, host[1:])), f"{name} must be non-decreasing, got {host}")
    bands = [b - a for a, b in zip(host, host[1:])]
    _check(widest == max(bands), f"{widest_name} ({widest}) must equal the widest band ({max(bands)})")
    return host


def _log(kernel_name: str) -> None:
    CALLS[kernel_name] += 1
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a") as log:
            log.write(kernel_name + "\n")


def _rows(bounds, slots, permutation, num_tokens):
    order = list(range(num_tokens)) if permutation is None else permutation.to(torch.int64).tolist()
    for s, slot in enumerate(slots):
        yield slot, order[bounds[s] : bounds[s + 1]]


def _check_permutation(permutation, num_tokens, device):
    if permutation is None:
        return
    _check_input("permutation", permutation, device)
    _check(permutation.numel() == num_tokens, f"permutation.numel() ({permutation.numel()}) must equal num_tokens ({num_tokens})")
    if num_tokens:
        lo, hi = int(permutation.min().item()), int(permutation.max().item())
        _check(0 <= lo and hi < num_tokens, f"permutation values must be in [0, {num_tokens})")


# --- the ops ------------------------------------------------------------------------------------


def _embedding(kernel_name, output, input_ids, weights, vocab_size, seg_indptr, weight_indices, lora_ranks,
               extra_embeddings, seg_lens, max_len=None):
    _log(kernel_name)
    _check_input("input_ids", input_ids, output.device)
    _check(input_ids.dtype == torch.int64, f"input_ids must be int64, got {input_ids.dtype}")
    _check_values(output, ("weights", weights), ("extra_embeddings", extra_embeddings))
    _check(weights.size(2) == vocab_size, f"weights.size(2) ({weights.size(2)}) must equal vocab_size ({vocab_size})")
    num_tokens, max_rank = input_ids.numel(), weights.size(1)
    bounds, slots = _segments(
        seg_indptr, weight_indices, lora_ranks, num_tokens, weights.size(0), max_rank, output.device,
        int32_only=True, padded_tail=max_len is not None,
    )
    if max_len is not None:
        longest = max((b - a for a, b in zip(bounds, bounds[1:])), default=0)
        _check(longest <= max_len, f"max_len ({max_len}) is smaller than the longest segment ({longest})")
    ids, ranks = input_ids.tolist(), lora_ranks.tolist()
    output.zero_()
    extra_rows = 0 if extra_embeddings is None else extra_embeddings.size(1)
    for slot, rows in _rows(bounds, slots, None, num_tokens):
        rank = max(0, min(ranks[slot], max_rank))
        for row in rows:
            tok = ids[row]
            if 0 <= tok < vocab_size:
                output[row, :rank] = weights[slot, :rank, tok]
            elif vocab_size <= tok < vocab_size + extra_rows:
                output[row, :rank] = extra_embeddings[slot, tok - vocab_size, :rank]


def _shrink(kernel_name, output, x, weights, stack_num, seg_indptr, weight_indices, lora_ranks, permutation=None):
    _log(kernel_name)
    _check_values(output, ("input_x", x), ("weights", weights))
    _check(stack_num > 0 and weights.size(1) % stack_num == 0, "weights.size(1) must be divisible by stack_num > 0")
    _check(x.size(1) == weights.size(2), f"input_x.size(1) ({x.size(1)}) must equal weights.size(2) ({weights.size(2)})")
    num_tokens = x.size(0)
    _check_permutation(permutation, num_tokens, output.device)
    bounds, slots = _segments(
        seg_indptr, weight_indices, lora_ranks, num_tokens, weights.size(0), weights.size(1) // stack_num, output.device
    )
    for slot, rows in _rows(bounds, slots, permutation, num_tokens):
        if rows:
            index = torch.tensor(rows, device=output.device)
            output[index] = (x[index].float() @ weights[slot].float().T).to(output.dtype)  # full max_rank


def _expand(kernel_name, output, x, weights, bands, scalings, seg_indptr, weight_indices, lora_ranks, base_output, permutation=None):
    _log(kernel_name)
    _check_values(output, ("input_x", x), ("weights", weights), ("base_output", base_output))
    _check_input("scalings", scalings, output.device)
    num_slices, max_rank, num_tokens = len(bands) - 1, weights.size(2), x.size(0)
    _check(
        x.size(1) == num_slices * max_rank,
        f"input_x.size(1) ({x.size(1)}) must equal {num_slices} * weights.size(2) ({max_rank})",
    )
    _check_permutation(permutation, num_tokens, output.device)
    bounds, slots = _segments(seg_indptr, weight_indices, lora_ranks, num_tokens, weights.size(0), max_rank, output.device)
    scale = scalings.float().tolist()
    result = torch.zeros(output.shape, dtype=torch.float32, device=output.device) if base_output is None else base_output.float().clone()
    for slot, rows in _rows(bounds, slots, permutation, num_tokens):
        if not rows:
            continue
        index = torch.tensor(rows, device=output.device)
        for p in range(num_slices):
            lo, hi = bands[p], bands[p + 1]
            xs = x[index, p * max_rank : (p + 1) * max_rank].float()
            result[index, lo:hi] += scale[slot] * (xs @ weights[slot, lo:hi].float().T)
    output.copy_(result.to(output.dtype))


def _impls():
    def embedding(o, ids, w, v, si, wi, r, e, sl):
        _embedding("embedding_lora_a_fwd", o, ids, w, v, si, wi, r, e, sl)

    def embedding_max_len(o, ids, w, v, si, wi, r, e, sl, max_len):
        _embedding("embedding_lora_a_fwd", o, ids, w, v, si, wi, r, e, sl, max_len)

    def sgemm_a(o, x, w, stack_num, si, wi, r, sl):
        _shrink("sgemm_lora_a_fwd", o, x, w, stack_num, si, wi, r)

    def sgemm_b(o, x, w, si, wi, r, s, sl, base):
        _expand("sgemm_lora_b_fwd", o, x, w, [0, w.size(1)], s, si, wi, r, base)

    def qkv_b(o, x, w, offsets, max_dim, si, wi, r, s, sl, base):
        _check_input("output_offset", offsets, o.device)
        _check(offsets.numel() == 4, f"output_offset must have exactly 4 elements, got {offsets.numel()}")
        bands = _check_offsets("output_offset", offsets, 4, w.size(1), "max_qkv_out_dim", max_dim, o.device)
        _expand("qkv_lora_b_fwd", o, x, w, bands, s, si, wi, r, base)

    def gate_up_b(o, x, w, output_dim, si, wi, r, s, sl, base):
        _check(output_dim > 0 and w.size(1) == 2 * output_dim, f"gate_up_lora_b.size(1) must equal 2 * output_dim ({output_dim})")
        _expand("gate_up_lora_b_fwd", o, x, w, [0, output_dim, 2 * output_dim], s, si, wi, r, base)

    def shrink(name):
        def impl(o, x, w, num_slices, num_segments, si, wi, r, perm):
            _shrink(name, o, x, w, num_slices, si, wi, r, perm)

        return impl

    def expand(o, x, w, offsets, max_slice, num_slices, num_segments, si, wi, r, s, perm, base):
        bands = _check_offsets("slice_offsets", offsets, num_slices + 1, w.size(1), "max_slice_size", max_slice, o.device)
        _expand("chunked_sgmv_lora_expand_fwd", o, x, w, bands, s, si, wi, r, base, perm)

    return {
        "embedding_lora_a_fwd": embedding,
        "embedding_lora_a_fwd+max_len": embedding_max_len,
        "sgemm_lora_a_fwd": sgemm_a,
        "sgemm_lora_b_fwd": sgemm_b,
        "qkv_lora_b_fwd": qkv_b,
        "gate_up_lora_b_fwd": gate_up_b,
        "chunked_sgmv_lora_shrink_fwd": shrink("chunked_sgmv_lora_shrink_fwd"),
        "chunked_sgmv_lora_shrink_forward": shrink("chunked_sgmv_lora_shrink_forward"),
        "chunked_sgmv_lora_expand_fwd": expand,
    }


# --- the sync-free build: the same ops, nothing read back to the host ------------------------------


def _on_device(condition: torch.Tensor, message: str) -> None:
    """A value check done on the device (on CUDA a device-side assert; on CPU it raises)."""
    torch._assert_async(condition, message)


def _slot_of_row(seg_indptr, weight_indices, lora_ranks, num_tokens, num_loras, max_rank, device, permutation=None, int32_only=False):
    """Validate the segment metadata on the device and return each row's slot, ``(num_tokens,)``
    int64 on the device, -1 for rows in no segment (past ``seg_indptr[-1]``); rows are physical
    (``permutation[i]`` is the row of logical position ``i``)."""
    _check_segment_metadata(seg_indptr, weight_indices, lora_ranks, device, int32_only)
    bounds = seg_indptr.to(torch.int64)
    _on_device(bounds[0] == 0, "seg_indptr[0] must be 0")
    _on_device(bounds[-1] <= num_tokens, f"seg_indptr[-1] must not exceed num_tokens ({num_tokens})")
    _on_device((bounds[1:] >= bounds[:-1]).all(), "seg_indptr must be non-decreasing")
    slots = weight_indices.to(torch.int64)
    _on_device(((slots >= 0) & (slots < num_loras)).all(), f"weight_indices must be in [0, {num_loras})")
    _on_device(((lora_ranks >= 0) & (lora_ranks <= max_rank)).all(), f"lora_ranks must be in [0, {max_rank}]")
    position = torch.arange(num_tokens, device=device)
    if slots.numel() == 0:
        return torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
    segment = torch.searchsorted(bounds[1:], position, right=True).clamp(max=slots.numel() - 1)
    logical = torch.where(position < bounds[-1], slots[segment], -1)
    if permutation is None:
        return logical
    _check_input("permutation", permutation, device)
    _check(permutation.numel() == num_tokens, f"permutation.numel() ({permutation.numel()}) must equal num_tokens ({num_tokens})")
    rows = permutation.to(torch.int64)
    _on_device(((rows >= 0) & (rows < num_tokens)).all(), f"permutation values must be in [0, {num_tokens})")
    return torch.full_like(logical, -1).scatter_(0, rows, logical)


def _bands_on_device(name, offsets, count, total, widest_name, widest, device) -> torch.Tensor:
    _check_input(name, offsets, device)
    _check(offsets.numel() == count, f"{name} must have {count} elements, got {offsets.numel()}")
    bands = offsets.to(torch.int64)
    _on_device((bands[0] == 0) & (bands[-1] == total), f"{name} must start at 0 and end at {total}")
    _on_device((bands[1:] >= bands[:-1]).all(), f"{name} must be non-decreasing")
    _on_device((bands[1:] - bands[:-1]).max() == widest, f"{widest_name} ({widest}) must equal the widest band")
    return bands


def _embedding_sync_free(output, input_ids, weights, vocab_size, seg_indptr, weight_indices, lora_ranks, extra_embeddings, seg_lens, max_len):
    _log("embedding_lora_a_fwd")
    _check_input("input_ids", input_ids, output.device)
    _check(input_ids.dtype == torch.int64, f"input_ids must be int64, got {input_ids.dtype}")
    _check_values(output, ("weights", weights), ("extra_embeddings", extra_embeddings))
    _check(weights.size(2) == vocab_size, f"weights.size(2) ({weights.size(2)}) must equal vocab_size ({vocab_size})")
    num_tokens, num_loras, max_rank = input_ids.numel(), weights.size(0), weights.size(1)
    slot = _slot_of_row(seg_indptr, weight_indices, lora_ranks, num_tokens, num_loras, max_rank, output.device, int32_only=True)
    if seg_indptr.numel() > 1:
        longest = (seg_indptr[1:] - seg_indptr[:-1]).max()
        _on_device(longest <= max_len, f"max_len ({max_len}) is smaller than the longest segment")
    known = slot >= 0
    slot_c = slot.clamp(min=0)
    rank = torch.where(known, lora_ranks.to(torch.int64)[slot_c].clamp(0, max_rank), 0)
    in_rank = torch.arange(max_rank, device=output.device)[None, :] < rank[:, None]
    tok = input_ids
    value = torch.where(((tok >= 0) & (tok < vocab_size))[:, None], weights[slot_c, :, tok.clamp(0, vocab_size - 1)], 0)
    if extra_embeddings is not None and extra_embeddings.size(1):
        extra = (tok - vocab_size).clamp(0, extra_embeddings.size(1) - 1)
        in_extra = (tok >= vocab_size) & (tok < vocab_size + extra_embeddings.size(1))
        value = torch.where(in_extra[:, None], extra_embeddings[slot_c, extra, :], value)
    output.copy_(torch.where(in_rank, value, 0).to(output.dtype))


def _shrink_sync_free(kernel_name, output, x, weights, stack_num, seg_indptr, weight_indices, lora_ranks, permutation=None):
    _log(kernel_name)
    _check_values(output, ("input_x", x), ("weights", weights))
    _check(stack_num > 0 and weights.size(1) % stack_num == 0, "weights.size(1) must be divisible by stack_num > 0")
    _check(x.size(1) == weights.size(2), f"input_x.size(1) ({x.size(1)}) must equal weights.size(2) ({weights.size(2)})")
    slot = _slot_of_row(
        seg_indptr, weight_indices, lora_ranks, x.size(0), weights.size(0), weights.size(1) // stack_num, output.device, permutation
    )
    result = output.float()
    for s in range(weights.size(0)):  # full max_rank, like the kernels
        result = torch.where((slot == s)[:, None], x.float() @ weights[s].float().T, result)
    output.copy_(result.to(output.dtype))


def _expand_sync_free(kernel_name, output, x, weights, bands, scalings, seg_indptr, weight_indices, lora_ranks, base_output, permutation=None):
    """``bands``: ``(num_slices + 1,)`` int64 band boundaries on the device."""
    _log(kernel_name)
    _check_values(output, ("input_x", x), ("weights", weights), ("base_output", base_output))
    _check_input("scalings", scalings, output.device)
    num_slices, max_rank = bands.numel() - 1, weights.size(2)
    _check(
        x.size(1) == num_slices * max_rank,
        f"input_x.size(1) ({x.size(1)}) must equal {num_slices} * weights.size(2) ({max_rank})",
    )
    slot = _slot_of_row(seg_indptr, weight_indices, lora_ranks, x.size(0), weights.size(0), max_rank, output.device, permutation)
    column = torch.arange(weights.size(1), device=output.device)
    scale = scalings.float()
    result = torch.zeros(output.shape, dtype=torch.float32, device=output.device) if base_output is None else base_output.float().clone()
    for p in range(num_slices):
        in_band = (column >= bands[p]) & (column < bands[p + 1])
        xs = x[:, p * max_rank : (p + 1) * max_rank].float()
        for s in range(weights.size(0)):
            mask = (slot == s)[:, None] & in_band[None, :]
            result = torch.where(mask, result + scale[s] * (xs @ weights[s].float().T), result)
    output.copy_(result.to(output.dtype))


def _sync_free_impls():
    def embedding_max_len(o, ids, w, v, si, wi, r, e, sl, max_len):
        _embedding_sync_free(o, ids, w, v, si, wi, r, e, sl, max_len)

    def sgemm_a(o, x, w, stack_num, si, wi, r, sl):
        _shrink_sync_free("sgemm_lora_a_fwd", o, x, w, stack_num, si, wi, r)

    def sgemm_b(o, x, w, si, wi, r, s, sl, base):
        bands = torch.arange(2, device=o.device) * w.size(1)  # on the device: no host copy under capture
        _expand_sync_free("sgemm_lora_b_fwd", o, x, w, bands, s, si, wi, r, base)

    def qkv_b(o, x, w, offsets, max_dim, si, wi, r, s, sl, base):
        _check(offsets.numel() == 4, f"output_offset must have exactly 4 elements, got {offsets.numel()}")
        bands = _bands_on_device("output_offset", offsets, 4, w.size(1), "max_qkv_out_dim", max_dim, o.device)
        _expand_sync_free("qkv_lora_b_fwd", o, x, w, bands, s, si, wi, r, base)

    def gate_up_b(o, x, w, output_dim, si, wi, r, s, sl, base):
        _check(output_dim > 0 and w.size(1) == 2 * output_dim, f"gate_up_lora_b.size(1) must equal 2 * output_dim ({output_dim})")
        bands = torch.arange(3, device=o.device) * output_dim  # built on the device, as the real op does
        _expand_sync_free("gate_up_lora_b_fwd", o, x, w, bands, s, si, wi, r, base)

    def shrink(o, x, w, num_slices, num_segments, si, wi, r, perm):
        _shrink_sync_free("chunked_sgmv_lora_shrink_fwd", o, x, w, num_slices, si, wi, r, perm)

    def expand(o, x, w, offsets, max_slice, num_slices, num_segments, si, wi, r, s, perm, base):
        bands = _bands_on_device("slice_offsets", offsets, num_slices + 1, w.size(1), "max_slice_size", max_slice, o.device)
        _expand_sync_free("chunked_sgmv_lora_expand_fwd", o, x, w, bands, s, si, wi, r, base, perm)

    return {
        "embedding_lora_a_fwd+max_len": embedding_max_len,
        "sgemm_lora_a_fwd": sgemm_a,
        "sgemm_lora_b_fwd": sgemm_b,
        "qkv_lora_b_fwd": qkv_b,
        "gate_up_lora_b_fwd": gate_up_b,
        "chunked_sgmv_lora_shrink_fwd": shrink,
        "chunked_sgmv_lora_expand_fwd": expand,
    }


def install(build: str) -> None:
    """Register the ops of ``build`` (a key of :data:`BUILDS`) once per process, for every
    dispatch key of :data:`DISPATCH_KEYS`.

    Raises:
        ValueError: for an unknown build, or a second, different build in the same process.
    """
    global _library, installed_build
    if build not in BUILDS:
        raise ValueError(f"unknown emulated sgl-kernel-xpu build {build!r}; choose one of {', '.join(BUILDS)}")
    if installed_build is not None:
        if installed_build != build:
            raise ValueError(f"emulated build {installed_build!r} is already installed in this process")
        return
    _library = torch.library.Library("sgl_kernel", "FRAGMENT")
    impls = _sync_free_impls() if build in SYNC_FREE_BUILDS else _impls()
    for kernel_name, schema_key in BUILDS[build].items():
        _library.define(kernel_name + SCHEMAS[schema_key])
        for dispatch_key in DISPATCH_KEYS:
            _library.impl(kernel_name, impls[schema_key], dispatch_key)
    installed_build = build


def uninstall() -> None:
    """Remove the installed build's ops from ``torch.ops.sgl_kernel`` and reset :data:`CALLS`."""
    global _library, installed_build
    if _library is not None:
        _library._destroy()
    _library, installed_build = None, None
    CALLS.clear()


def register_from_env() -> None:
    """``sglang.srt.plugins`` entry point: install the build named by ``SGLANG_XPU_LORA_EMULATED_BUILD``."""
    build = os.environ.get(BUILD_ENV)
    if build:
        install(build)
