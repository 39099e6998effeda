"""Routing strategies of the portable ops: the device path is graph-safe (no host reads, no
data-dependent shapes); the host path, used for CPU tensors, runs one GEMM per run of a slot.

Numerical agreement of both strategies with a float64 reference is in ``test_torch_ops.py``.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sglang_xpu_lora.providers import torch_ops
from sglang_xpu_lora.providers.torch_routing import device, host


# --- graph safety --------------------------------------------------------------------------------

#: aten ops that read device memory on the host or give data-dependent shapes.
HOST_SYNC_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "item", "is_nonzero", "equal")


class HostSyncDetector(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.offenders = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        bool_index = name in ("index", "index_put", "index_put_") and any(
            isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in (args[1] if len(args) > 1 else []) or []
        )
        if name.startswith(HOST_SYNC_OPS) or bool_index:
            self.offenders.append(name)
        return func(*args, **(kwargs or {}))


def test_host_sync_detector_sees_item_and_boolean_indexing():
    x = torch.arange(4.0)
    with HostSyncDetector() as detector:
        x.sum().item()
        x[x > 1]
    assert detector.offenders and all(name in HOST_SYNC_OPS + ("index",) for name in detector.offenders)


def decode_batch():
    """64 decode requests over 2 adapters, sorted by slot as SGLang's decode routing does."""
    slot_of_request = torch.tensor([i % 2 for i in range(64)])
    return dict(
        x=torch.randn(64, 16), a=torch.randn(2, 12, 16), b=torch.randn(2, 10, 4), mid=torch.randn(64, 12),
        base=torch.randn(64, 10), offsets=torch.tensor([0, 6, 8, 10], dtype=torch.int32), scalings=torch.ones(2),
        permutation=torch.argsort(slot_of_request, stable=True).to(torch.int32),
        common=dict(
            seg_indptr=torch.tensor([0, 32, 64], dtype=torch.int32),
            weight_indices=torch.tensor([0, 1], dtype=torch.int32),
            lora_ranks=torch.tensor([4, 4]),
        ),
    )


#: The device routing's two GEMM forms (:func:`device.gathers_rows`), forced.
GEMM_FORMS = pytest.mark.parametrize("gathered", [False, True], ids=["every-slot", "gathered-rows"])


@GEMM_FORMS
def test_device_routing_is_free_of_host_syncs_and_data_dependent_shapes(monkeypatch, gathered):
    """On "meta" tensors (an accelerator stand-in without data), any host read would fail or show;
    in either GEMM form."""
    monkeypatch.setattr(device, "gathers_rows", lambda *shape, **form: gathered)
    p = {k: v.to("meta") if isinstance(v, torch.Tensor) else {n: t.to("meta") for n, t in v.items()} for k, v in decode_batch().items()}
    common, offsets = p["common"], p["offsets"]
    with HostSyncDetector() as detector:
        torch_ops.sgemm_lora_a_fwd(p["x"], p["a"], 3, **common)
        torch_ops.chunked_sgmv_lora_shrink_fwd(p["x"], p["a"], 3, 1, permutation=p["permutation"], **common)
        torch_ops.qkv_lora_b_fwd(p["mid"], p["b"], offsets, 6, scalings=p["scalings"], base_output=p["base"], **common)
        torch_ops.chunked_sgmv_lora_expand_fwd(
            p["mid"], p["b"], offsets, 6, 3, 1, scalings=p["scalings"], permutation=p["permutation"], **common
        )
        torch_ops.sgemm_lora_b_fwd(p["mid"][:, :4], p["b"], scalings=p["scalings"], **common)
        torch_ops.gate_up_lora_b_fwd(p["mid"][:, :8], p["b"], 5, scalings=p["scalings"], **common)
        torch_ops.embedding_lora_a_fwd(torch.arange(64, device="meta") % 16, p["a"][:, :4], 16, **common)
    assert detector.offenders == []


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func.overloadpacket.__name__.rstrip("_")] += 1  # in-place ops count as theirs
        return func(*args, **(kwargs or {}))


