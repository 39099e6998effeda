"""Portable PyTorch provider: the seven sgl-kernel-xpu LoRA ops on any device.

Same signatures and semantics as sgl-kernel-xpu ``python/sgl_kernel/lora.py`` (see
:mod:`sglang_xpu_lora.providers.base` for the shared contract). This module checks arguments and
picks one of two routing strategies per op (:func:`routes_on_host`); both give the same numbers:

* **on the device** (:mod:`.torch_routing.device`): any accelerator (XPU, CUDA...), and CPU
  problems where it costs less (small ones, and batches of many adapters); sync-free and graph-capturable, every row keeps its own slot's product (of a GEMM with
  every slot, or, for batches with few rows per slot, of its own slot's weights gathered: a cost
  that does not grow with the slot count);
* **on the host** (:mod:`.torch_routing.host`): CPU tensors; one GEMM per run of a slot, over
  the slot's real rank.

Beyond the interface, the GEMM ops take the keyword-only ``routing``: the batch's
:class:`~.torch_routing.cache.RoutingCache`, through which every layer of a batch reuses the
routing the first one computed (the backend passes one per batch with its bound ops,
:mod:`.batch_binding`); without it, each call computes its own routing.

Common semantics: rows that belong to no segment get no LoRA contribution; ``scalings`` is applied
in fp32 after the expand GEMM, then ``base_output`` is added and the sum cast to ``input_x.dtype``.
A B op given ``base_output`` in ``input_x``'s dtype adds into it in place and returns it, as SGLang's
Triton kernels and its ``torch_native`` backend do (no second output tensor: on a CPU a fresh
``(T, N)`` tensor per layer costs page faults and a pass over memory); callers use the returned
tensor.
The GEMM ops need zero rank tails (A rows from ``num_slices * r`` and B columns from ``r`` on, ``r`` a
slot's ``lora_ranks`` entry: the pool's contract): the device routing contracts over the full
``max_rank``, as the XPU kernels do, the host routing over each slot's rank. Stacked A is SGLang's
packed layout and a shrink's output is packed the same way; the multi-slice B ops read slice ``p``
of their input at columns ``p * max_rank``, as the XPU kernels do (:mod:`.base`). A row reads only
its own slot's weights, whatever the other slots hold (NaN and Inf included).

Raises ``ValueError`` for shape mismatches that can be checked without reading index tensors.
Index contents (slot ids, offsets) are trusted, as in a kernel.

:data:`PROVIDER` describes the provider to the selection: it serves every op on any device, the
last resort; its ops contract over the full ``max_rank`` (zeroed pool slots) and its multi-slice
expands read slice ``p`` at ``p * max_rank``, as the native ones.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch

from sglang_xpu_lora.providers.base import OP_NAMES, Offer, Provider, ignoring_batch_info
from sglang_xpu_lora.providers.torch_routing import device, host
from sglang_xpu_lora.providers.torch_routing.cache import RoutingCache

__all__ = ["PROVIDER", "RoutingCache", *OP_NAMES]


#: On CPU, what one run's GEMM call of the host routing costs beyond its multiply-adds, in the
#: device routing's gathered elements (:func:`.torch_routing.device.cpu_form_costs`): about 7.5 µs,
#: measured with the tiny Llama's shrink (64 rows: 512 µs over 64 runs, 114 µs over 8).
CPU_HOST_RUN = 15_000


def routes_on_host(x: torch.Tensor, weights: torch.Tensor, count_runs: Callable[[], int]) -> bool:
    """Whether an op on ``x`` (T, ...) and ``weights`` (L, N, D) routes on the host (else on the device).

    False on any device but CPU: the ops route on the device, sync-free and graph-capturable. For
    CPU tensors, reading index tensors in host memory is no synchronisation, and the cheaper routing
    wins, in the device routing's gathered elements: the host routing costs
    :data:`CPU_HOST_RUN` per run of one adapter (``count_runs()``, read on the host) plus its
    multiply-adds (``T * N * D``, :data:`.torch_routing.device.CPU_MACS_PER_ELEMENT` to an element);
    the device routing its cheaper form (:func:`.torch_routing.device.cpu_form_costs`). Large
    problems and single runs route on the host; small problems with several runs (tiny models)
    take the device's every-slot GEMM; batches with many runs over many slots (a decode batch of 64
    requests over 64 adapters) gather each row's own weights on the device, one batched GEMM where
    the host makes one GEMM per adapter.
    """
    if x.device.type != "cpu":
        return False
    rows, (slots, out_dim, depth) = x.shape[0], weights.shape
    host = count_runs() * CPU_HOST_RUN + rows * out_dim * depth // device.CPU_MACS_PER_ELEMENT
    return host <= min(device.cpu_form_costs(rows, slots, out_dim, depth))


def _routes(x, weights, seg_indptr, weight_indices, lora_ranks, permutation, max_rank: int, routing: Optional[RoutingCache]):
    """:class:`host.HostRoutes` (host routing) or :class:`device.DeviceRoutes` for an op's batch, through
    the batch's ``routing`` cache when given."""
    num_rows, num_slots = x.shape[0], weights.shape[0]

    def cached(kind: str, index_tensors: tuple, shape_key: tuple, build):
        return build() if routing is None else routing.cached(kind, index_tensors, shape_key, build)

    def host_routes() -> host.HostRoutes:
        return cached(
            "host", (seg_indptr, weight_indices, lora_ranks, permutation), (num_rows, num_slots, max_rank),
            lambda: host.read_runs(seg_indptr, weight_indices, lora_ranks, num_rows, max_rank, permutation),
        )

    if routes_on_host(x, weights, lambda: len(host_routes().runs)):
        return host_routes()
    return cached(
        "device", (seg_indptr, weight_indices, permutation), (num_rows,),
        lambda: device.DeviceRoutes(device.row_slots(seg_indptr, weight_indices, num_rows, permutation)),
    )


