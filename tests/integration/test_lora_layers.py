"""Sliced projections through SGLang's real LoRA layer classes with small shapes, for both
providers, against a float64 reference: MLA's 2-slice ``fused_qkv_a_proj_with_mqa``
(``ReplicatedLinearWithLoRA``), a gate_up with unequal partitions and GDN's 4-slice ``in_proj_qkvz``
(``MergedColumnParallelLinearWithLoRA``), q/k/v (``QKVParallelLinearWithLoRA``), equal gate/up, and
SGLang's prefix-partition layers, whose LoRA covers only the first output partitions (Mamba2
``in_proj``: 2 unequal LoRA slices over 5 partitions; LFM2 ``in_proj``: 2 equal slices over 3): the
LoRA lands on the leading columns and the others keep the base output exactly.

Only the base layers are stand-ins (the LoRA wrappers read their partition sizes and one
parameter); the wrappers, SGLang's batch preparation and the backend are real.
"""

from __future__ import annotations

import pytest
import torch

from lora_helpers import forward_batch, lora_reference, pool_weights


MAX_LORAS, RANK, HIDDEN = 3, 4, 16
RANKS, SCALINGS = [0, 4, 2], [0.0, 2.0, 0.5]


class BaseLayer(torch.nn.Module):
    def __init__(self, partitions, **extra):
        super().__init__()
        self.output_partition_sizes = list(partitions)
        self.output_sizes = list(partitions)
        self.output_size = sum(partitions)
        self.weight = torch.nn.Parameter(torch.zeros(sum(partitions), HIDDEN))
        self.bias = None
        for key, value in extra.items():
            setattr(self, key, value)


def build_layer(kind, partitions, backend):
    from sglang.srt.lora import layers

    if kind == "qkv":
        base = BaseLayer(partitions, q_proj_shard_size=partitions[0], kv_proj_shard_size=partitions[1])
        return layers.QKVParallelLinearWithLoRA(base, backend)
    if kind == "mla":
        layer = layers.ReplicatedLinearWithLoRA(BaseLayer(partitions), backend)
        layer.first_output_dim = partitions[0]  # what LoRAManager.init_lora_modules sets
        return layer
    return layers.MergedColumnParallelLinearWithLoRA(BaseLayer(partitions), backend)


def layer_weights(num_slices, out_dim, seed):
    return pool_weights(RANKS, num_slices, [out_dim], RANK, HIDDEN, seed)


def reference(x, a, b, partitions, slot_of_row, base):
    return lora_reference(x, a, b, partitions, slot_of_row, SCALINGS, RANKS, base)


#: name -> (wrapper kind, base output partitions, how many of them carry LoRA, prefill B kernel).
LAYERS = {
    "mla-2-slices": ("mla", (6, 10), 2, "chunked_sgmv_lora_expand_fwd"),
    "gate-up-unequal": ("merged", (6, 10), 2, "chunked_sgmv_lora_expand_fwd"),
    "gdn-4-slices": ("merged", (4, 4, 6, 2), 4, "chunked_sgmv_lora_expand_fwd"),
    "qkv-3-slices": ("qkv", (8, 4, 4), 3, "qkv_lora_b_fwd"),
    "gate-up-equal": ("merged", (6, 6), 2, "gate_up_lora_b_fwd"),
    "mamba2-in-proj-prefix": ("merged", (6, 10, 4, 3, 5), 2, "chunked_sgmv_lora_expand_fwd"),
    "lfm2-in-proj-prefix": ("merged", (6, 6, 6), 2, "gate_up_lora_b_fwd"),
}


@pytest.fixture(params=["portable", "native"])
def provider(request, emulate, monkeypatch, sglang_plugins_loaded):
    if request.param == "portable":
        monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", "torch")
        yield None
    else:
        with emulate("full", kernels="native") as calls:
            yield calls


@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_real_lora_layer(provider, name, mode):
    from sglang_xpu_lora.backend.xpu import IntelXpuLoRABackend

    kind, partitions, lora_slices, prefill_kernel = LAYERS[name]
    lora_partitions = partitions[:lora_slices]
    backend = IntelXpuLoRABackend(max_loras_per_batch=MAX_LORAS, device=torch.device("cpu"))
    if mode == "prefill":
        lens, slots = [3, 0, 4], [1, 0, 2]
        backend.prepare_lora_batch(forward_batch("EXTEND", 3, lens=lens), slots, RANKS, SCALINGS, False)
        slot_of_row = [s for s, n in zip(slots, lens) for _ in range(n)]
    else:
        slot_of_row = [2, 1, 2, 0, 1]
        backend.prepare_lora_batch(forward_batch("DECODE", 5), slot_of_row, RANKS, SCALINGS, False)
    layer = build_layer(kind, partitions, backend)
    a, b = layer_weights(lora_slices, sum(lora_partitions), seed=len(partitions))
    layer.set_lora_info(a, b)
    x, base = torch.randn(len(slot_of_row), HIDDEN), torch.randn(len(slot_of_row), sum(partitions))
    expected = base.double().clone()
    expected[:, : sum(lora_partitions)] = reference(x, a, b, lora_partitions, slot_of_row, base[:, : sum(lora_partitions)])
    if provider is not None:
        provider.clear()
    out = layer.apply_lora(base.clone(), x)
    assert out.shape == base.shape and torch.equal(out[:, sum(lora_partitions):], base[:, sum(lora_partitions):])
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    if provider is not None:  # which native kernel the layer reached
        expected = prefill_kernel if mode == "prefill" else "chunked_sgmv_lora_expand_fwd"
        assert provider[expected] == 1


