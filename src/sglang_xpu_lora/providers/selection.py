"""Which provider runs each op, outside graphs (eager) and inside CUDA/XPU graphs, and why.

``SGLANG_XPU_LORA_KERNELS`` (default ``auto``):

* ``auto``: per op, eager: the native sgl-kernel-xpu op when the installed build has it (and, for a
  known device, registers a kernel for it) -> SGLang's Triton kernels when Triton runs on the
  serving device -> the portable PyTorch op. Inside graphs the same order, but a native op only
  when a trial capture at graph set-up showed it captures and replays equal to eager
  (:mod:`.capture_probe`; ``SGLANG_XPU_LORA_GRAPH_NATIVE`` overrides: ``never``, ``always``);
  until the trial (:attr:`OpSelection.graph_decided` False) native ops stay out of graphs.
  ``auto`` never picks Triton on CPU (its interpreter is far slower than the portable ops).
* ``native``: the native op for every op in eager mode, an error naming any missing op; inside
  graphs a native op the trial rejected is replaced as under ``auto``.
* ``triton``: SGLang's Triton kernels for every op, in both modes; an error when Triton cannot run
  on the serving device (on CPU only under ``TRITON_INTERPRET=1``, for tests).
* ``torch``: the portable PyTorch ops everywhere (also lets ``intel_xpu`` run on a device other
  than ``xpu``).

How: every provider describes itself once, in its own module (``PROVIDER``, a
:class:`.base.Provider`: what it offers per op on a device, capture safety, its contract flags);
each setting is an ordered list of them per mode (:data:`SETTINGS`), and :func:`choose` gives
each op the first provider in the list that offers it (inside graphs: that offers it
capture-safe). Nothing here names a provider: the eager-decode rule below reads the descriptors'
``may_sync_with_host`` and ``avoids_host_syncs_in_eager_decode``.

Pairing: a provider whose shrinks leave rows unwritten that only its own expands skip
(``shrink_feeds_only_own_expands``: SGLang's Triton kernels, :mod:`.triton_ops`) serves every
expand fed by its shrink too.

Pool layout: one for every provider, SGLang's packed one (stacked LoRA-A slice ``p`` at row
``p * r``), and every provider runs at each adapter's real rank. Providers whose ops contract over
the full ``max_lora_rank`` (native, portable) need each slot zeroed before it is loaded
(:attr:`OpSelection.needs_zeroed_slots`); providers whose multi-slice expands read each slice at
``p * max_lora_rank`` get it from the backend with one gather per layer
(:meth:`OpSelection.reads_spaced_slices`, :mod:`.slice_layout`).

Logging: :class:`SelectionLog` logs each op not served by the first provider, and each graph
substitution, once per log object (the backend owns one); nothing here keeps state between calls.
"""

from __future__ import annotations

import dataclasses
import logging
import types
from typing import Callable, Mapping, Optional

import torch

from sglang_xpu_lora.providers import native, torch_ops, triton_ops
from sglang_xpu_lora.providers.batch_binding import bind_table
from sglang_xpu_lora.providers.base import (
    OP_NAMES, Device, LoRAOpsProvider, Offer, Provider, device_type,
)
from sglang_xpu_lora.settings import KERNELS_ENV, env_choice

#: Every provider, in order of preference.
PROVIDERS: tuple[Provider, ...] = (native.PROVIDER, triton_ops.PROVIDER, torch_ops.PROVIDER)

#: Expands that read each shrink's output (the backend's routing, :mod:`sglang_xpu_lora.backend.xpu`).
SHRINK_CONSUMERS = {
    "sgemm_lora_a_fwd": ("sgemm_lora_b_fwd", "qkv_lora_b_fwd", "gate_up_lora_b_fwd", "chunked_sgmv_lora_expand_fwd"),
    "chunked_sgmv_lora_shrink_fwd": ("chunked_sgmv_lora_expand_fwd",),
}

logger = logging.getLogger("sglang_xpu_lora.providers")


