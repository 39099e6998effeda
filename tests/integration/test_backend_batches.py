"""Batch shapes the engine on CPU does not produce by itself, through the real
``IntelXpuLoRABackend`` and SGLang's batch preparation, for each provider selection: speculative
TARGET_VERIFY (eager and decode-graph sizing) and prefill-graph batch info sized by
``max_num_requests``. Compared with a float64 per-row loop (tolerance 1e-5, float32).

Selections: portable ops; the emulated ``full`` native build; that build as on an XPU where
Triton runs (native outside graphs, SGLang's Triton kernels inside them); Triton everywhere. All on
SGLang's packed pool with zeroed slots and real ranks. Triton runs in its interpreter on CPU tensors
(tests/conftest.py)."""

from __future__ import annotations

import types

import pytest
import torch

from lora_helpers import forward_batch, lora_reference, pool_weights

MAX_LORAS, RANK, HIDDEN = 3, 4, 16
RANKS, SCALINGS = [0, 4, 2], [0.0, 2.0, 0.5]
OUT_DIMS = (8, 4, 4)


@pytest.fixture(params=["portable", "native", "native+triton-graphs", "triton"])
def make_backend(request, emulate, monkeypatch, sglang_plugins_loaded):
    from sglang_xpu_lora.backend.xpu import IntelXpuLoRABackend
    from sglang_xpu_lora.providers import native, selection, triton_ops

    def make():
        backend = IntelXpuLoRABackend(max_loras_per_batch=MAX_LORAS, device=torch.device("cpu"))
        return backend

    if request.param == "portable":
        monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", "torch")
        yield make
    elif request.param == "triton":
        monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", "triton")
        yield make
    else:
        if request.param == "native+triton-graphs":  # as on an XPU: Triton runs, the build's kernels too
            monkeypatch.setattr(selection, "device_type", lambda device: "xpu")
            monkeypatch.setattr(triton_ops, "triton_support", lambda device: (True, "Triton test backend"))
            monkeypatch.setattr(native, "has_kernel_for_device", lambda kernel, device_type: True)
        with emulate("full", kernels="native"):
            yield make




def weights(seed=0):
    return pool_weights(RANKS, 3, OUT_DIMS, RANK, HIDDEN, seed)


def run_qkv(backend, x):
    a, b = weights()
    offsets = torch.tensor([0, 8, 12, 16], dtype=torch.int32)
    return backend.run_qkv_lora(x=x, qkv_lora_a=a, qkv_lora_b=b, output_offset=offsets, max_qkv_out_dim=8, base_output=None)


def reference(x, slot_of_row):
    a, b = weights()
    return lora_reference(x, a, b, OUT_DIMS, slot_of_row, SCALINGS, RANKS)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "decode-graph"])