def test_cpu_routes_on_the_host_except_small_problems_with_several_runs():
    """A Llama-8B-sized qkv shrink routes on the host; a tiny model's with 8 adapters takes the device
    routing, whose fixed few kernels cost less than a GEMM call per adapter; one run stays on the host."""
    llama_qkv_a, tiny_qkv_a = torch.empty(8, 3 * 16, 4096), torch.empty(8, 3 * 16, 128)
    assert torch_ops.routes_on_host(torch.empty(32, 4096), llama_qkv_a, lambda: 8)
    assert not torch_ops.routes_on_host(torch.empty(32, 128), tiny_qkv_a, lambda: 8)
    assert torch_ops.routes_on_host(torch.empty(32, 128), tiny_qkv_a, lambda: 1)
    assert torch_ops.routes_on_host(torch.empty(4096, 128), tiny_qkv_a, lambda: 8)  # the L-fold GEMM grows
    assert not torch_ops.routes_on_host(torch.empty(32, 4096, device="meta"), llama_qkv_a.to("meta"), None)


def test_cpu_gathers_each_rows_own_weights_for_a_batch_of_many_adapters():
    """A decode batch of 64 requests over 64 adapters (the tiny Llama, 64 slots): the host routing
    would make 64 GEMM calls, the every-slot GEMM 64 times the multiply-adds; the device routing
    gathers each row's own adapter instead. The same batch over 8 of the 64 slots stays on the host."""
    tiny_qkv_a, x = torch.empty(64, 3 * 8, 128), torch.empty(64, 128)
    assert not torch_ops.routes_on_host(x, tiny_qkv_a, lambda: 64)
    assert device.gathers_rows(64, 64, 3 * 8, 128, on_cpu=True)
    assert torch_ops.routes_on_host(x, tiny_qkv_a, lambda: 8)
    assert not device.gathers_rows(64, 8, 3 * 8, 128, on_cpu=True)  # 8 slots: one GEMM with each costs less


def test_accelerator_tensors_never_read_index_tensors_on_the_host(monkeypatch):
    """On a device other than CPU the host routing is not even considered (it would synchronise)."""
    monkeypatch.setattr(host, "read_runs", None)  # any host routing would fail
    p = decode_batch()
    meta = {k: v.to("meta") for k, v in p["common"].items()}
    out = torch_ops.chunked_sgmv_lora_shrink_fwd(p["x"].to("meta"), p["a"].to("meta"), 3, 2, permutation=p["permutation"].to("meta"), **meta)
    assert out.shape == (64, 12) and out.device.type == "meta"


def test_host_routing_runs_one_gemm_per_adapter_and_slice_for_a_permuted_decode_batch(monkeypatch):
    """One GEMM per adapter and slice (SGLang's torch_native would run one per request), and one
    gather and one scatter per adapter."""
    monkeypatch.setattr(torch_ops, "routes_on_host", lambda x, weights, count_runs: True)
    p = decode_batch()
    common = dict(p["common"], permutation=p["permutation"])
    with OpCounter() as shrink:
        torch_ops.chunked_sgmv_lora_shrink_fwd(p["x"], p["a"], 3, 2, **common)
    with OpCounter() as expand:
        torch_ops.chunked_sgmv_lora_expand_fwd(p["mid"], p["b"], p["offsets"], 6, 3, 2, scalings=p["scalings"], **common)
    assert shrink.calls["mm"] == 2 and shrink.calls["index_select"] == 2 and shrink.calls["index_copy"] == 2
    assert expand.calls["addmm"] == 6 and expand.calls["index_select"] == 2 and expand.calls["index_copy"] == 2


def test_host_routing_reads_contiguous_runs_in_place(monkeypatch):
    """Without a permutation (prefill), each run is a row range of the input: no gather or scatter."""
    monkeypatch.setattr(torch_ops, "routes_on_host", lambda x, weights, count_runs: True)
    p = decode_batch()
    with OpCounter() as ops:
        mid = torch_ops.sgemm_lora_a_fwd(p["x"], p["a"], 3, **p["common"])
        torch_ops.qkv_lora_b_fwd(mid, p["b"], p["offsets"], 6, scalings=p["scalings"], **p["common"])
    assert ops.calls["mm"] == 2 and ops.calls["addmm"] == 6
    assert not ops.calls["index_select"] and not ops.calls["index_add"] and not ops.calls["index_copy"]


