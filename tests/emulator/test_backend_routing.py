"""``IntelXpuLoRABackend`` routing with the native provider (emulated ``full`` build): which op each
batch shape reaches, graph-mode substitution decided by the trial captures at graph set-up (on a
graph API on CPU, tests/fake_graphs.py), and numbers against a float64 reference."""

from __future__ import annotations

import pytest
import torch

from lora_helpers import forward_batch, lora_reference, pool_weights

MAX_LORAS, RANK, HIDDEN = 3, 4, 16
RANKS, SCALINGS = [0, 4, 2], [0.0, 2.0, 0.5]


@pytest.fixture(params=["full"])
def backend_factory(request, emulate, sglang_plugins_loaded):
    from sglang_xpu_lora.backend.xpu import IntelXpuLoRABackend

    with emulate(request.param) as calls:
        yield lambda: IntelXpuLoRABackend(max_loras_per_batch=MAX_LORAS, device=torch.device("cpu")), calls


@pytest.fixture
def graphs_on_cpu(monkeypatch):
    """Trial captures on CPU through the graph API of tests/fake_graphs.py."""
    from fake_graphs import FakeGraphs

    from sglang_xpu_lora.providers import capture_probe

    graphs = FakeGraphs()
    monkeypatch.setattr(capture_probe, "device_graphs", lambda device_type: (graphs, ""))
    return graphs


def layer_weights(num_slices, out_dims, seed=0):
    return pool_weights(RANKS, num_slices, out_dims, RANK, HIDDEN, seed)


def reference(x, a, b, out_dims, slot_of_row, base):
    return lora_reference(x, a, b, out_dims, slot_of_row, SCALINGS, RANKS, base)


@pytest.mark.parametrize(
    "out_dims, kernel",
    [((8, 4, 4), "qkv_lora_b_fwd"), ((6, 10), "chunked_sgmv_lora_expand_fwd"), ((4, 4, 6, 2), "chunked_sgmv_lora_expand_fwd")],
    ids=["3-slices-qkv", "2-slices-mla", "4-slices-gdn"],
)
def test_prefill_qkv_routing_by_slice_count(backend_factory, out_dims, kernel):
    make, calls = backend_factory
    backend = make()
    lens, weight_indices = [3, 0, 5], [1, 0, 2]
    backend.prepare_lora_batch(forward_batch("EXTEND", len(lens), lens=lens), weight_indices, RANKS, SCALINGS, False)
    assert backend._sgemm_info().permutation is None
    n = len(out_dims)
    a, b = layer_weights(n, out_dims)
    x, base = torch.randn(sum(lens), HIDDEN), torch.randn(sum(lens), sum(out_dims))
    offsets = torch.tensor([0, *torch.tensor(out_dims).cumsum(0).tolist()], dtype=torch.int32)
    calls.clear()
    out = backend.run_qkv_lora(
        x=x, qkv_lora_a=a, qkv_lora_b=b, output_offset=offsets, max_qkv_out_dim=max(out_dims), base_output=base, n_slices=n,
    )
    assert dict(calls) == {"sgemm_lora_a_fwd": 1, kernel: 1}
    slot_of_row = [1] * 3 + [2] * 5
    torch.testing.assert_close(out.double(), reference(x, a, b, out_dims, slot_of_row, base), rtol=1e-5, atol=1e-5)


def test_decode_uses_chunked_sgmv_with_the_permutation(backend_factory):
    make, calls = backend_factory
    backend = make()
    weight_indices = [2, 1, 2, 0, 1]
    backend.prepare_lora_batch(forward_batch("DECODE", 5), weight_indices, RANKS, SCALINGS, False)
    assert backend._sgemm_info().permutation is not None
    a, b = layer_weights(2, (6, 6))
    x, base = torch.randn(5, HIDDEN), torch.randn(5, 12)
    calls.clear()
    out = backend.run_gate_up_lora(x=x, gate_up_lora_a=a, gate_up_lora_b=b, base_output=base)
    assert dict(calls) == {"chunked_sgmv_lora_shrink_fwd": 1, "chunked_sgmv_lora_expand_fwd": 1}
    torch.testing.assert_close(out.double(), reference(x, a, b, (6, 6), weight_indices, base), rtol=1e-5, atol=1e-5)