def test_target_verify(make_backend, graph):
    """EAGLE verify: extend_seq_lens_cpu is None, draft_token_num tokens per request, contiguous."""
    draft, weight_indices = 3, [2, 1]
    backend = make_backend()
    if graph:
        backend.init_decode_cuda_graph_batch_info(max_bs_in_cuda_graph=4, num_tokens_per_req=draft)
    backend.prepare_lora_batch(forward_batch("TARGET_VERIFY", 2, draft=draft), weight_indices, RANKS, SCALINGS, graph)
    info = backend._sgemm_info()
    assert info.permutation is None and info.use_cuda_graph == graph
    assert backend.batch_info.expected_tokens == 2 * draft
    x = torch.randn(2 * draft, HIDDEN)
    out = run_qkv(backend, x)
    torch.testing.assert_close(out.double(), reference(x, [2] * draft + [1] * draft), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("max_num_requests", [8, 48], ids=["below-32", "above-32"])
def test_prefill_graph_batch_info_sized_by_max_num_requests(make_backend, max_num_requests):
    from sglang.srt.lora.lora_manager import LoRAManager

    backend = make_backend()
    backend.init_prefill_cuda_graph_batch_info(max_num_tokens=256, max_num_requests=max_num_requests)
    info = backend.prefill_cuda_graph_batch_info
    assert (info.bs, info.seg_lens.numel(), backend.prefill_cuda_graph_max_bs) == (max_num_requests,) * 3
    manager = types.SimpleNamespace(lora_backend=backend, attn_dp_enabled=False)

    # A batch at the cap uses the static graph metadata ...
    lens = [2 + (i % 3) for i in range(max_num_requests)]
    slots = [i % MAX_LORAS for i in range(max_num_requests)]
    at_cap = forward_batch("EXTEND", max_num_requests, lens=lens)
    assert LoRAManager.can_use_prefill_cuda_graph(manager, at_cap)
    backend.prepare_lora_batch(at_cap, slots, RANKS, SCALINGS, False, use_prefill_cuda_graph=True)
    assert backend.batch_info is info and backend._sgemm_info().use_cuda_graph
    x = torch.randn(sum(lens), HIDDEN)
    expected = reference(x, [s for s, n in zip(slots, lens) for _ in range(n)])
    torch.testing.assert_close(run_qkv(backend, x).double(), expected, rtol=1e-5, atol=1e-5)

    # ... one request more runs eager, with the same numbers.
    above = forward_batch("EXTEND", max_num_requests + 1, lens=lens + [2])
    assert not LoRAManager.can_use_prefill_cuda_graph(manager, above)
    backend.prepare_lora_batch(above, slots + [1], RANKS, SCALINGS, False)
    assert not backend._sgemm_info().use_cuda_graph
    x = torch.cat([x, torch.randn(2, HIDDEN)])
    expected = reference(x, [s for s, n in zip(slots + [1], lens + [2]) for _ in range(n)])
    torch.testing.assert_close(run_qkv(backend, x).double(), expected, rtol=1e-5, atol=1e-5)


def test_decode_graph_replay_on_padded_rows_ignores_stale_routing(make_backend):
    """A replayed decode graph runs on the captured batch size; SGLang refreshes only the live
    prefix of the routing buffers, so entries left by a larger earlier batch must not leak."""
    backend = make_backend()
    backend.init_decode_cuda_graph_batch_info(max_bs_in_cuda_graph=8, num_tokens_per_req=1)
    backend.prepare_lora_batch(forward_batch("DECODE", 6), [1, 2, 1, 0, 2, 1], RANKS, SCALINGS, True)
    run_qkv(backend, torch.randn(6, HIDDEN))  # leaves permutation[:6] of this batch in the buffer
    backend.prepare_lora_batch(forward_batch("DECODE", 2), [2, 1], RANKS, SCALINGS, True)
    x = torch.randn(4, HIDDEN)  # 2 live rows padded to a captured size of 4
    out = run_qkv(backend, x)
    torch.testing.assert_close(out[:2].double(), reference(x[:2], [2, 1]), rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(out[2:]) == 0


def test_the_backend_logs_one_line_naming_each_ops_providers_and_the_pool(monkeypatch, sglang_plugins_loaded, caplog):
    """What ``IntelXpuLoRABackend`` logs when it is built: the providers eager / in graphs for the
    ops they serve, the kernels setting and the pool layout, exactly once per backend."""
    from sglang_xpu_lora.backend.xpu import IntelXpuLoRABackend

    monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", "torch")
    with caplog.at_level("INFO", logger="sglang_xpu_lora"):
        IntelXpuLoRABackend(max_loras_per_batch=MAX_LORAS, device=torch.device("cpu"))
    built = [r.getMessage() for r in caplog.records if "LoRA backend built" in r.getMessage()]
    assert built == [
        "intel_xpu LoRA backend built on cpu (SGLANG_XPU_LORA_KERNELS=torch): providers eager/in graphs: "
        "torch/torch for all 7 ops; LoRA pool: SGLang's packed layout at real ranks, slots zeroed before each load"
    ]


def test_the_built_line_names_the_providers_that_wait_for_a_trial_capture(emulate, caplog):
    """Ops a provider runs inside graphs only after a trial capture are named by that provider."""
    from sglang_xpu_lora.backend.xpu import IntelXpuLoRABackend

    with emulate("full", kernels="native"), caplog.at_level("INFO", logger="sglang_xpu_lora"):
        IntelXpuLoRABackend(max_loras_per_batch=MAX_LORAS, device=torch.device("cpu"))
    (built,) = [r.getMessage() for r in caplog.records if "LoRA backend built" in r.getMessage()]
    assert "(native ops in graphs once a trial capture at graph set-up accepts them)" in built, built
