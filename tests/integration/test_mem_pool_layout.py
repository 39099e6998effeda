"""The pool patch on SGLang's real ``LoRAMemoryPool`` and ``LoRAAdapter`` (TP 1, one process).

Only the per-layer LoRA wrapper modules are stand-ins: at TP 1 their ``slice_lora_*_weights`` are
the identity, which is all the pool asks of them.
"""

from __future__ import annotations

import types

import pytest
import torch
from safetensors.torch import load_file

from sglang_xpu_lora.patches.mem_pool import SPACED_LAYOUT_ATTR

MAX_RANK = 32
TARGETS = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
MODULE_PATHS = {"qkv_proj": "self_attn.qkv_proj", "o_proj": "self_attn.o_proj",
                "gate_up_proj": "mlp.gate_up_proj", "down_proj": "mlp.down_proj"}


class Tp1LoRAModule:
    """What the pool needs of a LoRA layer wrapper at TP 1: identity slicing."""

    @staticmethod
    def slice_lora_a_weights(weight):
        return weight

    @staticmethod
    def slice_lora_b_weights(weight):
        return weight


class BaseModelStub(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # the pool reads the device from a parameter


@pytest.fixture
def pool_env(sglang_plugins_loaded, tiny_artifacts):
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.lora.lora import LoRAAdapter
    from sglang.srt.lora.lora_config import LoRAConfig
    from sglang.srt.lora.mem_pool import LoRAMemoryPool
    from sglang.srt.runtime_context import get_parallel
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_artifacts["base"])
    base = BaseModelStub(config)
    tp1 = dict(tp_size=1, tp_rank=0, attn_tp_size=1, attn_tp_rank=0, moe_ep_size=1, moe_ep_rank=0, moe_tp_size=1, moe_tp_rank=0)
    with get_parallel().override(**tp1):

        def new_pool(spaced: bool):
            pool = LoRAMemoryPool(
                base_hf_config=config, max_loras_per_batch=2, dtype=torch.float32, max_lora_rank=MAX_RANK,
                target_modules=TARGETS, base_model=base, eviction_policy="lru", lora_added_tokens_size=0,
            )
            setattr(pool, SPACED_LAYOUT_ATTR, spaced)
            return pool

        def adapter(name):
            lora = LoRAAdapter(name, LoRAConfig(str(tiny_artifacts[name])), config, LoadConfig(), None, base_model=base)
            raw = load_file(tiny_artifacts[name] / "adapter_model.safetensors")
            lora.initialize_weights_from_tensors(raw)
            return lora, raw

        def load(pool, uid, slot, lora):
            modules = [{f"model.layers.{i}.{path}": Tp1LoRAModule() for path in MODULE_PATHS.values()}
                       for i in range(config.num_hidden_layers)]
            pool.load_lora_weight_to_buffer(uid, slot, lora, modules, None, None)

        yield types.SimpleNamespace(new_pool=new_pool, adapter=adapter, load=load, layers=config.num_hidden_layers)


def peft_weight(raw, layer, proj, kind):
    (key,) = [k for k in raw if f"layers.{layer}." in k and f".{proj}.lora_{kind}" in k]
    return raw[key]


def test_smaller_adapter_into_reused_slot_is_spaced_and_zero_tailed(pool_env):
    pool = pool_env.new_pool(spaced=True)
    big, _ = pool_env.adapter("doc-r16")
    small, raw = pool_env.adapter("sql-r8")
    pool_env.load(pool, "doc", 1, big)
    pool_env.load(pool, "sql", 1, small)  # the slot previously held a rank-16 adapter
    r = 8
    for layer in range(pool_env.layers):
        for module, parts in STACKED.items():
            slot = pool.A_buffer[module][layer][1]
            for p, proj in enumerate(parts):
                assert torch.equal(slot[p * MAX_RANK : p * MAX_RANK + r], peft_weight(raw, layer, proj, "A"))
                assert torch.count_nonzero(slot[p * MAX_RANK + r : (p + 1) * MAX_RANK]) == 0, (module, p)
            b = pool.B_buffer[module][layer][1]
            assert torch.equal(b[:, :r], torch.cat([peft_weight(raw, layer, proj, "B") for proj in parts]))
            assert torch.count_nonzero(b[:, r:]) == 0
        for module in ("o_proj", "down_proj"):
            a, b = pool.A_buffer[module][layer][1], pool.B_buffer[module][layer][1]
            assert torch.count_nonzero(a[r:]) == 0 and torch.count_nonzero(b[:, r:]) == 0


