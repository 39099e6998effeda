"""One pool layout for every provider mix: SGLang's packed pool at adapter ranks below
``max_lora_rank``, through ``IntelXpuLoRABackend`` over each emulated sgl-kernel-xpu build, against
a float64 per-row reference (tolerance 1e-5, float32).

Mixes: each build on CPU (native ops where the build has them, the portable ops elsewhere) and as
on an XPU where Triton runs (native ops outside graphs, SGLang's Triton kernels for the others and
inside graphs; Triton in its interpreter). So a native shrink feeds native multi-slice expands
(v0.2.0's ``qkv_lora_b_fwd``, pr506-draft's ``gate_up_lora_b_fwd``, full's chunked expand),
portable ones (v0.1.0 on CPU) and Triton ones (v0.1.0 as on an XPU, and every graph batch there).
"""

from __future__ import annotations

import pytest
import torch

from lora_helpers import forward_batch, lora_reference, pool_weights

MAX_LORAS, MAX_RANK, HIDDEN = 4, 8, 16
RANKS, SCALINGS = [0, MAX_RANK, 3, 5], [0.0, 2.0, 0.5, 1.25]
BUILDS = ("v0.1.0", "v0.2.0", "pr506-draft", "full")
#: (name, slices' output widths): qkv with uneven bands, gate_up, and a one-slice module (o_proj).
MODULES = (("qkv", (8, 4, 4)), ("gate_up", (6, 6)), ("o", (10,)))


@pytest.fixture(params=["cpu", "as-on-xpu"])
def make_backend(request, emulate, monkeypatch, sglang_plugins_loaded):
    """``make(build)``: a backend over the emulated ``build``, on CPU or as on an XPU."""
    import contextlib

    from sglang_xpu_lora.backend.xpu import IntelXpuLoRABackend
    from sglang_xpu_lora.providers import native, selection, triton_ops

    if request.param == "as-on-xpu":
        monkeypatch.setattr(selection, "device_type", lambda device: "xpu")
        monkeypatch.setattr(triton_ops, "triton_support", lambda device: (True, "Triton test backend"))
        monkeypatch.setattr(native, "has_kernel_for_device", lambda kernel, device_type: True)

    with contextlib.ExitStack() as stack:

        def make(build):
            stack.enter_context(emulate(build))
            return IntelXpuLoRABackend(max_loras_per_batch=MAX_LORAS, device=torch.device("cpu"))

        yield make


def prepare(backend, mode: str) -> list:
    """Prepare a batch of ``mode`` and return each token row's slot."""
    if mode == "prefill":
        lens, slots = [3, 0, 4, 2, 5], [2, 1, 3, 0, 1]
        backend.prepare_lora_batch(forward_batch("EXTEND", len(lens), lens=lens), slots, RANKS, SCALINGS, False)
        return [s for s, n in zip(slots, lens) for _ in range(n)]
    slots = [3, 1, 2, 0, 3, 2, 1]
    graph = mode == "decode-graph"
    if graph:
        backend.init_decode_cuda_graph_batch_info(max_bs_in_cuda_graph=8, num_tokens_per_req=1)
    backend.prepare_lora_batch(forward_batch("DECODE", len(slots)), slots, RANKS, SCALINGS, graph)
    assert backend._sgemm_info().use_cuda_graph == graph
    return slots


def run_module(backend, name, out_dims, x, seed):
    """One module through the backend as SGLang's LoRA layers call it; returns (output, A, B)."""
    a, b = pool_weights(RANKS, len(out_dims), out_dims, MAX_RANK, HIDDEN, seed)
    base = torch.randn(x.shape[0], sum(out_dims), generator=torch.Generator().manual_seed(seed))
    if name == "qkv":
        offsets = torch.tensor([0, 8, 12, 16], dtype=torch.int32)
        out = backend.run_qkv_lora(x=x, qkv_lora_a=a, qkv_lora_b=b, output_offset=offsets, max_qkv_out_dim=8, base_output=base.clone())
    elif name == "gate_up":
        out = backend.run_gate_up_lora(x=x, gate_up_lora_a=a, gate_up_lora_b=b, base_output=base.clone())
    else:
        out = backend.run_lora_b_sgemm(x=backend.run_lora_a_sgemm(x, a), weights=b, base_output=base.clone())
    return out, a, b, base


@pytest.mark.parametrize("mode", ["prefill", "decode", "decode-graph"])
@pytest.mark.parametrize("build", BUILDS)
def test_every_mix_is_exact_below_max_rank(make_backend, build, mode):
    backend = make_backend(build)
    slot_of_row = prepare(backend, mode)
    x = torch.randn(len(slot_of_row), HIDDEN, generator=torch.Generator().manual_seed(7))
    for seed, (name, out_dims) in enumerate(MODULES):
        out, a, b, base = run_module(backend, name, out_dims, x, seed)
        expected = lora_reference(x, a, b, out_dims, slot_of_row, SCALINGS, RANKS, base)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_native_multi_slice_expands_need_the_gather(emulate, sglang_plugins_loaded, monkeypatch, mode):
    """The protection, and what removing it does: with the full build (every op native, eager) the
    multi-slice expands read the shrink's packed output at ``p * max_rank`` without the gather and
    give wrong numbers for every slot below max_lora_rank; rows of the slot at max_lora_rank, where
    both layouts coincide, and the one-slice module stay exact."""
    from sglang_xpu_lora.backend.xpu import IntelXpuLoRABackend
    from sglang_xpu_lora.providers import slice_layout

    with emulate("full") as calls:
        backend = IntelXpuLoRABackend(max_loras_per_batch=MAX_LORAS, device=torch.device("cpu"))
        slot_of_row = prepare(backend, mode)
        x = torch.randn(len(slot_of_row), HIDDEN, generator=torch.Generator().manual_seed(7))
        calls.clear()
        exact = [run_module(backend, name, out_dims, x, seed)[0] for seed, (name, out_dims) in enumerate(MODULES)]
        expands = {"qkv_lora_b_fwd", "gate_up_lora_b_fwd"} if mode == "prefill" else {"chunked_sgmv_lora_expand_fwd"}
        assert expands <= set(calls)  # native shrinks fed native multi-slice expands
        monkeypatch.setattr(slice_layout, "spaced_slices", lambda packed, index: packed)
        ungathered = [run_module(backend, name, out_dims, x, seed)[0] for seed, (name, out_dims) in enumerate(MODULES)]
    below_max = torch.tensor([0 < RANKS[slot] < MAX_RANK for slot in slot_of_row])
    for (name, _), good, bad in zip(MODULES, exact, ungathered):
        if name == "o":
            assert torch.equal(good, bad)
            continue
        assert torch.equal(good[~below_max], bad[~below_max]), name
        assert ((good - bad).abs().amax(dim=1)[below_max] > 0.1).all(), name
