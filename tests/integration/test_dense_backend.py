"""``IntelXpuLoRABackend.forward_with_base``, SGLang's single entry for LoRA'd layers, through the
real backend and SGLang's batch preparation: linears on the dense tier where the selection names
SGLang's Triton kernels (interpreted on CPU tensors, tests/conftest.py), or below its eager
threshold on those kernels launched from compiled handles, on the per-op tier otherwise, each compared with a float64 per-row loop (tolerance 1e-5, float32); at TP > 1 one
collective of base + LoRA on every tier; graph batches with padded rows; the layer's own
``apply_lora`` (the per-op ``run_*`` path) never called for a linear of the other two.
"""

from __future__ import annotations

import json

import pytest
import torch

from lora_helpers import forward_batch, lora_reference, pool_weights

MAX_LORAS, RANK, HIDDEN = 3, 4, 16
RANKS, SCALINGS = [0, 4, 2], [0.0, 2.0, 0.5]
OUT_DIMS = (8, 4, 4)
OFFSETS = (0, 8, 12, 16)


class Layer:
    """The parts of SGLang's QKV LoRA layer that ``forward_with_base`` reads: ``apply_lora`` runs the
    per-op path (``run_qkv_lora``), and records that it ran."""

    def __init__(self, backend, a, b):
        self.backend, self.a, self.b, self.per_op_calls = backend, a, b, 0

    def apply_lora(self, base_output, x):
        self.per_op_calls += 1
        return self.backend.run_qkv_lora(
            x=x, qkv_lora_a=self.a, qkv_lora_b=self.b, output_offset=torch.tensor(OFFSETS, dtype=torch.int32),
            max_qkv_out_dim=8, base_output=base_output,
        )


@pytest.fixture
def backend_for(monkeypatch, sglang_plugins_loaded):
    """``make(kernels, eager_dense_min_tokens="1")``: the backend with ``SGLANG_XPU_LORA_KERNELS=kernels``
    and ``SGLANG_XPU_LORA_EAGER_DENSE_MIN_TOKENS`` (None: unset, the shipped threshold); with 1 the
    tests' small eager batches run the dense tier."""
    from sglang_xpu_lora.backend import xpu

    def make(kernels, eager_dense_min_tokens="1"):
        monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", kernels)
        if eager_dense_min_tokens is None:
            monkeypatch.delenv("SGLANG_XPU_LORA_EAGER_DENSE_MIN_TOKENS", raising=False)
        else:
            monkeypatch.setenv("SGLANG_XPU_LORA_EAGER_DENSE_MIN_TOKENS", eager_dense_min_tokens)
        return xpu.IntelXpuLoRABackend(max_loras_per_batch=MAX_LORAS, device=torch.device("cpu"))

    return make


def forward(backend, x, weight, all_reduce=None):
    a, b = pool_weights(RANKS, 3, OUT_DIMS, RANK, HIDDEN, seed=0)
    layer = Layer(backend, a, b)
    out = backend.forward_with_base(
        layer, x, lambda: x @ weight.t(), a, b, torch.tensor(OFFSETS, dtype=torch.int32), OFFSETS,
        all_reduce=all_reduce,
    )
    return out, layer


def reference(x, weight, rows):
    a, b = pool_weights(RANKS, 3, OUT_DIMS, RANK, HIDDEN, seed=0)
    return lora_reference(x, a, b, OUT_DIMS, rows, SCALINGS, RANKS, base=x @ weight.t())


#: (SGLANG_XPU_LORA_KERNELS, SGLANG_XPU_LORA_EAGER_DENSE_MIN_TOKENS, where the tests' small eager
#: linears run): the dense tier, the Triton kernels from compiled handles below the dense tier's
#: threshold, the per-op tier (``apply_lora``).
TIERS = {
    "dense-tier": ("triton", "1", "dense"), "launches": ("triton", None, "launches"), "per-op-tier": ("torch", "1", "per-op"),
}