def test_two_slices_routed_to_the_three_slice_kernel_are_rejected(emulate):
    """The protection behind the routing: the q/k/v kernel refuses a 2-slice projection in both
    providers instead of returning numbers."""
    from sglang_xpu_lora import providers
    from sglang_xpu_lora.providers import torch_ops

    a, b = layer_weights(2, 16, seed=2)
    meta = dict(seg_indptr=torch.tensor([0, 3], dtype=torch.int32), weight_indices=torch.tensor([1], dtype=torch.int32),
                lora_ranks=torch.tensor(RANKS, dtype=torch.int32), scalings=torch.tensor(SCALINGS))
    call = dict(input_x=torch.randn(3, 2 * RANK), qkv_lora_b=b, output_offset=torch.tensor([0, 6, 16], dtype=torch.int32),
                max_qkv_out_dim=10, **meta)
    with pytest.raises(ValueError, match="output_offset must have 4 elements"):
        torch_ops.qkv_lora_b_fwd(**call)
    with emulate("full"):
        with pytest.raises(RuntimeError, match="output_offset must have exactly 4 elements"):
            providers.select_ops().eager.qkv_lora_b_fwd(**call)


class LinearMethod:
    """The ``quant_method`` of an unquantized SGLang linear: ``x @ weight.T + bias``."""

    @staticmethod
    def apply(layer, x, bias):
        return torch.nn.functional.linear(x, layer.weight, bias)


def counting_layer(backend):
    """A gate_up layer (SGLang's ``MergedColumnParallelLinearWithLoRA`` over a stand-in base) whose
    backend counts the ``forward_with_base`` calls that reach it."""
    base = BaseLayer((6, 10), quant_method=LinearMethod(), skip_bias_add=False, gather_output=False)
    base.weight.data = torch.randn(16, HIDDEN)
    layer = layers_module().MergedColumnParallelLinearWithLoRA(base, backend)
    layer.set_lora_info(*layer_weights(2, 16, seed=7))
    calls = []
    served = backend.forward_with_base

    def counted(*args, **kwargs):
        calls.append(kwargs.get("kind"))
        return served(*args, **kwargs)

    backend.forward_with_base = counted
    return layer, calls


def layers_module():
    from sglang.srt.lora import layers

    return layers


def prepared_backend(slot_of_row):
    """``IntelXpuLoRABackend`` prepared for a decode batch, with ``has_active_lora`` set as
    ``LoRAManager.prepare_lora_batch`` sets it (a row's slot has a rank above 0)."""
    from sglang_xpu_lora.backend.xpu import IntelXpuLoRABackend

    backend = IntelXpuLoRABackend(max_loras_per_batch=MAX_LORAS, device=torch.device("cpu"))
    backend.prepare_lora_batch(forward_batch("DECODE", len(slot_of_row)), slot_of_row, RANKS, SCALINGS, False)
    backend.batch_info.has_active_lora = any(RANKS[slot] > 0 for slot in slot_of_row)
    return backend


def test_a_batch_without_adapters_runs_the_base_layer_alone(provider):
    """No row names an adapter (every row on the rank-0 base slot): SGLang's layer skips the
    backend, so the batch costs the base GEMM alone and its output is the base output, bit for
    bit. With SGLang's default (``skip_inactive_dense_lora = False``) the same batch would run the
    LoRA ops, which is what the flag exists to avoid."""
    from sglang_xpu_lora.backend.xpu import IntelXpuLoRABackend

    assert IntelXpuLoRABackend.skip_inactive_dense_lora is True
    layer, calls = counting_layer(prepared_backend([0, 0, 0]))
    x = torch.randn(3, HIDDEN)
    out, _ = layer(x)
    assert calls == [] and torch.equal(out, torch.nn.functional.linear(x, layer.base_layer.weight))

    layer.lora_backend.skip_inactive_dense_lora = False  # SGLang's default: the ops run anyway
    layer(x)
    assert len(calls) == 1


def test_a_batch_with_one_adapter_row_still_runs_lora(provider):
    """The skip is for whole batches only: one adapter row among base rows gets its LoRA."""
    layer, calls = counting_layer(prepared_backend([0, 1, 0]))
    x = torch.randn(3, HIDDEN)
    out, _ = layer(x)
    base = torch.nn.functional.linear(x, layer.base_layer.weight)
    a, b = layer_weights(2, 16, seed=7)
    expected = reference(x, a, b, (6, 10), [0, 1, 0], base)
    assert len(calls) == 1
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[0], base[0]) and not torch.equal(out[1], base[1])


def test_decode_graphs_record_a_nolora_variant_that_skips_lora(provider):
    """Inside graphs: SGLang's decode graph runner records a ``nolora`` graph per batch size for a
    backend with ``skip_inactive_dense_lora`` and replays it for batches without adapters; that
    capture holds no LoRA op, while the ``lora`` capture holds them even for an idle batch (its
    replay must serve any batch)."""
    from sglang.srt.model_executor.runner import decode_cuda_graph_runner
    from sglang.srt.model_executor.runner_utils import capture_mode

    layer, calls = counting_layer(prepared_backend([0, 0, 0]))
    manager = type("Manager", (), {"lora_backend": layer.lora_backend})()
    assert decode_cuda_graph_runner._lora_backend_skips_inactive(type("Runner", (), {"lora_manager": manager})())
    x = torch.randn(3, HIDDEN)
    with capture_mode.model_capture_mode():
        with capture_mode.capture_lora_variant("nolora"):
            layer(x)
        assert calls == []
        with capture_mode.capture_lora_variant("lora"):
            layer(x)
        assert len(calls) == 1