@dataclasses.dataclass(frozen=True)
class KernelsSetting:
    """One value of ``SGLANG_XPU_LORA_KERNELS``: the providers tried for each op, in order, outside
    graphs (``eager``) and inside them (``graph``), and the provider that must serve every op
    outside graphs (``required``; a start-up error naming the op otherwise)."""

    value: str
    eager: tuple[Provider, ...]
    graph: tuple[Provider, ...]
    required: Optional[Provider] = None

    @property
    def forces_one_provider(self) -> bool:
        """Whether one provider serves every op in both modes (``triton``, ``torch``)."""
        return len(self.graph) == 1

    @property
    def providers(self) -> tuple[Provider, ...]:
        """The providers this setting may use, in order of preference."""
        return tuple(p for p in PROVIDERS if p in self.eager or p in self.graph)


def _settings() -> dict[str, KernelsSetting]:
    """``auto``: every provider in order of preference; a provider's name: that provider for every
    op outside graphs and inside them, or, when its capture safety is decided by trial, inside
    graphs as ``auto`` for the ops the trial rejects."""
    settings = {"auto": KernelsSetting("auto", PROVIDERS, PROVIDERS)}
    for provider in PROVIDERS:
        graph = PROVIDERS if provider.capture_by_trial else (provider,)
        settings[provider.name] = KernelsSetting(provider.name, (provider,), graph, provider)
    return settings


SETTINGS = _settings()
KERNEL_CHOICES = tuple(SETTINGS)


def kernels_setting() -> KernelsSetting:
    """The validated ``SGLANG_XPU_LORA_KERNELS`` setting.

    Raises:
        ValueError: if the variable holds anything but ``auto``, ``native``, ``triton`` or ``torch``.
    """
    advice = f"unset it or set {KERNELS_ENV}=torch for the portable kernels"
    return SETTINGS[env_choice(KERNELS_ENV, tuple(SETTINGS), advice)]


def kernels_choice() -> str:
    """The validated value of ``SGLANG_XPU_LORA_KERNELS`` (:func:`kernels_setting`)."""
    return kernels_setting().value


def portable_kernels_selected() -> bool:
    """True when the portable PyTorch kernels were chosen explicitly (``SGLANG_XPU_LORA_KERNELS=torch``)."""
    setting = kernels_setting()
    return setting.forces_one_provider and setting.required.last_resort


@dataclasses.dataclass(frozen=True)
class OpChoice:
    """Which provider runs one op, and why."""

    op: str
    provider: Provider
    reason: str
    capture_safe: Optional[bool]  #: whether it may run inside graphs; None: not decided by a trial yet
    kernel: Optional[object] = None  #: what a trial capture binds (:class:`.native.KernelOp`), if anything
    #: the op with the table calling convention (interface keywords plus ``batch_info``)
    function: Optional[Callable[..., torch.Tensor]] = dataclasses.field(default=None, repr=False)


