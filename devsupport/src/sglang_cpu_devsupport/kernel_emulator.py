"""Emulator of sgl-kernel-xpu LoRA kernel builds on CPU (development and tests only).

It registers the ``sgl_kernel`` LoRA op schemas of a chosen build under ``torch.ops.sgl_kernel``
with CPU implementations that behave like the real kernels (sgl-kernel-xpu
``src/sycl/*Lora*.cpp``; shared/research kernels note section 1), quirks included:

* GEMMs contract over the full ``max_rank`` and only range-check ``lora_ranks``, so an unzeroed
  rank tail, or a multi-slice expand given a shrink's packed output (slice ``p`` at ``p * r``, not
  ``p * max_rank``), gives visibly wrong numbers; only the embedding op clamps the rank;
* results go to the caller's ``output`` (``Tensor(a!) output`` first), ``base_output`` is only read;
* the same argument checks: tensors contiguous, one value dtype per call, ``seg_indptr`` starting
  at 0 and ending at ``num_tokens``, slot and rank ranges, exact offsets and widest-band sizes, and
  the embedding op's int32-only index tensors. Checks read device memory with ``.item()``/``.cpu()``
  like the real ones, which is why these ops are not capture-safe.

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

#: Kernels each build declares capture-safe (``sgl_kernel.lora_capture_safe_ops``, read by the
#: plugin's native provider): the ``full`` build's embedding, whose ``max_len`` bounds the grid from
#: the host, so the capture-safe native path is exercised.
CAPTURE_SAFE = {"full": ("embedding_lora_a_fwd",)}
CAPTURE_SAFE_ATTR = "lora_capture_safe_ops"

_VALUE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_library: Optional[torch.library.Library] = None
installed_build: Optional[str] = None
#: Calls per kernel name in this process.
CALLS: collections.Counter = collections.Counter()


# --- checks, as in src/sycl/Utils.h (CHECK_INPUT) and each op's TORCH_CHECKs ----------------------


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(message)


def _check_input(name: str, tensor: torch.Tensor) -> None:
    _check(tensor.device.type == "cpu", f"{name} must be a XPU tensor (emulated on CPU)")
    _check(tensor.is_contiguous(), f"{name} must be contiguous")


def _check_values(output, *named) -> None:
    for name, tensor in named:
        if tensor is None:
            continue
        _check_input(name, tensor)
        _check(tensor.dtype in _VALUE_DTYPES, f"{name} must be float16, bfloat16 or float32, got {tensor.dtype}")
        _check(tensor.dtype == output.dtype, f"{name} dtype {tensor.dtype} must match output dtype {output.dtype}")


def _segments(seg_indptr, weight_indices, lora_ranks, num_tokens, num_loras, max_rank, *, int32_only=False, padded_tail=False):
    """Validate the segment metadata (host reads, like the kernels) and return (bounds, slots).

    ``padded_tail``: the capture-safe embedding (with ``max_len``) cannot compare
    ``seg_indptr[-1]`` with the token count on the host; rows past it (graph padding) get zeros.
    """
    for name, tensor in (("seg_indptr", seg_indptr), ("weight_indices", weight_indices), ("lora_ranks", lora_ranks)):
        _check_input(name, tensor)
        if int32_only:  # the embedding launcher reads data_ptr<int>() of the tensors as passed
            _check(tensor.dtype == torch.int32, f"expected scalar type Int but found {tensor.dtype} ({name})")
        else:
            _check(tensor.dtype in (torch.int32, torch.int64), f"{name} must be an integer tensor")
    _check(seg_indptr.dim() == 1 and seg_indptr.numel() >= 1, "seg_indptr must be 1-D and non-empty")
    bounds = seg_indptr.to(torch.int64).tolist()
    _check(bounds[0] == 0, f"seg_indptr[0] must be 0, got {bounds[0]}")
    if padded_tail:
        _check(bounds[-1] <= num_tokens, f"seg_indptr[-1] ({bounds[-1]}) must not exceed num_tokens ({num_tokens})")
    else:
        _check(bounds[-1] == num_tokens, f"seg_indptr[-1] ({bounds[-1]}) must equal num_tokens ({num_tokens})")
    _check(all(a <= b for a, b in zip(bounds, bounds[1:])), "seg_indptr must be non-decreasing")
    _check(
        weight_indices.numel() == len(bounds) - 1,
        f"weight_indices.numel() ({weight_indices.numel()}) must equal seg_indptr.numel() - 1 ({len(bounds) - 1})",
    )
    slots = weight_indices.to(torch.int64).tolist()
    if slots:
        lo, hi = min(slots), max(slots)
        _check(0 <= lo and hi < num_loras, f"weight_indices must be in [0, {num_loras}), got [{lo}, {hi}]")
    ranks = lora_ranks.to(torch.int64)
    if ranks.numel():
        rmin, rmax = int(ranks.min().item()), int(ranks.max().item())
        _check(0 <= rmin and rmax <= max_rank, f"lora_ranks must be in [0, {max_rank}], got [{rmin}, {rmax}]")
    return bounds, slots


def _check_offsets(name: str, offsets: torch.Tensor, count: int, total: int, widest_name: str, widest: int):
    _check_input(name, offsets)
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


def _check_permutation(permutation, num_tokens):
    if permutation is None:
        return
    _check_input("permutation", permutation)
    _check(permutation.numel() == num_tokens, f"permutation.numel() ({permutation.numel()}) must equal num_tokens ({num_tokens})")
    if num_tokens:
        lo, hi = int(permutation.min().item()), int(permutation.max().item())
        _check(0 <= lo and hi < num_tokens, f"permutation values must be in [0, {num_tokens})")


# --- the ops ------------------------------------------------------------------------------------


def _embedding(kernel_name, output, input_ids, weights, vocab_size, seg_indptr, weight_indices, lora_ranks,
               extra_embeddings, seg_lens, max_len=None):
    _log(kernel_name)
    _check_input("input_ids", input_ids)
    _check(input_ids.dtype == torch.int64, f"input_ids must be int64, got {input_ids.dtype}")
    _check_values(output, ("weights", weights), ("extra_embeddings", extra_embeddings))
    _check(weights.size(2) == vocab_size, f"weights.size(2) ({weights.size(2)}) must equal vocab_size ({vocab_size})")
    num_tokens, max_rank = input_ids.numel(), weights.size(1)
    bounds, slots = _segments(
        seg_indptr, weight_indices, lora_ranks, num_tokens, weights.size(0), max_rank,
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
    _check_permutation(permutation, num_tokens)
    bounds, slots = _segments(seg_indptr, weight_indices, lora_ranks, num_tokens, weights.size(0), weights.size(1) // stack_num)
    for slot, rows in _rows(bounds, slots, permutation, num_tokens):
        if rows:
            index = torch.tensor(rows)
            output[index] = (x[index].float() @ weights[slot].float().T).to(output.dtype)  # full max_rank


def _expand(kernel_name, output, x, weights, bands, scalings, seg_indptr, weight_indices, lora_ranks, base_output, permutation=None):
    _log(kernel_name)
    _check_values(output, ("input_x", x), ("weights", weights), ("base_output", base_output))
    _check_input("scalings", scalings)
    num_slices, max_rank, num_tokens = len(bands) - 1, weights.size(2), x.size(0)
    _check(
        x.size(1) == num_slices * max_rank,
        f"input_x.size(1) ({x.size(1)}) must equal {num_slices} * weights.size(2) ({max_rank})",
    )
    _check_permutation(permutation, num_tokens)
    bounds, slots = _segments(seg_indptr, weight_indices, lora_ranks, num_tokens, weights.size(0), max_rank)
    scale = scalings.float().tolist()
    result = torch.zeros(output.shape, dtype=torch.float32) if base_output is None else base_output.float().clone()
    for slot, rows in _rows(bounds, slots, permutation, num_tokens):
        if not rows:
            continue
        index = torch.tensor(rows)
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
        _check_input("output_offset", offsets)
        _check(offsets.numel() == 4, f"output_offset must have exactly 4 elements, got {offsets.numel()}")
        bands = _check_offsets("output_offset", offsets, 4, w.size(1), "max_qkv_out_dim", max_dim)
        _expand("qkv_lora_b_fwd", o, x, w, bands, s, si, wi, r, base)

    def gate_up_b(o, x, w, output_dim, si, wi, r, s, sl, base):
        _check(output_dim > 0 and w.size(1) == 2 * output_dim, f"gate_up_lora_b.size(1) must equal 2 * output_dim ({output_dim})")
        _expand("gate_up_lora_b_fwd", o, x, w, [0, output_dim, 2 * output_dim], s, si, wi, r, base)

    def shrink(name):
        def impl(o, x, w, num_slices, num_segments, si, wi, r, perm):
            _shrink(name, o, x, w, num_slices, si, wi, r, perm)

        return impl

    def expand(o, x, w, offsets, max_slice, num_slices, num_segments, si, wi, r, s, perm, base):
        bands = _check_offsets("slice_offsets", offsets, num_slices + 1, w.size(1), "max_slice_size", max_slice)
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


def install(build: str) -> None:
    """Register the ops of ``build`` (a key of :data:`BUILDS`) once per process.

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
    impls = _impls()
    for kernel_name, schema_key in BUILDS[build].items():
        _library.define(kernel_name + SCHEMAS[schema_key])
        _library.impl(kernel_name, impls[schema_key], "CPU")
    _declare_capture_safe(CAPTURE_SAFE.get(build, ()))
    installed_build = build


def _declare_capture_safe(kernel_names) -> None:
    """Set (or, for no names, remove) the build's capture-safety declaration on ``sgl_kernel``."""
    import sgl_kernel

    if kernel_names:
        setattr(sgl_kernel, CAPTURE_SAFE_ATTR, frozenset(kernel_names))
    elif CAPTURE_SAFE_ATTR in vars(sgl_kernel):
        delattr(sgl_kernel, CAPTURE_SAFE_ATTR)


def uninstall() -> None:
    """Remove the installed build's ops from ``torch.ops.sgl_kernel`` and reset :data:`CALLS`."""
    global _library, installed_build
    if _library is not None:
        _library._destroy()
        _declare_capture_safe(())
    _library, installed_build = None, None
    CALLS.clear()


def register_from_env() -> None:
    """``sglang.srt.plugins`` entry point: install the build named by ``SGLANG_XPU_LORA_EMULATED_BUILD``."""
    build = os.environ.get(BUILD_ENV)
    if build:
        install(build)
