"""A slot is cheap in time (issue 31, item 2): the work ``intel_xpu`` adds to a batch, at the same
active adapters, does not grow with ``--max-loras-per-batch`` S.

Counted, not timed, on SGLang's real batch preparation (``TritonLoRABackend.prepare_lora_batch``,
which the backend inherits) and the portable ops on CPU (host routing): a decode batch and a
prefill batch, prepared and run through one layer's q/k/v, o and gate/up LoRA modules, at S = 16 and
S = 256 with the same 7 adapters active. SGLang's own decode preparation routes per slot (its sgemm
batch info has S segments, most of them empty), so S-sized index tensors are SGLang's; what the
plugin adds on top must stay as it is: the same Python lines executed in the plugin's modules, the
same aten calls, and no tensor larger than a few index entries per slot (the
``benchmarks.slot_cost`` timings are the same question in microseconds).
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Optional

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import sglang_xpu_lora
from lora_helpers import forward_batch

PLUGIN_DIR = str(Path(sglang_xpu_lora.__file__).parent)
SLOTS = (16, 256)
ACTIVE, RANK, HIDDEN, KV, INTERMEDIATE = 7, 16, 512, 128, 512
DECODE_REQUESTS, PREFILL_REQUESTS, PREFILL_LEN = 64, 8, 16


class WorkCounter(TorchDispatchMode):
    """Aten calls, and the elements of the tensors they return (views aside: no new data)."""

    def __init__(self):
        super().__init__()
        self.ops = self.elements = 0

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        if not func.is_view:
            self.elements += sum(v.numel() for v in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(v, torch.Tensor))
        return out


def plugin_lines(fn) -> int:
    """Python lines executed in the plugin's own modules while ``fn()`` runs."""
    count = 0

    def local(frame, event, arg):
        nonlocal count
        count += event == "line"
        return local

    def calls(frame, event, arg):
        return local if frame.f_code.co_filename.startswith(PLUGIN_DIR) else None

    sys.settrace(calls)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


def layer_weights(slots: int) -> dict:
    """q/k/v, o and gate/up pool buffers for ``slots`` slots, adapters in slots 1..ACTIVE."""
    generator = torch.Generator().manual_seed(0)
    shapes = {"qkv": (3, HIDDEN + 2 * KV), "o": (1, HIDDEN), "gate_up": (2, 2 * INTERMEDIATE)}
    weights = {}
    for module, (stack, out) in shapes.items():
        a, b = torch.zeros(slots, stack * RANK, HIDDEN), torch.zeros(slots, out, RANK)
        a[1 : ACTIVE + 1] = torch.randn(ACTIVE, stack * RANK, HIDDEN, generator=generator)
        b[1 : ACTIVE + 1] = torch.randn(ACTIVE, out, RANK, generator=generator)
        weights[module] = (a, b)
    return weights


@pytest.fixture
def batch_runner(monkeypatch, sglang_plugins_loaded):
    """``run(slots, phase, requests=None)`` -> ``(one batch, its SGLang-only preparation)``: callables
    that prepare the same batch (``phase`` decode or prefill, ``requests`` requests, by default
    DECODE_REQUESTS or PREFILL_REQUESTS, over slots 1..ACTIVE in turn) on an ``intel_xpu``
    backend with the portable ops (and run one layer's LoRA modules) or on SGLang's
    ``TritonLoRABackend`` (preparation only), after one warm-up batch each."""
    from sglang.srt.lora.backend.triton_backend import TritonLoRABackend

    from sglang_xpu_lora.backend.xpu import IntelXpuLoRABackend

    monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", "torch")
    offsets = torch.tensor([0, HIDDEN, HIDDEN + KV, HIDDEN + 2 * KV], dtype=torch.int32)

    def run(slots: int, phase: str, requests: Optional[int] = None):
        requests = requests or (DECODE_REQUESTS if phase == "decode" else PREFILL_REQUESTS)
        lens = None if phase == "decode" else [PREFILL_LEN] * requests
        batch = forward_batch("DECODE" if phase == "decode" else "EXTEND", requests, lens)
        indices = [1 + i % ACTIVE for i in range(requests)]
        ranks, scalings = [0] * slots, [0.0] * slots
        for slot in range(1, ACTIVE + 1):
            ranks[slot], scalings[slot] = RANK, 0.5
        x = torch.randn(requests if lens is None else sum(lens), HIDDEN)
        weights = layer_weights(slots)
        backend = IntelXpuLoRABackend(max_loras_per_batch=slots, device=torch.device("cpu"))
        backend.lora_memory_pool = types.SimpleNamespace(max_lora_rank=RANK)
        sglang = TritonLoRABackend(max_loras_per_batch=slots, device=torch.device("cpu"))

        def one_batch():
            backend.prepare_lora_batch(batch, indices, ranks, scalings, False)
            backend.run_qkv_lora(x=x, qkv_lora_a=weights["qkv"][0], qkv_lora_b=weights["qkv"][1],
                                 output_offset=offsets, max_qkv_out_dim=HIDDEN)
            backend.run_lora_b_sgemm(x=backend.run_lora_a_sgemm(x, weights["o"][0]), weights=weights["o"][1])
            backend.run_gate_up_lora(x=x, gate_up_lora_a=weights["gate_up"][0], gate_up_lora_b=weights["gate_up"][1])

        def sglang_prepare():
            sglang.prepare_lora_batch(batch, indices, ranks, scalings, False)

        one_batch(), sglang_prepare()
        return one_batch, sglang_prepare

    return run


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_plugin_python_per_batch_does_not_grow_with_slots(batch_runner, phase):
    """The plugin's Python per batch (preparation, routes, bound ops, host routing) depends on the
    active adapters only; it read SGLang's S per-slot decode segments one by one before."""
    lines = {slots: plugin_lines(batch_runner(slots, phase)[0]) for slots in SLOTS}
    assert lines[SLOTS[0]] == lines[SLOTS[1]], lines


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_plugin_tensor_work_per_batch_does_not_grow_with_slots(batch_runner, phase):
    """Beyond SGLang's own preparation: the same aten calls at every S, and at most a few index
    entries per slot (rank and slot conversions), nothing that scales with S times the tokens or
    the weights."""
    added = {}
    for slots in SLOTS:
        one_batch, sglang_prepare = batch_runner(slots, phase)
        with WorkCounter() as ours:
            one_batch()
        with WorkCounter() as sglang:
            sglang_prepare()
        added[slots] = (ours.ops - sglang.ops, ours.elements - sglang.elements)
    (ops_small, elements_small), (ops_large, elements_large) = added[SLOTS[0]], added[SLOTS[1]]
    assert ops_small == ops_large, added
    assert elements_large - elements_small <= 8 * (SLOTS[1] - SLOTS[0]), added