@dataclasses.dataclass(frozen=True)
class OpSelection:
    """The op tables the backend calls: :attr:`eager` outside graphs, :attr:`graph` inside them.

    Both are namespaces with the seven op names of :class:`.base.LoRAOpsProvider`; every entry
    takes the interface's keyword arguments plus ``batch_info`` (SGLang's ``LoRABatchInfo``, read
    by the Triton ops, ignored by the others).
    """

    eager: LoRAOpsProvider
    graph: LoRAOpsProvider
    choices: dict  #: op -> OpChoice outside graphs
    graph_choices: dict  #: op -> OpChoice inside graphs
    setting: KernelsSetting  #: the SGLANG_XPU_LORA_KERNELS setting
    device: Optional[str] = None  #: the serving device type the selection was made for
    #: op -> :class:`OpChoice` of the ops that would run inside graphs if a trial capture accepts
    #: them (their providers are captured by trial).
    trial_choices: dict = dataclasses.field(default_factory=dict)
    #: False while ops wait for their trial capture (and stay out of :attr:`graph`).
    graph_decided: bool = True

    @property
    def graph_candidates(self) -> dict:
        """op -> what a trial capture binds (:attr:`OpChoice.kernel`), for the ops of
        :attr:`trial_choices`: what :class:`.capture_probe.CaptureProbe` tries at graph set-up,
        each bound by :meth:`bind_trial`."""
        return {op: choice.kernel for op, choice in self.trial_choices.items()}

    def bind_trial(self, kernel) -> Callable[..., torch.Tensor]:
        """The call a trial capture makes of ``kernel`` (a value of :attr:`graph_candidates`), bound
        by the provider that offered it (:meth:`.base.Provider.bind_trial`).

        Raises:
            KeyError: for a kernel that is not a candidate of this selection.
        """
        for choice in self.trial_choices.values():
            if choice.kernel is kernel:
                return choice.provider.bind_trial(kernel)
        raise KeyError(f"{kernel!r} is not a trial-capture candidate of this selection")

    def dense_tier_serves(self, use_graph: bool) -> bool:
        """Whether the linears of batches outside (``use_graph`` False) or inside graphs belong on the
        dense tier: the provider of their shrink says so (:attr:`.base.Provider.serves_dense_tier`)."""
        return self.choices_for(use_graph)["sgemm_lora_a_fwd"].provider.serves_dense_tier

    def for_graph(self, use_graph: bool) -> LoRAOpsProvider:
        return self.graph if use_graph else self.eager

    def choices_for(self, use_graph: bool) -> dict:
        """op -> :class:`OpChoice` of the table for ``use_graph``."""
        return self.graph_choices if use_graph else self.choices

    @property
    def providers(self) -> frozenset:
        """The providers that serve an op, eager or in graphs."""
        return frozenset(c.provider for c in (*self.choices.values(), *self.graph_choices.values()))

    @property
    def needs_zeroed_slots(self) -> bool:
        """Whether a provider that serves an op, eager or in graphs, contracts over the full
        ``max_lora_rank`` (native, portable): then every pool slot must be zeroed before an adapter
        is loaded into it (zero rank tails, nothing left of a previous tenant)."""
        return any(p.contracts_over_max_rank for p in self.providers)

    @property
    def pool_layout(self) -> str:
        """The LoRA pool layout these ops read, in words (``doctor`` and the backend's log line)."""
        zeroed = ", slots zeroed before each load" if self.needs_zeroed_slots else ""
        return f"SGLang's packed layout at real ranks{zeroed}"

    def reads_spaced_slices(self, op: str, use_graph: bool) -> bool:
        """Whether expand ``op``, as this selection serves it outside (``use_graph`` False) or
        inside graphs, reads a multi-slice input with slice ``p`` at columns ``p * max_lora_rank``
        (native and portable expands) rather than SGLang's packed ``p * rank`` (Triton's)."""
        return self.choices_for(use_graph)[op].provider.expands_read_spaced_slices

    @property
    def uses_launch_cache(self) -> bool:
        """Whether a provider that serves an op, eager or in graphs, launches its kernels through a
        launch cache (:attr:`.base.Provider.uses_launch_cache`): then whoever binds this
        selection's ops to batches owns one and passes it to :meth:`bind_batch`."""
        return any(p.uses_launch_cache for p in self.providers)

    def bind_batch(
        self, use_graph: bool, info, uniform_offsets: Callable[[int, int], torch.Tensor], names, launches,
    ) -> types.SimpleNamespace:
        """The ops (and chunked-expand forms) ``names`` of the table for ``use_graph`` bound to
        the batch ``info`` (SGLang's ``LoRABatchInfo``): callables taking only the per-call
        arguments (:func:`.batch_binding.bind_table`; ``uniform_offsets`` and ``launches``, the
        caller's launch cache, as there)."""
        return bind_table(self.for_graph(use_graph), self.choices_for(use_graph), info, uniform_offsets, names, launches)