@pytest.mark.parametrize(
    "mode, lens, slots",
    [("EXTEND", [3, 2, 4], [1, 0, 2]), ("DECODE", None, [2, 1, 1, 0])],
    ids=["extend", "decode"],
)
@pytest.mark.parametrize("tier", list(TIERS))
def test_linears_run_on_the_tier_the_selection_names(backend_for, tier, mode, lens, slots):
    kernels, threshold, where = TIERS[tier]
    backend = backend_for(kernels, eager_dense_min_tokens=threshold)
    assert (backend.dense is not None) == (kernels == "triton")
    batch = forward_batch(mode, len(slots), lens=lens)
    backend.prepare_lora_batch(batch, slots, RANKS, SCALINGS, False)
    assert (backend.dense_batch, backend.launch_batch) == (where == "dense", where == "launches")
    rows = [s for s, n in zip(slots, lens or [1] * len(slots)) for _ in range(n)]
    gen = torch.Generator().manual_seed(3)
    x, weight = torch.randn(len(rows), HIDDEN, generator=gen), torch.randn(16, HIDDEN, generator=gen)
    out, layer = forward(backend, x, weight)
    assert layer.per_op_calls == (1 if where == "per-op" else 0)
    torch.testing.assert_close(out.double(), reference(x, weight, rows), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tier", list(TIERS))
def test_a_row_parallel_linear_reduces_base_plus_lora_once(backend_for, tier):
    """SGLang's default makes two collectives (base output, shrink output); B is replicated, so
    one of base + LoRA is the same sum."""
    kernels, threshold, _ = TIERS[tier]
    backend = backend_for(kernels, eager_dense_min_tokens=threshold)
    slots = [1, 2]
    backend.prepare_lora_batch(forward_batch("DECODE", 2), slots, RANKS, SCALINGS, False)
    gen = torch.Generator().manual_seed(4)
    x, weight = torch.randn(2, HIDDEN, generator=gen), torch.randn(16, HIDDEN, generator=gen)
    reduced = []
    out, _ = forward(backend, x, weight, all_reduce=lambda t: reduced.append(t.clone()) or t * 2)
    assert len(reduced) == 1
    torch.testing.assert_close(out.double(), 2 * reference(x, weight, slots), rtol=1e-5, atol=1e-5)


#: A plan table of one row for every call: the fused per-row kernel (``dense/fused.py``).
FUSED_TABLE = {"rows": [{"name": "fused", "spec": {"fused": "per_row", "tiles": {"BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 16, "num_warps": 4, "num_stages": 1}}}]}


@pytest.mark.parametrize("table", [None, FUSED_TABLE], ids=["shipped-plans", "fused-plan"])
def test_a_decode_graph_batch_maps_padded_rows_to_no_adapter(backend_for, table, tmp_path, monkeypatch):
    """Graph batches bind the persistent token map; rows past the live batch get no LoRA, with
    SGLang's plans and with the fused kernel (a table given by ``SGLANG_XPU_LORA_PLANS``)."""
    if table is not None:
        from sglang_xpu_lora.settings import PLANS_ENV

        (tmp_path / "fused.plans.json").write_text(json.dumps(table))
        monkeypatch.setenv(PLANS_ENV, str(tmp_path / "fused.plans.json"))
    backend = backend_for("triton")
    backend.init_decode_cuda_graph_batch_info(max_bs_in_cuda_graph=4, num_tokens_per_req=1)
    backend.prepare_lora_batch(forward_batch("DECODE", 2), [2, 1], RANKS, SCALINGS, True)
    assert backend.dense_batch and backend.dense.token_slots.tolist() == [2, 1]
    gen = torch.Generator().manual_seed(5)
    x, weight = torch.randn(4, HIDDEN, generator=gen), torch.randn(16, HIDDEN, generator=gen)
    out, _ = forward(backend, x, weight)  # the graph's padded size
    torch.testing.assert_close(out.double(), reference(x, weight, [2, 1, 0, 0]), rtol=1e-5, atol=1e-5)


def test_small_eager_batches_run_from_compiled_handles_and_graph_batches_dense(backend_for):
    """Outside graphs the dense tier takes batches from EAGER_DENSE_MIN_TOKENS tokens on; smaller
    ones launch SGLang's Triton kernels from compiled handles (less host work per launch); inside
    graphs the dense tier takes every batch."""
    from sglang_xpu_lora.backend.xpu import EAGER_DENSE_MIN_TOKENS

    backend = backend_for("triton", eager_dense_min_tokens=None)  # the shipped threshold
    assert backend.eager_dense_min_tokens == EAGER_DENSE_MIN_TOKENS
    backend.prepare_lora_batch(forward_batch("EXTEND", 2, lens=[5, 3]), [1, 2], RANKS, SCALINGS, False)
    assert (backend.dense_batch, backend.launch_batch) == (False, True)
    backend.prepare_lora_batch(forward_batch("EXTEND", 2, lens=[EAGER_DENSE_MIN_TOKENS - 1, 1]), [1, 2], RANKS, SCALINGS, False)
    assert (backend.dense_batch, backend.launch_batch) == (True, False)
    backend.init_decode_cuda_graph_batch_info(max_bs_in_cuda_graph=4, num_tokens_per_req=1)
    backend.prepare_lora_batch(forward_batch("DECODE", 2), [2, 1], RANKS, SCALINGS, True)
    assert (backend.dense_batch, backend.launch_batch) == (True, False)
    backend.reset_batch_state()
    assert (backend.dense_batch, backend.launch_batch) == (False, False)


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_a_bad_eager_threshold_is_refused_naming_the_variable(backend_for, value):
    with pytest.raises(ValueError, match=f"SGLANG_XPU_LORA_EAGER_DENSE_MIN_TOKENS='{value}' is not a positive integer"):
        backend_for("triton", eager_dense_min_tokens=value)


def test_the_embedding_and_lm_head_stay_on_the_per_op_tier(backend_for):
    from sglang.srt.lora.dense.plan import DenseLoraKind

    backend = backend_for("triton")
    backend.prepare_lora_batch(forward_batch("DECODE", 1), [1], RANKS, SCALINGS, False)

    class Stub:
        calls = 0

        def apply_lora(self, base_output, x):
            Stub.calls += 1
            return base_output + 1

    base = torch.zeros(1, 4)
    out = backend.forward_with_base(Stub(), torch.zeros(1, dtype=torch.long), lambda: base, None, None, None, (0, 4), kind=DenseLoraKind.EMBEDDING)
    assert Stub.calls == 1 and out.tolist() == [[1.0] * 4]


def test_the_built_line_names_the_dense_tier_and_its_plans(backend_for, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="sglang_xpu_lora.backend.xpu"):
        backend_for("triton")
    assert "dense tier (SGLang's triton_v2 kernels, plans from" in caplog.text
    assert "SGLang's default" in caplog.text


#: Eager batches below the dense threshold, as SGLang prepares them: (how, arguments, token rows).
EAGER_BATCHES = {
    "extend": ("batch", (("EXTEND", 3), {"lens": [3, 2, 4]}, [1, 0, 2]), 9),
    "decode": ("batch", (("DECODE", 4), {}, [2, 1, 1, 0]), 4),
    "target-verify": ("batch", (("TARGET_VERIFY", 2), {"draft": 3}, [2, 1]), 6),
    "token-segments": ("segments", ([2, 0, 3], [1, 0, 2]), 5),
}


@pytest.mark.parametrize("batch", list(EAGER_BATCHES))
def test_compiled_handle_launches_equal_sglang_triton_backend_bit_for_bit(backend_for, batch):
    """The launches are SGLang's ``triton`` backend's, kernels, tiles and grids: the same bits for
    every slice form SGLang's layers have (one, gate/up, MLA's two uneven, q/k/v, GDN's four),
    every eager batch form (its explicit token segments with int64 ranks included), a layer whose
    base output is wider than its LoRA (prefix partitions) and a non-contiguous input (which
    SGLang's wrappers refuse: it gets the contiguous copy)."""
    from sglang.srt.lora.backend.triton_backend import TritonLoRABackend

    how, arguments, tokens = EAGER_BATCHES[batch]
    ours = backend_for("triton", eager_dense_min_tokens=None)
    theirs = TritonLoRABackend(max_loras_per_batch=MAX_LORAS, device=torch.device("cpu"))
    for backend in (ours, theirs):
        if how == "batch":
            (mode, size), extra, slots = arguments
            backend.prepare_lora_batch(forward_batch(mode, size, **extra), slots, RANKS, SCALINGS, False)
        else:
            backend.prepare_lora_token_segments(
                segment_lens=arguments[0], weight_indices=arguments[1], lora_ranks=RANKS, scalings=SCALINGS
            )
    assert ours.launch_batch
    gen = torch.Generator().manual_seed(6)
    for slices, extra in [((8,), 0), ((8, 8), 3), ((8, 4), 0), ((8, 4, 4), 2), ((4, 4, 6, 2), 0)]:
        a, b = pool_weights(RANKS, len(slices), slices, RANK, HIDDEN, seed=len(slices))
        offsets = (0, *torch.tensor(slices).cumsum(0).tolist())
        output_offset = torch.tensor(offsets, dtype=torch.int32)
        x = torch.randn(HIDDEN, 2 * tokens, generator=gen)[:, ::2].t()  # strides (2, 2 * tokens)
        base = torch.randn(tokens, offsets[-1] + extra, generator=gen)
        out = ours.forward_with_base(None, x, base.clone, a, b, output_offset, offsets)
        x, expected = x.contiguous(), base.clone()
        if len(slices) == 1:
            theirs.run_lora_b_sgemm(theirs.run_lora_a_sgemm(x, a), b, base_output=expected)
        elif len(slices) == 2 and slices[0] == slices[1]:
            theirs.run_gate_up_lora(x, a, b, base_output=expected)
        else:
            theirs.run_qkv_lora(x, a, b, output_offset, max(slices), base_output=expected, n_slices=len(slices))
        assert torch.equal(out, expected), slices
