"""Per-batch state of ``IntelXpuLoRABackend`` with the portable ops: each batch's routing lives on
the backend's routes for that batch, nowhere in the process.

Two backends in one process (target and draft under speculative decoding) prepare and run their
batches interleaved; direct calls of the ops run beside a backend's batch; a decode graph captured
on one batch replays on another (a graph API on CPU, tests/fake_graphs.py). Numbers are compared
with the float64 per-row loop (tolerance 1e-5, float32)."""

from __future__ import annotations

import pytest
import torch

from lora_helpers import forward_batch, lora_reference, pool_weights

MAX_LORAS, RANK, HIDDEN = 3, 4, 16
RANKS, SCALINGS = [0, 4, 2], [0.0, 2.0, 0.5]
OUT_DIMS = (8, 4, 4)
OFFSETS = torch.tensor([0, 8, 12, 16], dtype=torch.int32)


@pytest.fixture
def make_backend(monkeypatch, sglang_plugins_loaded):
    from sglang_xpu_lora.backend.xpu import IntelXpuLoRABackend

    monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", "torch")
    return lambda: IntelXpuLoRABackend(max_loras_per_batch=MAX_LORAS, device=torch.device("cpu"))


@pytest.fixture
def routings_built(monkeypatch):
    """How many routings the portable ops computed (host runs and device row slots)."""
    from sglang_xpu_lora.providers.torch_routing import device, host

    built = []
    for module, name in ((host, "read_runs"), (device, "row_slots")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *args, _fn=original, **kwargs: built.append(_fn) or _fn(*args, **kwargs))
    return built


WEIGHTS = pool_weights(RANKS, 3, OUT_DIMS, RANK, HIDDEN)


def run_qkv(backend, x):
    a, b = WEIGHTS
    return backend.run_qkv_lora(x=x, qkv_lora_a=a, qkv_lora_b=b, output_offset=OFFSETS, max_qkv_out_dim=8, base_output=None)


def reference(x, slot_of_row):
    a, b = WEIGHTS
    return lora_reference(x, a, b, OUT_DIMS, slot_of_row, SCALINGS, RANKS)


def test_two_backends_keep_their_own_batch_routing(make_backend, routings_built):
    """Target and draft prepare different batches, then run layers interleaved: each gets its own
    batch's numbers, and each batch's routing is computed by its first layer only, whatever the
    other backend prepares in between (a process-wide cache, reset by every backend's batch,
    recomputed the target's routing after the draft's preparation)."""
    target, draft = make_backend(), make_backend()
    target_slots, draft_slots = [1, 2, 1, 0], [2, 2, 1]
    x_target, x_draft = torch.randn(len(target_slots), HIDDEN), torch.randn(len(draft_slots), HIDDEN)

    target.prepare_lora_batch(forward_batch("DECODE", len(target_slots)), target_slots, RANKS, SCALINGS, False)
    first_layer = run_qkv(target, x_target)
    per_target_layer = len(routings_built)
    assert per_target_layer > 0
    draft.prepare_lora_batch(forward_batch("DECODE", len(draft_slots)), draft_slots, RANKS, SCALINGS, False)
    second_layer = run_qkv(target, x_target)
    assert len(routings_built) == per_target_layer, "the target's routing was recomputed after the draft's batch"
    draft_layers = [run_qkv(draft, x_draft), run_qkv(target, x_target), run_qkv(draft, x_draft)]
    assert len(routings_built) == 2 * per_target_layer  # the draft's batch: once, by its first layer

    expected_target, expected_draft = reference(x_target, target_slots), reference(x_draft, draft_slots)
    for out in (first_layer, second_layer, draft_layers[1]):
        torch.testing.assert_close(out.double(), expected_target, rtol=1e-5, atol=1e-5)
    for out in (draft_layers[0], draft_layers[2]):
        torch.testing.assert_close(out.double(), expected_draft, rtol=1e-5, atol=1e-5)


def test_direct_calls_beside_a_backends_batch_read_their_own_index_tensors(make_backend):
    """A backend's batch turns on nothing for other callers of the ops: a direct call that refills
    its index tensors in place between two calls gets the refilled routing in the second."""
    from sglang_xpu_lora.providers import torch_ops

    backend = make_backend()
    backend.prepare_lora_batch(forward_batch("DECODE", 4), [1, 2, 1, 0], RANKS, SCALINGS, False)
    run_qkv(backend, torch.randn(4, HIDDEN))

    a, _ = pool_weights(RANKS, 1, (8,), RANK, HIDDEN)
    x = torch.randn(6, HIDDEN)
    seg_indptr = torch.tensor([0, 3, 6], dtype=torch.int32)
    weight_indices = torch.tensor([1, 2], dtype=torch.int32)
    ranks = torch.tensor(RANKS, dtype=torch.int32)
    for slots in ([1, 2], [2, 1]):
        weight_indices.copy_(torch.tensor(slots, dtype=torch.int32))
        out = torch_ops.sgemm_lora_a_fwd(x, a, 1, seg_indptr, weight_indices, ranks)
        expected = torch.cat([x[:3].double() @ a[slots[0]].double().t(), x[3:].double() @ a[slots[1]].double().t()])
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_a_captured_decode_graph_recomputes_its_routing_on_replay(make_backend, monkeypatch):
    """SGLang's graph runner prepares a batch, runs it eagerly (warm-up), captures it, and later
    refills the graph's index buffers in place for another batch and replays. The routing computed
    while capturing must be the graph's own (recomputed by each replay), not the warm-up's, and the
    replay must give the new batch's numbers. Device routing, as on an accelerator."""
    from fake_graphs import FakeGraphs

    from sglang_xpu_lora.backend import batch_routes
    from sglang_xpu_lora.providers import torch_ops
    from sglang_xpu_lora.providers.torch_routing import cache

    graphs = FakeGraphs()
    graphs.current = graphs.new_stream(None)
    monkeypatch.setattr(torch_ops, "routes_on_host", lambda x, weights, count_runs: False)
    for module in (cache, batch_routes):
        monkeypatch.setattr(module, "capturing", lambda device: graphs.capturing is not None)

    backend = make_backend()
    backend.init_decode_cuda_graph_batch_info(max_bs_in_cuda_graph=4, num_tokens_per_req=1)
    x = torch.randn(4, HIDDEN)
    captured_slots, replayed_slots = [1, 2, 1, 2], [2, 1, 1, 0]
    backend.prepare_lora_batch(forward_batch("DECODE", 4), captured_slots, RANKS, SCALINGS, True)
    warm_up = run_qkv(backend, x)
    graph = graphs.new_graph()
    graph.capture_begin()
    out = run_qkv(backend, x)
    graph.capture_end()
    torch.testing.assert_close(warm_up.double(), reference(x, captured_slots), rtol=1e-5, atol=1e-5)

    backend.prepare_lora_batch(forward_batch("DECODE", 4), replayed_slots, RANKS, SCALINGS, True)
    graph.replay()
    torch.testing.assert_close(out.double(), reference(x, replayed_slots), rtol=1e-5, atol=1e-5)