def _shrink(x, weights, num_slices, seg_indptr, weight_indices, lora_ranks, permutation, routing) -> torch.Tensor:
    routes = _routes(x, weights, seg_indptr, weight_indices, lora_ranks, permutation, weights.shape[1] // num_slices, routing)
    if isinstance(routes, host.HostRoutes):
        return host.shrink(x, weights, routes, num_slices)
    return device.shrink(x, weights, routes)


def _expand(
    x, weights, seg_indptr, weight_indices, lora_ranks, permutation, scalings, num_slices, base_output, *,
    bands=None, slice_offsets=None, widest: Optional[int] = None, routing: Optional[RoutingCache] = None,
) -> torch.Tensor:
    """The expand of every B op. Slice bands are host ``bands``, or the device ``slice_offsets``
    with ``widest`` the widest band: ``num_slices`` bands of at most ``widest`` columns that add up
    to ``num_slices * widest`` are all ``widest`` wide (gate_up, and the one-slice ops, in decode),
    known on the host without reading ``slice_offsets``."""
    if bands is None and widest is not None and num_slices * widest == weights.shape[1]:
        bands = [(p * widest, (p + 1) * widest) for p in range(num_slices)]
    routes = _routes(x, weights, seg_indptr, weight_indices, lora_ranks, permutation, weights.shape[2], routing)
    if isinstance(routes, host.HostRoutes):
        if bands is None:
            edges = slice_offsets.tolist()
            bands = list(zip(edges[:-1], edges[1:]))
        # read once per batch (the routing cache), not per layer: an S-entry read per call
        scale = scalings.tolist() if routing is None else routing.cached("scalings", (scalings,), (), scalings.tolist)
        return host.expand(x, weights, routes, scale, bands, base_output)
    return device.expand(x, weights, routes, scalings, num_slices, base_output, bands=bands, slice_offsets=slice_offsets)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check_expand_input(input_x: torch.Tensor, weights: torch.Tensor, num_slices: int, base_output) -> None:
    _check(input_x.dim() == 2 and weights.dim() == 3, "input_x must be 2-D and weights 3-D")
    _check(
        input_x.shape[1] == num_slices * weights.shape[2],
        f"input_x.size(1)={input_x.shape[1]} must equal num_slices ({num_slices}) * "
        f"max_rank ({weights.shape[2]})",
    )
    if base_output is not None:
        _check(
            tuple(base_output.shape) == (input_x.shape[0], weights.shape[1]),
            f"base_output shape {tuple(base_output.shape)} must be "
            f"{(input_x.shape[0], weights.shape[1])}",
        )


def embedding_lora_a_fwd(
    input_ids: torch.Tensor,
    weights: torch.Tensor,
    vocab_size: int,
    seg_indptr: torch.Tensor,
    weight_indices: torch.Tensor,
    lora_ranks: torch.Tensor,
    extra_embeddings: Optional[torch.Tensor] = None,
    seg_lens: Optional[torch.Tensor] = None,
    max_len: Optional[int] = None,
) -> torch.Tensor:
    """LoRA-A embedding lookup: ``out[t, r] = weights[l, r, input_ids[t]]`` for ``r < rank[l]``.

    Args:
        input_ids: (T,) integer token ids.
        weights: (L, max_rank, vocab_size), fp32/fp16/bf16.
        vocab_size: base vocabulary size; ids in ``[vocab_size, vocab_size + E)`` read
            ``extra_embeddings[l, id - vocab_size, r]``; other ids (negative, out of range) give 0.
        seg_indptr, weight_indices, lora_ranks: see module contract; the rank tail ``r >= rank``
            is zero here (this op, unlike the GEMM ops, masks it in-kernel).
        extra_embeddings: optional (L, E, max_rank), dtype of weights.
        seg_lens, max_len: accepted for signature parity; unused (``max_len`` only sizes the XPU
            kernel's grid).
    Returns:
        (T, max_rank) in the dtype of weights. No scaling is applied.
    Source: sgl-kernel-xpu ``embedding_lora_a_fwd`` (``src/sycl/EmbeddingLoraAFwd.cpp``).
    """
    _check(weights.dim() == 3, "weights must be (num_loras, max_rank, vocab_size)")
    _check(
        weights.shape[2] == vocab_size,
        f"weights.size(2)={weights.shape[2]} must equal vocab_size={vocab_size}",
    )
    num_rows = input_ids.shape[0]
    max_rank = weights.shape[1]
    slots = device.row_slots(seg_indptr, weight_indices, num_rows)
    slot = slots.clamp(min=0)
    ids = input_ids.to(torch.int64)
    out = weights[slot, :, ids.clamp(0, vocab_size - 1)]
    found = (ids >= 0) & (ids < vocab_size)
    if extra_embeddings is not None:
        num_extra = extra_embeddings.shape[1]
        in_extra = (ids >= vocab_size) & (ids < vocab_size + num_extra)
        extra = extra_embeddings[slot, (ids - vocab_size).clamp(0, max(num_extra - 1, 0))]
        out = torch.where(in_extra.unsqueeze(1), extra.to(out.dtype), out)
        found = found | in_extra
    rank = lora_ranks.to(torch.int64)[slot].clamp(0, max_rank)
    keep = (torch.arange(max_rank, device=ids.device) < rank.unsqueeze(1)) & (found & (slots >= 0)).unsqueeze(1)
    return torch.where(keep, out, torch.zeros((), dtype=out.dtype, device=out.device))


def sgemm_lora_a_fwd(
    input_x: torch.Tensor,
    weights: torch.Tensor,
    num_slices: int,
    seg_indptr: torch.Tensor,
    weight_indices: torch.Tensor,
    lora_ranks: torch.Tensor,
    seg_lens: Optional[torch.Tensor] = None,
    *,
    routing: Optional[RoutingCache] = None,
) -> torch.Tensor:
    """Segmented LoRA shrink over contiguous segments: ``out[t] = x[t] @ weights[l]^T``.

    Args:
        input_x: (T, K).
        weights: (L, num_slices * max_rank, K), dtype of input_x; a rank-r slot's slice p at rows
            p * r (SGLang's packed layout), zero from num_slices * r on.
        num_slices: number of stacked slices (> 0, divides weights.size(1)).
    Returns:
        (T, num_slices * max_rank), dtype of input_x, packed like the weights (slice p at columns
        p * r); zero rows outside every segment.
    Source: sgl-kernel-xpu ``sgemm_lora_a_fwd`` (``src/sycl/SGEMMLoraAFwd.cpp``).
    """
    _check(num_slices > 0 and weights.shape[1] % num_slices == 0, "weights.size(1) must be a multiple of num_slices > 0")
    _check(input_x.shape[1] == weights.shape[2], f"input_x.size(1)={input_x.shape[1]} != weights.size(2)={weights.shape[2]}")
    return _shrink(input_x, weights, num_slices, seg_indptr, weight_indices, lora_ranks, None, routing)


def sgemm_lora_b_fwd(
    input_x: torch.Tensor,
    weights: torch.Tensor,
    seg_indptr: torch.Tensor,
    weight_indices: torch.Tensor,
    lora_ranks: torch.Tensor,
    scalings: torch.Tensor,
    seg_lens: Optional[torch.Tensor] = None,
    base_output: Optional[torch.Tensor] = None,
    *,
    routing: Optional[RoutingCache] = None,
) -> torch.Tensor:
    """Segmented LoRA expand: ``out[t] = scalings[l] * x[t] @ weights[l]^T (+ base_output[t])``.

    Args:
        input_x: (T, max_rank). weights: (L, N, max_rank). scalings: (L,) float.
        base_output: optional (T, N); the result is added into it and it is returned (see the
            module's common semantics).
    Returns:
        (T, N) in input_x's dtype: ``base_output``, or a new tensor without it.
    Source: sgl-kernel-xpu ``sgemm_lora_b_fwd`` (``src/sycl/SGEMMLoraBFwd.cpp``).
    """
    _check_expand_input(input_x, weights, 1, base_output)
    return _expand(
        input_x, weights, seg_indptr, weight_indices, lora_ranks, None, scalings, 1, base_output,
        bands=[(0, weights.shape[1])], routing=routing,
    )


def qkv_lora_b_fwd(
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
    *,
    routing: Optional[RoutingCache] = None,
) -> torch.Tensor:
    """Segmented expand for fused q/k/v: band p of the output uses column band p of input_x.

    Args:
        input_x: (T, 3 * max_rank), slice p at columns p * max_rank.
        qkv_lora_b: (L, N_q + 2 * N_kv, max_rank).
        output_offset: (4,) int tensor ``[0, N_q, N_q + N_kv, N_q + 2 * N_kv]`` on the device; read
            on the device only. max_qkv_out_dim: the widest band (trusted, as by the kernel).
    Returns:
        (T, N_q + 2 * N_kv) in input_x's dtype: ``base_output`` (added into), or a new tensor.
    Source: sgl-kernel-xpu ``qkv_lora_b_fwd`` (``src/sycl/QKVLoraBFwd.cpp``).
    """
    _check(output_offset.numel() == 4, f"output_offset must have 4 elements, got {output_offset.numel()}")
    _check_expand_input(input_x, qkv_lora_b, 3, base_output)
    return _expand(
        input_x, qkv_lora_b, seg_indptr, weight_indices, lora_ranks, None, scalings, 3, base_output,
        slice_offsets=output_offset, widest=max_qkv_out_dim, routing=routing,
    )


def gate_up_lora_b_fwd(
    input_x: torch.Tensor,
    gate_up_lora_b: torch.Tensor,
    output_dim: int,
    seg_indptr: torch.Tensor,
    weight_indices: torch.Tensor,
    lora_ranks: torch.Tensor,
    scalings: torch.Tensor,
    seg_lens: Optional[torch.Tensor] = None,
    base_output: Optional[torch.Tensor] = None,
    *,
    routing: Optional[RoutingCache] = None,
) -> torch.Tensor:
    """Segmented expand for fused gate/up: two equal bands of width ``output_dim``.

    Args:
        input_x: (T, 2 * max_rank), slice p at columns p * max_rank.
        gate_up_lora_b: (L, 2 * output_dim, max_rank).
    Returns:
        (T, 2 * output_dim) in input_x's dtype: ``base_output`` (added into), or a new tensor.
    Source: sgl-kernel-xpu ``gate_up_lora_b_fwd`` (``src/sycl/GateUpLoraBFwd.cpp``).
    """
    _check(
        output_dim > 0 and gate_up_lora_b.shape[1] == 2 * output_dim,
        f"gate_up_lora_b.size(1)={gate_up_lora_b.shape[1]} must equal 2 * output_dim ({output_dim})",
    )
    _check_expand_input(input_x, gate_up_lora_b, 2, base_output)
    bands = [(0, output_dim), (output_dim, 2 * output_dim)]
    return _expand(
        input_x, gate_up_lora_b, seg_indptr, weight_indices, lora_ranks, None, scalings, 2, base_output, bands=bands, routing=routing
    )


def chunked_sgmv_lora_shrink_fwd(
    input_x: torch.Tensor,
    weights: torch.Tensor,
    num_slices: int,
    num_segments: int,
    seg_indptr: torch.Tensor,
    weight_indices: torch.Tensor,
    lora_ranks: torch.Tensor,
    permutation: Optional[torch.Tensor] = None,
    *,
    routing: Optional[RoutingCache] = None,
) -> torch.Tensor:
    """Chunked-SGMV shrink: like :func:`sgemm_lora_a_fwd`, with segments in permuted order.

    Args:
        input_x: (T, K), physical row order. permutation: optional (T,) logical-to-physical map
            (segments describe logical order); None means physical order.
        num_segments: ignored (the kernel uses ``seg_indptr.numel() - 1``).
    Returns:
        (T, num_slices * max_rank) in physical row order.
    Source: sgl-kernel-xpu ``chunked_sgmv_lora_shrink_fwd`` (``src/sycl/ChunkedSgmvLoraShrinkFwd.cpp``).
    """
    _check(num_slices > 0 and weights.shape[1] % num_slices == 0, "weights.size(1) must be a multiple of num_slices > 0")
    _check(input_x.shape[1] == weights.shape[2], f"input_x.size(1)={input_x.shape[1]} != weights.size(2)={weights.shape[2]}")
    return _shrink(input_x, weights, num_slices, seg_indptr, weight_indices, lora_ranks, permutation, routing)


def chunked_sgmv_lora_expand_fwd(
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
    *,
    routing: Optional[RoutingCache] = None,
) -> torch.Tensor:
    """Chunked-SGMV expand over ``num_slices`` bands given by ``slice_offsets``.

    Args:
        input_x: (T, num_slices * max_rank), physical order, slice p at columns p * max_rank.
            weights: (L, N_total, max_rank).
        slice_offsets: (num_slices + 1,) device int tensor, ``[0, ..., N_total]``; read on the
            device only. max_slice_size: the widest band (trusted, as by the kernel).
        permutation: optional (T,) logical-to-physical map; None means physical order.
        base_output: optional (T, N_total); the result is added into it and it is returned (see
            the module's common semantics).
    Returns:
        (T, N_total) in physical row order, input_x's dtype: ``base_output`` (added into), or a
            new tensor.
    Source: sgl-kernel-xpu ``chunked_sgmv_lora_expand_fwd`` (``src/sycl/ChunkedSgmvLoraExpandFwd.cpp``).
    """
    _check(
        slice_offsets.numel() == num_slices + 1,
        f"slice_offsets must have num_slices + 1 = {num_slices + 1} elements, got {slice_offsets.numel()}",
    )
    _check_expand_input(input_x, weights, num_slices, base_output)
    return _expand(
        input_x, weights, seg_indptr, weight_indices, lora_ranks, permutation, scalings, num_slices, base_output,
        slice_offsets=slice_offsets, widest=max_slice_size, routing=routing,
    )


class PortableProvider(Provider):
    """The portable ops: every op, on any device."""

    def offers(self, device_kind: Optional[str], kernels: str, graph_verdicts: Mapping) -> dict[str, Offer]:
        return {op: Offer(ignoring_batch_info(globals()[op]), "") for op in OP_NAMES}


PROVIDER = PortableProvider(
    name="torch", title="portable op", contracts_over_max_rank=True, expands_read_spaced_slices=True, last_resort=True,
    caches_routing=True,
)