def run_layer_ops(backend, x, seed=1):
    a3, b3 = layer_weights(3, (8, 4, 4), seed)
    a2, b2 = layer_weights(2, (6, 6), seed + 1)
    a1, b1 = layer_weights(1, (10,), seed + 2)
    offsets = torch.tensor([0, 8, 12, 16], dtype=torch.int32)
    return [
        backend.run_qkv_lora(x=x, qkv_lora_a=a3, qkv_lora_b=b3, output_offset=offsets, max_qkv_out_dim=8, base_output=None),
        backend.run_gate_up_lora(x=x, gate_up_lora_a=a2, gate_up_lora_b=b2),
        backend.run_lora_b_sgemm(x=backend.run_lora_a_sgemm(x, a1), weights=b1, base_output=None),
    ]


@pytest.mark.parametrize("backend_factory, native_in_graphs", [("full", False), ("full-syncfree", True)], indirect=["backend_factory"])
def test_decode_graph_batch_runs_the_native_ops_its_trial_accepted_and_matches_eager(backend_factory, graphs_on_cpu, native_in_graphs):
    make, calls = backend_factory
    weight_indices = [2, 1, 2, 0]
    x = torch.randn(4, HIDDEN)
    eager_backend = make()
    eager_backend.prepare_lora_batch(forward_batch("DECODE", 4), weight_indices, RANKS, SCALINGS, False)
    calls.clear()
    eager = run_layer_ops(eager_backend, x)
    assert set(calls) == {"chunked_sgmv_lora_shrink_fwd", "chunked_sgmv_lora_expand_fwd"}  # native outside graphs

    graph_backend = make()
    assert not graph_backend.op_selection.graph_decided
    graph_backend.init_decode_cuda_graph_batch_info(max_bs_in_cuda_graph=8, num_tokens_per_req=1)
    assert graph_backend.op_selection.graph_decided
    assert graphs_on_cpu.captures and all(c["ended"] for c in graphs_on_cpu.captures)  # tried at graph set-up
    assert graphs_on_cpu.current is graphs_on_cpu.default_stream
    graph_backend.prepare_lora_batch(forward_batch("DECODE", 4), weight_indices, RANKS, SCALINGS, True)
    assert graph_backend._sgemm_info().use_cuda_graph
    calls.clear()
    graphed = run_layer_ops(graph_backend, x)
    native_calls = {"chunked_sgmv_lora_shrink_fwd", "chunked_sgmv_lora_expand_fwd"} if native_in_graphs else set()
    assert set(calls) == native_calls
    for got, expected in zip(graphed, eager):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend_factory", ["full-syncfree"], indirect=True)
def test_prefill_graph_batch_uses_capture_safe_bounds(backend_factory, monkeypatch):
    """With native ops inside graphs (``always`` here; on a GPU: a passing trial), the prefill
    graph's native calls get capture-safe bounds and the padding rows no LoRA."""
    monkeypatch.setenv("SGLANG_XPU_LORA_GRAPH_NATIVE", "always")
    make, calls = backend_factory
    lens, weight_indices = [3, 5], [1, 2]
    x = torch.randn(8, HIDDEN)
    eager_backend = make()
    eager_backend.prepare_lora_batch(forward_batch("EXTEND", len(lens), lens=lens), weight_indices, RANKS, SCALINGS, False)
    eager = run_layer_ops(eager_backend, x)

    graph_backend = make()
    graph_backend.init_prefill_cuda_graph_batch_info(max_num_tokens=32, max_num_requests=4)
    graph_backend.prepare_lora_batch(forward_batch("EXTEND", len(lens), lens=lens), weight_indices, RANKS, SCALINGS, False, use_prefill_cuda_graph=True)
    padded = torch.cat([x, torch.randn(4, HIDDEN)])  # a captured graph runs on its padded token count
    seen_max_len = []
    embedding = graph_backend.op_selection.graph.embedding_lora_a_fwd
    monkeypatch.setattr(
        graph_backend.op_selection.graph, "embedding_lora_a_fwd",
        lambda **kw: seen_max_len.append(kw["max_len"]) or embedding(**kw),
    )
    calls.clear()
    graphed = run_layer_ops(graph_backend, padded)
    ids = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0])
    graph_backend.run_lora_a_embedding(input_ids=ids, weights=torch.randn(MAX_LORAS, RANK, 10), vocab_size=10)
    assert set(calls) == {"sgemm_lora_a_fwd", "qkv_lora_b_fwd", "gate_up_lora_b_fwd", "sgemm_lora_b_fwd", "embedding_lora_a_fwd"}
    assert seen_max_len == [16]  # the fixed chunk size, never the live batch's longest segment
    for got, expected in zip(graphed, eager):
        torch.testing.assert_close(got[:8], expected, rtol=1e-5, atol=1e-5)
        assert torch.count_nonzero(got[8:]) == 0  # padding rows get no LoRA