def test_a_routing_cache_computes_routing_once_per_batch_and_a_new_one_afresh(monkeypatch):
    """Every layer calls the ops with the same index tensors: through one RoutingCache the routing
    kernels run once; a new cache (the next batch's) reads refilled index tensors anew; without
    one, each call computes its own routing."""
    monkeypatch.setattr(torch_ops, "routes_on_host", lambda x, weights, count_runs: False)
    p = decode_batch()

    def run(routing=None):  # a fresh view of the permutation each call, as the backend passes it
        return torch_ops.chunked_sgmv_lora_shrink_fwd(
            p["x"], p["a"], 3, 2, permutation=p["permutation"][:64], **p["common"], routing=routing
        )

    with OpCounter() as uncached:
        first = [run() for _ in range(3)]
    routing = torch_ops.RoutingCache()
    with OpCounter() as cached:
        again = [run(routing) for _ in range(3)]
    assert uncached.calls["searchsorted"] == 3 and cached.calls["searchsorted"] == 1
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    # The next batch refills the same buffers in place (as SGLang's graph buffers are).
    p["common"]["weight_indices"].copy_(torch.tensor([1, 0], dtype=torch.int32))
    expected = torch.where(
        (torch.arange(64) % 2 == 0).unsqueeze(1), p["x"] @ p["a"][1].t(), p["x"] @ p["a"][0].t()
    )
    assert torch.allclose(run(torch_ops.RoutingCache()), expected, atol=1e-4)
    assert torch.allclose(run(), expected, atol=1e-4)


def test_an_overflowing_adapter_leaves_other_rows_alone(routing):
    """fp16: slot 1's product overflows to Inf; rows of slot 0 (and rows outside every segment)
    must still get exactly slot 0's result (0 * Inf would be NaN if slots were mixed by a product)."""
    x = torch.ones(4, 8, dtype=torch.float16)
    a = torch.stack([torch.full((4, 8), 0.5), torch.full((4, 8), 3e4)]).to(torch.float16)
    meta = dict(seg_indptr=torch.tensor([0, 2, 3], dtype=torch.int32), weight_indices=torch.tensor([0, 1], dtype=torch.int32),
                lora_ranks=torch.tensor([4, 4]))
    out = torch_ops.sgemm_lora_a_fwd(x, a, 1, **meta)
    assert torch.equal(out[:2], torch.full((2, 4), 4.0, dtype=torch.float16))
    assert torch.isinf(out[2]).all() and torch.equal(out[3], torch.zeros(4, dtype=torch.float16))