def _serve(op: str, order: tuple, offers: Mapping, setting: KernelsSetting, kind: Optional[str], *,
           in_graphs: bool, trials_pass: bool = False) -> OpChoice:
    """The first provider of ``order`` that offers ``op`` (inside graphs: capture-safe, or, with
    ``trials_pass``, to be decided by a trial), with the reasons of the ones passed over.

    Raises:
        RuntimeError: outside graphs, when ``setting.required`` does not offer ``op``.
    """
    passed_over = []
    for provider in order:
        offer: Offer = offers[provider][op]
        if offer.function is None:
            if provider is setting.required and not in_graphs:
                raise RuntimeError(provider.unavailable_error(op, kind, offer.reason))
            passed_over.append(f"no {provider.title}: {offer.reason}")
            continue
        if in_graphs and not (offer.capture_safe or (trials_pass and provider.capture_by_trial)):
            passed_over.append(f"{provider.title} not run inside graphs: {offer.capture_reason}")
            continue
        reason = (offer.capture_reason or offer.reason) if in_graphs else offer.reason
        if setting.forces_one_provider:
            reason = f"{KERNELS_ENV}={setting.value}" + (f" ({reason})" if reason else "")
        else:
            reason = "; ".join([*passed_over, reason] if reason else passed_over)
        return OpChoice(op, provider, reason, True if in_graphs else offer.capture_safe, offer.kernel, offer.function)
    raise LookupError(f"no provider serves {op}: {'; '.join(passed_over)}")


def _pair_shrinks(chosen: dict, offers: Mapping) -> None:
    """Serve every expand that reads the output of a shrink whose provider feeds only its own
    expands by that provider (see the module docstring)."""
    for shrink, expands in SHRINK_CONSUMERS.items():
        provider = chosen[shrink].provider
        if not provider.shrink_feeds_only_own_expands:
            continue
        for op in expands:
            if chosen[op].provider is not provider:
                offer = offers[provider][op]
                reason = f"reads the {provider.title} {shrink} output, which only {provider.title} expands read correctly"
                chosen[op] = OpChoice(op, provider, reason, offer.capture_safe, offer.kernel, offer.function)


#: Eager decode: serve the permuted ops by a provider that never syncs with the host
#: (``avoids_host_syncs_in_eager_decode``: SGLang's Triton kernels) rather than by one whose ops may
#: (``may_sync_with_host``: the native ops, unless a trial capture showed them sync-free), where it
#: offers them. On by evidence: the host reads of the sgl-kernel-xpu decode ops (21 per LoRA
#: module), stood in on an H200, make a Llama-3.1-8B decode step 2.8-5.2x as long as the sync-free
#: Triton path at 1-256 tokens (benchmarks/results/sync-cost-cuda.md; docs/performance.md, "Host
#: syncs in eager decode"). ``examples/xpu/measure.sh`` measures the same trade-off on an Intel GPU.
EAGER_DECODE_AVOIDS_HOST_SYNCS = True
#: The permuted (decode) ops that rule covers.
DECODE_OPS = ("chunked_sgmv_lora_shrink_fwd", "chunked_sgmv_lora_expand_fwd")


def _avoid_host_syncs_in_eager_decode(choices: dict, offers: Mapping, order: tuple) -> None:
    """Apply :data:`EAGER_DECODE_AVOIDS_HOST_SYNCS` to the eager choices (``auto`` only): a decode
    op whose provider may sync with the host and was not shown sync-free by a trial capture moves to
    the first provider of ``order`` that avoids host syncs in eager decode and offers it."""
    for op in DECODE_OPS:
        choice = choices[op]
        if not choice.provider.may_sync_with_host or choice.capture_safe is True:
            continue
        for refuge in order:
            offer = offers[refuge][op]
            if refuge.avoids_host_syncs_in_eager_decode and offer.function is not None:
                reason = (
                    f"{choice.provider.title} syncs with the host, which costs more than {refuge.title} in eager "
                    f"decode; {offer.reason}"
                )
                choices[op] = OpChoice(op, refuge, reason, offer.capture_safe, offer.kernel, offer.function)
                break


def _table(chosen: dict) -> types.SimpleNamespace:
    return types.SimpleNamespace(**{op: c.function for op, c in chosen.items()})


