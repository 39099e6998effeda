"""Triton provider: SGLang's own Triton LoRA kernels (``sglang.kernels.ops.lora.dense``), launched
as SGLang's ``TritonLoRABackend.run_*`` methods launch them through their wrappers, behind the
seven-op interface.

The kernels take SGLang's ``LoRABatchInfo`` rather than loose index tensors: besides
``seg_indptr``, ``weight_indices``, ``lora_ranks``, ``scalings`` and ``permutation`` they need the
host-side launch bounds ``bs`` and ``max_len`` and ``seg_lens``. Every op here therefore takes the
interface's arguments plus the keyword ``batch_info`` and reads the batch from it alone; the loose
index arguments are accepted so that the backend calls every provider the same way, and must
describe the same batch: ``IntelXpuLoRABackend`` passes the batch info SGLang's Triton backend
prepared. :func:`bind` binds the ops a route calls to one batch info instead (the backend's
per-batch routes, :mod:`.batch_binding`): they are the methods of one
:class:`.triton_launch.BatchLaunches` per batch info (where the kernel, grid, tiles and the
expand's choice by slices are decided, for these ops and for the eager linears alike), which per
call take only the module's tensors and host integers, positionally, and launch the kernel from
its compiled handle, not through SGLang's wrapper and Triton's JIT dispatch. The keyword functions
go through it too and take their signatures from the interface itself (:func:`.base.signature`),
so they are not written out here a second time. The embedding op alone calls SGLang's wrapper
(``embedding_lora_a_fwd``; one call per forward).

Where the compiled kernels live: in a :class:`.triton_launch.TritonLaunches` that the caller owns
and passes in, nowhere in this module. ``IntelXpuLoRABackend`` owns one (its launch cache, which
its eager linears launch through too) and binds its routes with it, so two backends in one process
keep their own; a keyword call takes one as the keyword-only ``launches`` (beyond the interface,
as the portable ops take ``routing``) and, without it, makes one of its own for that call (its
launches then go through Triton's ``JITFunction.run``, as SGLang's wrappers' do).

Ranks and the pool layout. The kernels contract over each slot's real ``lora_ranks`` entry and read
stacked LoRA-A slice ``p`` at row ``p * rank``, and a shrink's output slice ``p`` at column
``p * rank``: SGLang's packed layout, the pool layout of every provider (:mod:`.slice_layout`).

Mapping of the interface's ops to SGLang's kernels (as in ``TritonLoRABackend``): the shrink ops
(contiguous and permuted) both run ``sgemm_lora_a_fwd``'s kernel, which follows
``batch_info.permutation``; ``chunked_sgmv_lora_expand_fwd`` runs ``sgemm_lora_b_fwd``'s kernel for
one slice, ``gate_up_lora_b_fwd``'s for two equal slices and ``qkv_lora_b_fwd``'s (any slice count,
uneven bands) otherwise (:meth:`.triton_launch.BatchLaunches.expand`).

Two differences from the interface's common contract (:mod:`.base`), both SGLang's kernels' own:

* the B ops add into ``base_output`` in place and return it (callers use the returned tensor);
* a shrink's output is written only for rows of segments whose slot has a non-zero rank, and only
  up to ``num_slices * rank`` columns; everything else is uninitialised. Only the Triton B ops read
  it correctly (they skip those rows and columns), so the selection pairs a Triton shrink with
  Triton expands (:mod:`.selection`).

Capture safety: the kernels read ranks, segments and permutation from device memory and launch
grids from host integers that the graph batch infos keep fixed, so they can be captured in CUDA and
XPU graphs (SGLang captures them in its ``triton`` backend). A launch from a compiled handle goes to
the current stream, so a capture records it like any launch; the first launch of a specialization
compiles, inside a capture too, as SGLang's wrappers do.

Where they run (:func:`triton_support`): on a GPU with an active Triton backend for it; on CPU only
in Triton's interpreter, which only ``SGLANG_XPU_LORA_KERNELS=triton`` uses (tests): ``auto`` and
``native`` never do (it is far slower than the portable ops). :data:`PROVIDER` describes all this
to the selection.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Optional

import torch

from sglang_xpu_lora.providers.base import (
    OP_NAMES, Device, Offer, Provider, device_type, signature,
)
from sglang_xpu_lora.providers.batch_binding import BOUND_PARAMETERS
from sglang_xpu_lora.settings import KERNELS_ENV
from sglang_xpu_lora.upstream import targets
from sglang_xpu_lora.upstream.compat import resolve

if TYPE_CHECKING:
    from sglang.srt.lora.utils import LoRABatchInfo

    from sglang_xpu_lora.providers.triton_launch import TritonLaunches

#: Triton backends that serve each device type.
TRITON_BACKENDS = {"cuda": ("nvidia", "amd"), "xpu": ("intel",)}


def triton_support(device: Device) -> tuple[bool, str]:
    """Whether SGLang's Triton LoRA kernels can run on ``device``, and why (not).

    A GPU device needs an active Triton backend for it (``nvidia``/``amd`` for ``cuda``, ``intel``
    for ``xpu``); CPU tensors run only in Triton's interpreter (``TRITON_INTERPRET=1``).
    """
    kind = device_type(device)
    if kind is None:
        return False, "the serving device is unknown"
    try:
        import triton
    except Exception as exc:  # noqa: BLE001 - a broken Triton is as unusable as a missing one
        return False, f"triton is not importable ({type(exc).__name__}: {exc})"
    if kind == "cpu":
        if os.environ.get("TRITON_INTERPRET") == "1":
            return True, f"Triton {triton.__version__} interpreter (TRITON_INTERPRET=1)"
        return False, "Triton has no CPU backend (TRITON_INTERPRET=1 runs its interpreter, for tests)"
    try:
        from triton.backends import backends
    except Exception as exc:  # noqa: BLE001
        return False, f"triton.backends is not importable ({type(exc).__name__}: {exc})"
    for backend in TRITON_BACKENDS.get(kind, ()):
        if backend in backends and backends[backend].driver.is_active():
            return True, f"Triton {triton.__version__} {backend} backend"
    return False, f"no active Triton backend for {kind} (installed: {', '.join(sorted(backends)) or 'none'})"


@functools.cache
def _embedding_lora_a() -> Callable[..., torch.Tensor]:
    """SGLang's ``embedding_lora_a_fwd``, resolved on first use through its compat target (which
    :func:`sglang_xpu_lora.upstream.compat.check_host` checks, parameters included)."""
    return resolve(targets.TRITON_EMBEDDING_LORA_A)


def bind(names: Iterable[str], batch_info: LoRABatchInfo, launches: TritonLaunches) -> dict[str, Callable[..., torch.Tensor]]:
    """The ops (and chunked-expand forms) ``names`` bound to one batch: name -> a callable that
    takes the per-call arguments of :data:`.batch_binding.BOUND_PARAMETERS` ``[name]`` (or of a
    chunked-expand form of :data:`.batch_binding.UNIFORM_BAND_FORMS`) positionally and launches
    SGLang's kernel as its wrapper would (the same kernel, grid and arguments; tiles:
    :mod:`.triton_launch`), from the kernel's compiled handle after its first launch.

    Every callable is a method of one :class:`.triton_launch.BatchLaunches`,
    ``launches.batch(batch_info)`` (``batch_info``, SGLang's ``LoRABatchInfo``: its tensors and
    host integers are read now; ``launches``: the caller's :class:`.triton_launch.TritonLaunches`,
    which keeps the compiled kernels across batches), which takes those arguments in that order:
    the shrinks (the permuted one too: the kernel reads rows through ``batch_info.permutation``)
    ``shrink``; ``sgemm_lora_b_fwd`` and the one-band form ``expand_one``; ``gate_up_lora_b_fwd``
    and the two-band form ``expand_two``; ``qkv_lora_b_fwd`` ``expand_bands`` (three bands); the
    chunked expand ``expand``, which chooses among those three by its bands per call (host integers
    only).

    Raises:
        KeyError: for an op that is not bound (``embedding_lora_a_fwd``) or unknown.
    """
    methods = {}
    for name in names:
        try:
            methods[name] = _BOUND_METHODS[name]
        except KeyError:
            raise KeyError(f"{name} is not bound to a batch (the bound ops: batch_binding.BOUND_PARAMETERS)") from None
    batch = launches.batch(batch_info)
    return {name: getattr(batch, method) for name, method in methods.items()}


#: The :class:`.triton_launch.BatchLaunches` method of each bound op and chunked-expand form.
_BOUND_METHODS = {
    "sgemm_lora_a_fwd": "shrink",
    "chunked_sgmv_lora_shrink_fwd": "shrink",
    "sgemm_lora_b_fwd": "expand_one",
    "chunked_expand_one_band": "expand_one",
    "gate_up_lora_b_fwd": "expand_two",
    "chunked_expand_two_bands": "expand_two",
    "qkv_lora_b_fwd": "expand_bands",
    "chunked_sgmv_lora_expand_fwd": "expand",
}


# --- the interface's keyword signatures (op tables, tests): each call binds its op -------------


def _keyword_op(op: str) -> Callable[..., torch.Tensor]:
    """Op ``op`` with the interface's signature (:func:`.base.signature`) plus the keyword-only
    ``batch_info`` and, for the ops :func:`bind` binds, the keyword-only ``launches`` (a
    :class:`.triton_launch.TritonLaunches`, None: one of this call's own): the embedding op calls
    SGLang's kernel with the batch info; the others bind the op to it with ``launches``
    (:func:`bind`) and pass the per-call arguments (:data:`.batch_binding.BOUND_PARAMETERS`). The
    loose index arguments are checked for presence only (the batch info describes the batch).

    Raises:
        TypeError: for arguments the interface's signature does not accept.
    """
    interface = signature(op)
    own = [inspect.Parameter("batch_info", inspect.Parameter.KEYWORD_ONLY)]
    if op in _BOUND_METHODS:
        own.append(inspect.Parameter("launches", inspect.Parameter.KEYWORD_ONLY, default=None))
    with_own = interface.replace(parameters=[*interface.parameters.values(), *own])

    def call(*args, **kwargs) -> torch.Tensor:
        arguments = with_own.bind(*args, **kwargs)
        arguments.apply_defaults()
        given = arguments.arguments
        if op == "embedding_lora_a_fwd":  # one call per forward, not bound to the batch
            return _embedding_lora_a()(
                input_ids=given["input_ids"], weights=given["weights"], batch_info=given["batch_info"],
                vocab_size=given["vocab_size"], extra_embeddings=given["extra_embeddings"],
            )
        launches = given["launches"]
        if launches is None:  # this call's own: its launches go through Triton's JITFunction.run
            from sglang_xpu_lora.providers.triton_launch import TritonLaunches  # imports Triton (triton_support's check)

            launches = TritonLaunches()
        return bind((op,), given["batch_info"], launches)[op](*(given[name] for name in BOUND_PARAMETERS[op]))

    call.__name__ = call.__qualname__ = op
    call.__signature__ = with_own
    call.__doc__ = f"SGLang's Triton kernel for the interface's ``{op}`` (:mod:`.base`), called with ``batch_info``."
    return call


#: LoRA-A embedding lookup, ``(s, R)`` in the weights' dtype, zero past each slot's rank.
embedding_lora_a_fwd = _keyword_op("embedding_lora_a_fwd")
sgemm_lora_a_fwd = _keyword_op("sgemm_lora_a_fwd")
sgemm_lora_b_fwd = _keyword_op("sgemm_lora_b_fwd")
qkv_lora_b_fwd = _keyword_op("qkv_lora_b_fwd")
gate_up_lora_b_fwd = _keyword_op("gate_up_lora_b_fwd")
#: The permuted shrink: SGLang's ``sgemm_lora_a_fwd``, which reads rows through
#: ``batch_info.permutation`` (as ``TritonLoRABackend`` does for decode).
chunked_sgmv_lora_shrink_fwd = _keyword_op("chunked_sgmv_lora_shrink_fwd")
#: The expand of ``num_slices`` bands: the kernel as :func:`bind` chooses it.
chunked_sgmv_lora_expand_fwd = _keyword_op("chunked_sgmv_lora_expand_fwd")


class TritonProvider(Provider):
    """SGLang's Triton kernels: every op or none, by where Triton runs (:func:`triton_support`)."""

    def offers(self, device_kind: Optional[str], kernels: str, graph_verdicts: Mapping) -> dict[str, Offer]:
        runs, why = triton_support(device_kind)
        if device_kind == "cpu" and runs and kernels != self.name:
            runs, why = False, f"{KERNELS_ENV}={kernels} does not use the Triton interpreter on CPU"
        return {op: Offer(globals()[op] if runs else None, why) for op in OP_NAMES}

    def unavailable_error(self, op: str, device_kind: Optional[str], reason: str) -> str:
        return (
            f"{KERNELS_ENV}=triton: SGLang's Triton LoRA kernels cannot run on device {device_kind}: {reason}. "
            f"Unset {KERNELS_ENV} or set {KERNELS_ENV}=torch for the portable kernels"
        )

    def bind_to_batch(self, names: tuple, batch_info, launches) -> dict[str, Callable[..., torch.Tensor]]:
        return bind(names, batch_info, launches)


PROVIDER = TritonProvider(
    name="triton", title="Triton", contracts_over_max_rank=False, expands_read_spaced_slices=False,
    shrink_feeds_only_own_expands=True, avoids_host_syncs_in_eager_decode=True, serves_dense_tier=True,
    uses_launch_cache=True,
)