def test_the_count_sees_work_that_grows_with_slots(batch_runner, monkeypatch):
    """The tensor count catches work proportional to S: the portable ops' device routing (what
    they run on an accelerator) in its every-slot form multiplies every row with every slot's
    weights."""
    from sglang_xpu_lora.providers import torch_ops
    from sglang_xpu_lora.providers.torch_routing import device

    monkeypatch.setattr(torch_ops, "routes_on_host", lambda x, weights, count_runs: False)
    monkeypatch.setattr(device, "gathers_rows", lambda *shape, **form: False)
    elements = {}
    for slots in SLOTS:
        one_batch, _ = batch_runner(slots, "decode")
        with WorkCounter() as ours:
            one_batch()
        elements[slots] = ours.elements
    assert elements[SLOTS[1]] - elements[SLOTS[0]] > 8 * (SLOTS[1] - SLOTS[0]) * DECODE_REQUESTS, elements


class MemoryCounter(TorchDispatchMode):
    """Elements an accelerator moves, counted per aten call: what every call other than a view
    writes, and the operands GEMMs read in full (an index or gather call reads what it writes)."""

    GEMMS = ("mm", "addmm", "bmm", "baddbmm")

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = lambda values: [v for v in values if isinstance(v, torch.Tensor)]  # noqa: E731
        if not func.is_view:
            self.elements += sum(v.numel() for v in tensors(out if isinstance(out, (tuple, list)) else (out,)))
        if func.overloadpacket.__name__.rstrip("_") in self.GEMMS:
            self.elements += sum(v.numel() for v in tensors(args))
        return out


@pytest.mark.parametrize("requests, few_slots", [(2, 8), (16, 64)], ids=["2-requests", "16-requests"])
def test_device_routing_work_for_a_small_decode_batch_does_not_grow_with_slots(batch_runner, monkeypatch, requests, few_slots):
    """On an accelerator (the portable ops' device routing, forced here on CPU tensors), a decode
    batch of a few requests over the same adapters costs the same FLOPs and moves the same elements
    at S = 256 as at few slots, within 1.1x, beyond SGLang's own preparation: its rows gather their
    own slots' weights once they are fewer than about a third of the slots. Before, every row was
    multiplied with every slot's weights: 30x the work at S = 256 as at S = 8."""
    from sglang_xpu_lora.providers import torch_ops

    monkeypatch.setattr(torch_ops, "routes_on_host", lambda x, weights, count_runs: False)
    work = {}
    for slots in (few_slots, 256):
        one_batch, sglang_prepare = batch_runner(slots, "decode", requests)
        with FlopCounterMode(display=False) as flops, MemoryCounter() as ours:
            one_batch()
        with MemoryCounter() as sglang:
            sglang_prepare()
        work[slots] = (flops.get_total_flops(), ours.elements - sglang.elements)
    (flops_few, moved_few), (flops_many, moved_many) = work[few_slots], work[256]
    assert flops_few > 0 and moved_few > 0, work
    assert flops_many <= 1.1 * flops_few and moved_many <= 1.1 * moved_few, work