def choose(device: Device = None, graph_verdicts: Optional[dict] = None) -> OpSelection:
    """The selection for ``device`` (see the module docstring), without logging.

    ``graph_verdicts``: op -> :class:`.capture_probe.Verdict` from the trial captures at graph
    set-up; None before them (ops whose capture safety is decided by trial then stay out of
    graphs, :attr:`OpSelection.graph_decided` False, unless ``SGLANG_XPU_LORA_GRAPH_NATIVE`` is
    ``always`` or ``never``).

    Raises:
        ValueError: for an invalid ``SGLANG_XPU_LORA_KERNELS`` or ``SGLANG_XPU_LORA_GRAPH_NATIVE`` value.
        RuntimeError: when the provider ``SGLANG_XPU_LORA_KERNELS`` names cannot serve an op there
            (``native``: names the op and the first build that has it; ``triton``: why Triton
            cannot run on ``device``).
    """
    setting, kind = kernels_setting(), device_type(device)
    offers = {provider: provider.offers(kind, setting.value, graph_verdicts or {}) for provider in setting.providers}

    def serve(order, **how) -> dict:
        return {op: _serve(op, order, offers, setting, kind, **how) for op in OP_NAMES}

    choices = serve(setting.eager, in_graphs=False)
    graph_choices = serve(setting.graph, in_graphs=True)
    optimistic = serve(setting.graph, in_graphs=True, trials_pass=True)  # every trial passed
    if EAGER_DECODE_AVOIDS_HOST_SYNCS and setting.value == "auto":
        _avoid_host_syncs_in_eager_decode(choices, offers, setting.eager)
    for chosen in (choices, graph_choices, optimistic):
        _pair_shrinks(chosen, offers)
    candidates = {op: c for op, c in optimistic.items() if c.provider.capture_by_trial}
    decided = all(choices[op].capture_safe is not None for op in candidates)
    eager = _table(choices)
    graph = eager if graph_choices == choices else _table(graph_choices)
    return OpSelection(eager, graph, choices, graph_choices, setting, kind, candidates, decided)


class SelectionLog:
    """Logs what a selection serves other than by the first provider: each op served by another
    provider outside graphs (a warning for the last resort), and each graph substitution once it is
    decided; each line once per :class:`SelectionLog` (the backend owns one, so it logs once per
    backend however often it selects again)."""

    def __init__(self):
        self._logged: set = set()

    def report(self, selection: OpSelection) -> None:
        if selection.setting.forces_one_provider:
            return
        for op in selection.choices:
            eager, graph = selection.choices[op], selection.graph_choices[op]
            if eager.provider is not PROVIDERS[0] and self._first("eager", op, eager.provider):
                level = logging.WARNING if eager.provider.last_resort else logging.INFO
                logger.log(level, "sglang-xpu-lora: %s uses the %s provider (%s)", op, eager.provider.name, eager.reason)
            elif (selection.graph_decided and eager.provider is not graph.provider
                  and self._first("graph", op, graph.provider)):
                logger.info(
                    "sglang-xpu-lora: %s: %s outside graphs, %s inside graphs (%s)",
                    op, eager.provider.name, graph.provider.name, graph.reason,
                )

    def _first(self, *line) -> bool:
        """Whether ``line`` is logged for the first time here (and remember it)."""
        if line in self._logged:
            return False
        self._logged.add(line)
        return True


def select_ops(
    device: Device = None, graph_verdicts: Optional[dict] = None, log: Optional[SelectionLog] = None
) -> OpSelection:
    """:func:`choose` for ``device`` and ``graph_verdicts``, reported to ``log`` (each line once per
    log; without one, a new log: every line).

    Raises:
        ValueError, RuntimeError: as :func:`choose`.
    """
    selection = choose(device, graph_verdicts)
    (log if log is not None else SelectionLog()).report(selection)
    return selection


def runs_on_device(device: Device) -> bool:
    """Whether ``intel_xpu`` can serve on ``device`` (a device other than ``xpu``): with the portable
    kernels chosen explicitly, or when at least one op is served by a provider other than the last
    resort (a native kernel registered for that device, e.g. the test emulator's CPU build, or
    Triton).

    Raises:
        ValueError: when the selection itself fails (e.g. ``triton`` on a device Triton cannot run on).
    """
    if portable_kernels_selected():
        return True
    if device is None:
        return False
    try:
        selection = choose(device)
    except RuntimeError as exc:
        raise ValueError(str(exc)) from exc
    return any(not c.provider.last_resort for c in selection.choices.values())