def test_a_batch_without_segments_gets_no_lora(routing):
    seg, wi = torch.tensor([0], dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    out = torch_ops.sgemm_lora_a_fwd(torch.ones(3, 8), torch.ones(2, 4, 8), 1, seg, wi, torch.tensor([4, 4]))
    assert torch.equal(out, torch.zeros(3, 4))


@GEMM_FORMS
def test_device_gemms_in_row_chunks_give_the_same_numbers(monkeypatch, gathered):
    """A long batch's GEMMs run in row chunks (bounded all-slot products or gathered weights): the
    same numbers, to the rounding of a GEMM with fewer rows, for the shrink, and for the expand with
    bands known on the host (gate_up) and bands read on the device (qkv)."""
    monkeypatch.setattr(torch_ops, "routes_on_host", lambda x, weights, count_runs: False)
    monkeypatch.setattr(device, "gathers_rows", lambda *shape, **form: gathered)
    p = decode_batch()
    common = dict(p["common"], permutation=p["permutation"])

    def run():
        return (
            torch_ops.chunked_sgmv_lora_expand_fwd(p["mid"], p["b"], p["offsets"], 6, 3, 2, scalings=p["scalings"], base_output=p["base"].clone(), **common),
            torch_ops.gate_up_lora_b_fwd(p["mid"][:, :8], p["b"], 5, scalings=p["scalings"], **p["common"]),
            torch_ops.chunked_sgmv_lora_shrink_fwd(p["x"], p["a"], 3, 2, **common),
        )

    whole = run()
    # 7 rows per chunk of the expand's every-slot products (2 slots x 10 columns x 3 slices): 9
    # chunks, the last short; the other intermediates are chunked by the same budget
    monkeypatch.setattr(device, "MAX_PRODUCT_ELEMENTS", 7 * 2 * 10 * 3)
    for chunked, one_chunk in zip(run(), whole):
        torch.testing.assert_close(chunked, one_chunk, rtol=1e-6, atol=1e-6)


def test_the_gemm_form_follows_host_shapes_only():
    """Every slot's product while the batch has rows enough to use each slot's weights read; each
    row's own weights gathered once rows are fewer than about a third of the slots (a decode batch
    at many slots), whatever the batch's index tensors hold: rows, slots and the weights' shape."""
    llama_qkv_a = dict(out_dim=3 * 16, depth=4096)  # the shrink: rank-16 q/k/v over hidden 4096
    llama_qkv_b = dict(out_dim=6144, depth=16, products=3)  # the expand, bands read on the device
    for shape in (llama_qkv_a, llama_qkv_b):
        assert not device.gathers_rows(rows=64, slots=8, **shape)
        assert device.gathers_rows(rows=2, slots=8, **shape)
        assert device.gathers_rows(rows=64, slots=256, **shape)
        assert not device.gathers_rows(rows=8192, slots=8, **shape)
    assert not device.gathers_rows(rows=4, slots=8, **llama_qkv_a)  # 4 rows' weights: half the slots'
    assert device.gathers_rows(rows=4, slots=8, **llama_qkv_b)  # rank-16 weights, fewer than 4 x 8 x 3 products
    assert not device.gathers_rows(rows=1, slots=1, out_dim=48, depth=4096)  # one slot: nothing to save


class GemmShapes(TorchDispatchMode):
    """Records (rows, inner, columns) of every mm/addmm."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__.rstrip("_")
        if name in ("mm", "addmm"):
            a, b = (args[0], args[1]) if name == "mm" else (args[1], args[2])
            self.shapes.append((a.shape[0], a.shape[1], b.shape[1]))
        return func(*args, **(kwargs or {}))


def test_host_routing_contracts_over_each_slots_real_rank(monkeypatch):
    """Slot ranks 0 (the base model's slot), 2 and 4 under max_rank 4: the rank-0 run does no GEMM,
    the rank-2 run's shrink is one GEMM over its 3 * 2 packed A rows (its output columns from 6 on
    zero), its expand GEMMs have an inner size of 2 per slice."""
    from sglang_xpu_lora.providers import slice_layout

    monkeypatch.setattr(torch_ops, "routes_on_host", lambda x, weights, count_runs: True)
    p = decode_batch()
    meta = dict(seg_indptr=torch.tensor([0, 10, 30, 64], dtype=torch.int32),
                weight_indices=torch.tensor([0, 1, 2], dtype=torch.int32), lora_ranks=torch.tensor([0, 2, 4]))
    a, b = torch.randn(3, 12, 16), torch.randn(3, 10, 4)
    a[1, 6:] = 0  # packed: the rank-2 slot's three slices in rows 0-5
    b[1, :, 2:] = 0
    with GemmShapes() as shrink:
        mid = torch_ops.sgemm_lora_a_fwd(p["x"], a, 3, **meta)
    spaced = slice_layout.spaced_slices(mid, slice_layout.spacing_index(
        meta["seg_indptr"], meta["weight_indices"], meta["lora_ranks"], 64, 3, 4))
    with GemmShapes() as expand:
        torch_ops.qkv_lora_b_fwd(spaced, b, p["offsets"], 6, scalings=p["scalings"].new_ones(3), **meta)
    assert shrink.shapes == [(20, 16, 6), (34, 16, 12)]
    assert expand.shapes == [(20, 2, 6), (20, 2, 2), (20, 2, 2), (34, 4, 6), (34, 4, 2), (34, 4, 2)]
    assert torch.equal(mid[:10], torch.zeros(10, 12)) and torch.equal(mid[10:30, 6:], torch.zeros(20, 6))