def test_adapter_without_a_module_clears_what_the_previous_tenant_left(pool_env):
    pool = pool_env.new_pool(spaced=True)
    pool_env.load(pool, "doc", 1, pool_env.adapter("doc-r16")[0])
    pool_env.load(pool, "qv", 1, pool_env.adapter("qv-r4")[0])  # q_proj / v_proj only
    for layer in range(pool_env.layers):
        qkv = pool.A_buffer["qkv_proj"][layer][1]
        assert torch.count_nonzero(qkv[MAX_RANK : 2 * MAX_RANK]) == 0  # no k_proj in qv-r4
        for module in ("o_proj", "gate_up_proj", "down_proj"):
            assert torch.count_nonzero(pool.A_buffer[module][layer][1]) == 0, module
            assert torch.count_nonzero(pool.B_buffer[module][layer][1]) == 0, module


def test_unmarked_pool_keeps_sglang_packed_layout(pool_env):
    pool = pool_env.new_pool(spaced=False)
    small, raw = pool_env.adapter("sql-r8")
    pool_env.load(pool, "sql", 1, small)
    slot = pool.A_buffer["qkv_proj"][0][1]
    assert torch.equal(slot[8:16], peft_weight(raw, 0, "k_proj", "A"))  # slice 1 packed at row 1 * r


def test_init_memory_pool_marks_only_managers_whose_backend_declares_it(sglang_plugins_loaded, tiny_artifacts):
    from sglang.srt.lora.backend.lora_registry import get_backend_from_name
    from sglang.srt.lora.lora_manager import LoRAManager
    from sglang.srt.runtime_context import get_parallel
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_artifacts["base"])
    tp1 = dict(tp_size=1, tp_rank=0, attn_tp_size=1, attn_tp_rank=0, moe_ep_size=1, moe_ep_rank=0, moe_tp_size=1, moe_tp_rank=0)
    marks = {}
    with get_parallel().override(**tp1):
        for backend_name in ("intel_xpu", "torch_native"):
            manager = types.SimpleNamespace(
                base_hf_config=config, max_loras_per_batch=2, dtype=torch.float32, max_lora_rank=MAX_RANK,
                target_modules=TARGETS, base_model=BaseModelStub(config), eviction_policy="lru",
                lora_added_tokens_size=0, experts_shared_outer_loras=False, lora_strict_loading=False,
                enable_lora_overlap_loading=False, fetch_new_loras=lambda uids: None,
                lora_backend=get_backend_from_name(backend_name)(max_loras_per_batch=2, device=torch.device("cpu")),
            )
            LoRAManager.init_memory_pool(manager)
            marks[backend_name] = getattr(manager.memory_pool, SPACED_LAYOUT_ATTR)
    assert marks == {"intel_xpu": True, "torch_native": False}


