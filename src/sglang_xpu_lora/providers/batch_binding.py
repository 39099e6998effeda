"""The interface's ops bound to one batch: callables that take only what varies per LoRA module.

SGLang calls a LoRA backend a few hundred times per decode step, always for the same batch. So the
backend binds the ops of its table to the batch once (``OpSelection.bind_batch``, when it builds the
batch's routes: at ``prepare_lora_batch`` for graph batches, at the first call for eager ones) and
per call passes only the module's tensors and host integers,
positionally, in the order of :data:`BOUND_PARAMETERS`; the batch's ``seg_indptr``,
``weight_indices``, ``lora_ranks``, ``scalings``, ``num_segments``, ``permutation`` and SGLang's
``LoRABatchInfo`` are already in the callable. Semantics, shapes and dtypes are those of
:mod:`.base`.

How an op is bound depends on its provider (:meth:`.base.Provider.bind_to_batch`, called once
per binding for each provider that serves one of its ops):

* SGLang's Triton kernels bind themselves: :func:`.triton_ops.bind` (the launches of
  ``TritonLoRABackend``'s kernels, from their compiled handles; the kernels read the permutation
  from the batch info): the binding's Triton ops are the methods of one
  :class:`.triton_launch.BatchLaunches`;
* native and portable ops: :func:`bind_keywords`, around the table's keyword function.

The embedding op is not bound (one call per forward; the backend calls the table entry).
Binding reads no device memory on the host and creates no tensors. A bound Triton op launches its
kernel and allocates what SGLang's wrapper allocates (the shrink's output; an expand's when no
base output is given), nothing else; a bound native or portable permuted op adds the ``permutation[:rows]``
view, made at its first use per row count and kept for the batch.

Where the state lives (no process state: two backends in one process keep their own). The
portable ops of one binding share a :class:`~.torch_routing.cache.RoutingCache`, made with it:
the batch's routing is computed by the first layer and reused by the others, and it lives exactly
as long as the batch's bound ops. The Triton ops' compiled kernels outlive batches: they are kept in
the launch cache the caller passes in (a :class:`.triton_launch.TritonLaunches`; the backend owns
one, :attr:`.base.Provider.uses_launch_cache`), which the batch's ``BatchLaunches`` launches
through.
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Callable, Optional

import torch

from sglang_xpu_lora.providers.torch_routing.cache import RoutingCache

if TYPE_CHECKING:
    from sglang.srt.lora.utils import LoRABatchInfo

#: Per-call parameters of each batch-bound op, in call order (names as in :mod:`.base`).
BOUND_PARAMETERS = {
    "sgemm_lora_a_fwd": ("input_x", "weights", "num_slices"),
    "sgemm_lora_b_fwd": ("input_x", "weights", "base_output"),
    "qkv_lora_b_fwd": ("input_x", "qkv_lora_b", "output_offset", "max_qkv_out_dim", "base_output"),
    "gate_up_lora_b_fwd": ("input_x", "gate_up_lora_b", "output_dim", "base_output"),
    "chunked_sgmv_lora_shrink_fwd": ("input_x", "weights", "num_slices"),
    "chunked_sgmv_lora_expand_fwd": (
        "input_x", "weights", "slice_offsets", "max_slice_size", "num_slices", "base_output",
    ),
}

#: The chunked expand's forms for uniform bands (one band; two bands of ``output_dim`` each), whose
#: band offsets come with the binding: name -> band count. Their per-call parameters are those of
#: ``sgemm_lora_b_fwd`` and ``gate_up_lora_b_fwd``, so a permuted batch's one-slice and gate/up
#: modules call them as a contiguous batch's call those ops.
UNIFORM_BAND_FORMS = {"chunked_expand_one_band": 1, "chunked_expand_two_bands": 2}

#: The ops that read ``num_segments`` and ``permutation``.
CHUNKED_OPS = ("chunked_sgmv_lora_shrink_fwd", "chunked_sgmv_lora_expand_fwd")
#: The ops that read ``scalings`` (the B, expand, stage).
EXPAND_OPS = ("sgemm_lora_b_fwd", "qkv_lora_b_fwd", "gate_up_lora_b_fwd", "chunked_sgmv_lora_expand_fwd")


def batch_arguments(op: str, info: LoRABatchInfo) -> dict:
    """The keyword arguments of ``op`` that ``info`` (SGLang's ``LoRABatchInfo``) fixes for the
    batch, ``permutation`` aside: the index tensors, ``scalings`` for expands, ``num_segments`` for
    the chunked ops and ``batch_info`` (read by the Triton ops only)."""
    fixed = dict(seg_indptr=info.seg_indptr, weight_indices=info.weight_indices, lora_ranks=info.lora_ranks, batch_info=info)
    if op in EXPAND_OPS:
        fixed["scalings"] = info.scalings
    if op in CHUNKED_OPS:
        fixed["num_segments"] = info.num_segments
    return fixed


def bind_keywords(op: str, fn: Callable[..., torch.Tensor], info: LoRABatchInfo, routing: Optional[RoutingCache] = None) -> Callable[..., torch.Tensor]:
    """``fn``, an op with the interface's keyword signature plus ``batch_info`` (an op-table entry
    of the native or portable provider), bound to the batch ``info``: the result takes the
    per-call arguments of :data:`BOUND_PARAMETERS` ``[op]`` positionally.

    A chunked op gets ``info.permutation[:rows]`` (None for contiguous batches), ``rows`` being
    ``input_x``'s row count, sliced once per row count. ``routing``: the batch's routing cache,
    passed to ``fn`` as the keyword ``routing`` (portable ops only).
    """
    names, fixed = BOUND_PARAMETERS[op], batch_arguments(op, info)
    if routing is not None:
        fixed["routing"] = routing
    permutation = info.permutation if op in CHUNKED_OPS else None
    if permutation is None:
        if op in CHUNKED_OPS:
            fixed["permutation"] = None

        def call(*args):
            return fn(**dict(zip(names, args)), **fixed)

        call.__qualname__ = f"bound.{op}"
        return call

    slices: dict = {}  # rows -> permutation[:rows]

    def call_permuted(input_x, *args):
        rows = input_x.shape[0]
        rows_permutation = slices.get(rows)
        if rows_permutation is None:
            rows_permutation = slices[rows] = permutation[:rows]
        return fn(input_x=input_x, **dict(zip(names[1:], args)), permutation=rows_permutation, **fixed)

    call_permuted.__qualname__ = f"bound.{op}"
    return call_permuted


def bind_uniform_bands(bands: int, expand: Callable[..., torch.Tensor], uniform_offsets) -> Callable[..., torch.Tensor]:
    """The :data:`UNIFORM_BAND_FORMS` form of ``bands`` bands of ``expand``, a batch-bound chunked
    expand: its slice offsets ``[0, n, 2n, ...]`` are ``uniform_offsets(bands, n)`` (persistent
    ``(bands + 1,)`` int32 device tensors, whose addresses captured graphs may read)."""
    if bands == 1:

        def one_band(input_x, weights, base_output):
            out_dim = weights.shape[-2]
            return expand(input_x, weights, uniform_offsets(1, out_dim), out_dim, 1, base_output)

        return one_band

    def two_bands(input_x, weights, output_dim, base_output):
        return expand(input_x, weights, uniform_offsets(2, output_dim), output_dim, 2, base_output)

    return two_bands


def _op_of(name: str) -> str:
    """The op of an op or chunked-expand form name (:data:`UNIFORM_BAND_FORMS`)."""
    return "chunked_sgmv_lora_expand_fwd" if name in UNIFORM_BAND_FORMS else name


def bind_table(
    table: types.SimpleNamespace, choices: dict, info: LoRABatchInfo, uniform_offsets, names, launches,
) -> types.SimpleNamespace:
    """The ops of :data:`BOUND_PARAMETERS` and the forms of :data:`UNIFORM_BAND_FORMS` named in
    ``names`` (a form needs ``chunked_sgmv_lora_expand_fwd`` named too) of the op table ``table``,
    bound to the batch ``info``: each provider that binds itself binds its ops of ``names`` in one
    call (:meth:`.base.Provider.bind_to_batch`), the others get the keyword binding; the ops of
    providers that cache routing (:attr:`.base.Provider.caches_routing`) share one new
    :class:`RoutingCache`.

    Args:
        table: an op table (:class:`.selection.OpSelection` ``eager`` or ``graph``).
        choices: op -> :class:`.selection.OpChoice` of ``table`` (which provider serves each op,
            and whether it binds itself to a batch).
        info: SGLang's ``LoRABatchInfo`` of the batch (the kernels' batch info).
        uniform_offsets: ``(bands, band_size) -> (bands + 1,)`` int32 persistent device offsets.
        names: the op and form names to bind.
        launches: the caller's launch cache (:class:`.triton_launch.TritonLaunches`), for providers
            that launch through one (:attr:`.base.Provider.uses_launch_cache`); None where none does.

    Returns:
        A namespace with one batch-bound callable per name.
    """
    served: dict = {}  # provider -> its names, in the order of names
    for name in names:
        served.setdefault(choices[_op_of(name)].provider, []).append(name)
    bound, routing = {}, RoutingCache()
    for provider, provider_names in served.items():
        bound.update(provider.bind_to_batch(tuple(provider_names), info, launches))
    for name in names:
        if name in bound:
            continue
        op = _op_of(name)
        if name in UNIFORM_BAND_FORMS:
            bound[name] = bind_uniform_bands(UNIFORM_BAND_FORMS[name], bound[op], uniform_offsets)
        else:
            caching = choices[op].provider.caches_routing
            bound[name] = bind_keywords(name, getattr(table, name), info, routing if caching else None)
    return types.SimpleNamespace(**bound)