@pytest.mark.parametrize("spaced", [True, False], ids=["pool-patch", "pool-patch-removed"])
def test_kernels_are_exact_only_on_the_patched_layout(pool_env, spaced):
    """The protection, and what removing it does: the full-max_rank kernels read a rank-8 adapter
    loaded over a rank-16 one exactly from the patched pool, and wrongly from SGLang's packed one."""
    from sglang_xpu_lora.providers import torch_ops

    pool = pool_env.new_pool(spaced=spaced)
    pool_env.load(pool, "doc", 1, pool_env.adapter("doc-r16")[0])
    small, raw = pool_env.adapter("sql-r8")
    pool_env.load(pool, "sql", 1, small)
    a, b = pool.A_buffer["qkv_proj"][0], pool.B_buffer["qkv_proj"][0]
    x = torch.randn(5, a.shape[2])
    meta = dict(seg_indptr=torch.tensor([0, 5], dtype=torch.int32), weight_indices=torch.tensor([1], dtype=torch.int32),
                lora_ranks=torch.tensor([0, 8], dtype=torch.int32))
    scaling = small.scaling
    q, k, v = (peft_weight(raw, 0, proj, "B").shape[0] for proj in STACKED["qkv_proj"])
    out = torch_ops.qkv_lora_b_fwd(
        input_x=torch_ops.sgemm_lora_a_fwd(input_x=x, weights=a, stack_num=3, **meta), qkv_lora_b=b,
        output_offset=torch.tensor([0, q, q + k, q + k + v], dtype=torch.int32), max_qkv_out_dim=q,
        scalings=torch.tensor([0.0, scaling]), **meta,
    )
    expected = torch.cat(
        [scaling * x @ peft_weight(raw, 0, proj, "A").T @ peft_weight(raw, 0, proj, "B").T for proj in STACKED["qkv_proj"]],
        dim=1,
    )
    error = float((out - expected).abs().max())
    if spaced:
        assert error < 1e-4
    else:
        assert error > 0.1  # a stale / mis-strided slot is caught by the same comparison


@pytest.mark.parametrize("on_host", [True, False], ids=["host-routing", "device-routing"])
def test_a_resident_nan_adapter_and_its_unload_leave_other_requests_bit_identical(pool_env, monkeypatch, on_host):
    """SGLang's real pool: a slot whose every A/B weight is NaN, resident but not requested, leaves
    the rows of the other adapter and of the base model (rows past the segments) bit-identical to
    the run without it; so does ``remove_lora`` (the unload path), which empties the slot in place:
    no op keeps a copy of a slot that could go stale."""
    from sglang_xpu_lora.providers import torch_ops

    monkeypatch.setattr(torch_ops, "routes_on_host", lambda x, weights, count_runs: on_host)
    pool = pool_env.new_pool(spaced=True)
    pool_env.load(pool, "sql", 0, pool_env.adapter("sql-r8")[0])
    meta = dict(seg_indptr=torch.tensor([0, 3, 3], dtype=torch.int32), weight_indices=torch.tensor([0, 1], dtype=torch.int32),
                lora_ranks=torch.tensor([8, 16], dtype=torch.int32))
    x = torch.randn(5, pool.A_buffer["qkv_proj"][0].shape[2])  # rows 3 and 4: base-model requests

    def outputs():
        result = []
        for layer in range(pool_env.layers):
            a, b = pool.A_buffer["qkv_proj"][layer], pool.B_buffer["qkv_proj"][layer]
            q, kv = pool.B_buffer["o_proj"][layer].shape[1], (b.shape[1] - pool.B_buffer["o_proj"][layer].shape[1]) // 2
            mid = torch_ops.sgemm_lora_a_fwd(input_x=x, weights=a, stack_num=3, **meta)
            result += [mid, torch_ops.qkv_lora_b_fwd(
                input_x=mid, qkv_lora_b=b, output_offset=torch.tensor([0, q, q + kv, q + 2 * kv], dtype=torch.int32),
                max_qkv_out_dim=q, scalings=torch.tensor([2.0, 1.0]), base_output=torch.ones(5, b.shape[1]), **meta,
            )]
        return result

    clean = outputs()
    pool_env.load(pool, "nan", 1, pool_env.adapter("doc-r16")[0])
    pool.uid_to_buffer_id["nan"], pool.buffer_id_to_uid[1] = 1, "nan"
    for buffers in (*pool.A_buffer.values(), *pool.B_buffer.values()):
        for tensor in buffers:
            tensor[1].fill_(float("nan"))
    assert all(torch.equal(got, want) for got, want in zip(outputs(), clean))
    assert pool.remove_lora("nan") == 1
    assert all(torch.equal(got, want) for got, want in zip(outputs(), clean))
