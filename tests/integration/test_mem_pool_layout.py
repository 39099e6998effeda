"""The pool patch on SGLang's real ``LoRAMemoryPool`` and ``LoRAAdapter`` (TP 1, one process).

Only the per-layer LoRA wrapper modules are stand-ins: at TP 1 their ``slice_lora_*_weights`` are
the identity, which is all the pool asks of them.
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
from safetensors.torch import load_file

from sglang_xpu_lora.patches.mem_pool import RECORD_ATTR, SlotZeroing, has_zeroed_slots

MAX_RANK = 16  # doc-r16 fills its slot: a smaller adapter loaded over it leaves stale rows to its end
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

        def new_pool(zeroed: bool):
            pool = LoRAMemoryPool(
                base_hf_config=config, max_loras_per_batch=2, dtype=torch.float32, max_lora_rank=MAX_RANK,
                target_modules=TARGETS, base_model=base, eviction_policy="lru", lora_added_tokens_size=0,
            )
            SlotZeroing.of(pool).requested = zeroed
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


def peft_qkv(raw, x, scaling):
    """Layer 0's q/k/v LoRA output from the PEFT tensors: ``scaling * x A^T B^T`` per projection."""
    return torch.cat(
        [scaling * x @ peft_weight(raw, 0, proj, "A").T @ peft_weight(raw, 0, proj, "B").T for proj in STACKED["qkv_proj"]],
        dim=1,
    )


def test_smaller_adapter_into_reused_slot_is_packed_and_zero_tailed(pool_env):
    """A rank-8 adapter loaded over a rank-16 one: SGLang's packed layout (slice ``p`` at row
    ``p * 8``), nothing of the previous tenant past it."""
    pool = pool_env.new_pool(zeroed=True)
    big, _ = pool_env.adapter("doc-r16")
    small, raw = pool_env.adapter("sql-r8")
    pool_env.load(pool, "doc", 1, big)
    pool_env.load(pool, "sql", 1, small)  # the slot previously held a rank-16 adapter
    r = 8
    for layer in range(pool_env.layers):
        for module, parts in STACKED.items():
            slot = pool.A_buffer[module][layer][1]
            for p, proj in enumerate(parts):
                assert torch.equal(slot[p * r : (p + 1) * r], peft_weight(raw, layer, proj, "A"))
            assert torch.count_nonzero(slot[len(parts) * r :]) == 0, module
            b = pool.B_buffer[module][layer][1]
            assert torch.equal(b[:, :r], torch.cat([peft_weight(raw, layer, proj, "B") for proj in parts]))
            assert torch.count_nonzero(b[:, r:]) == 0
        for module in ("o_proj", "down_proj"):
            a, b = pool.A_buffer[module][layer][1], pool.B_buffer[module][layer][1]
            assert torch.count_nonzero(a[r:]) == 0 and torch.count_nonzero(b[:, r:]) == 0


def test_adapter_without_a_module_clears_what_the_previous_tenant_left(pool_env):
    pool = pool_env.new_pool(zeroed=True)
    pool_env.load(pool, "doc", 1, pool_env.adapter("doc-r16")[0])
    pool_env.load(pool, "qv", 1, pool_env.adapter("qv-r4")[0])  # q_proj / v_proj only, rank 4
    for layer in range(pool_env.layers):
        qkv = pool.A_buffer["qkv_proj"][layer][1]
        assert torch.count_nonzero(qkv[4:8]) == 0 and torch.count_nonzero(qkv[12:]) == 0  # no k_proj; the tail
        for module in ("o_proj", "gate_up_proj", "down_proj"):
            assert torch.count_nonzero(pool.A_buffer[module][layer][1]) == 0, module
            assert torch.count_nonzero(pool.B_buffer[module][layer][1]) == 0, module


def test_unmarked_pool_keeps_what_the_previous_tenant_left(pool_env):
    """What the zeroing protects against: SGLang's own load writes a rank-8 adapter packed over a
    rank-16 one and leaves the rank-16 adapter's rows and columns past it."""
    pool = pool_env.new_pool(zeroed=False)
    pool_env.load(pool, "doc", 1, pool_env.adapter("doc-r16")[0])
    small, raw = pool_env.adapter("sql-r8")
    pool_env.load(pool, "sql", 1, small)
    slot, b = pool.A_buffer["qkv_proj"][0][1], pool.B_buffer["qkv_proj"][0][1]
    assert torch.equal(slot[8:16], peft_weight(raw, 0, "k_proj", "A"))  # slice 1 packed at row 1 * r
    assert torch.count_nonzero(slot[24:48]) > 0 and torch.count_nonzero(b[:, 8:16]) > 0


@pytest.mark.parametrize("kernels, intel_xpu_zeroed", [("auto", True), ("triton", False)])
def test_init_memory_pool_marks_only_managers_whose_backend_needs_it(
    sglang_plugins_loaded, tiny_artifacts, monkeypatch, kernels, intel_xpu_zeroed
):
    """intel_xpu needs zeroed slots when a native or portable op serves (auto on CPU: portable),
    not when every op is Triton; it is handed its pool, to check it, through its spec only (a
    backend of SGLang's with an attribute of the same name gets nothing); the patch leaves one
    record on each pool."""
    monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", kernels)
    from sglang.srt.lora.backend.lora_registry import get_backend_from_name
    from sglang.srt.lora.lora_manager import LoRAManager
    from sglang.srt.runtime_context import get_parallel
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_artifacts["base"])
    tp1 = dict(tp_size=1, tp_rank=0, attn_tp_size=1, attn_tp_rank=0, moe_ep_size=1, moe_ep_rank=0, moe_tp_size=1, moe_tp_rank=0)
    marks, handed, added = {}, {}, {}
    with get_parallel().override(**tp1):
        for backend_name in ("intel_xpu", "torch_native"):
            manager = types.SimpleNamespace(
                base_hf_config=config, max_loras_per_batch=2, dtype=torch.float32, max_lora_rank=MAX_RANK,
                target_modules=TARGETS, base_model=BaseModelStub(config), eviction_policy="lru",
                lora_added_tokens_size=0, experts_shared_outer_loras=False, lora_strict_loading=False,
                enable_lora_overlap_loading=False, fetch_new_loras=lambda uids: None,
                lora_backend=get_backend_from_name(backend_name)(max_loras_per_batch=2, device=torch.device("cpu")),
            )
            if backend_name == "torch_native":
                manager.lora_backend.lora_memory_pool = None  # the attribute intel_xpu keeps its pool in
            LoRAManager.init_memory_pool(manager)
            added[backend_name] = {name for name in vars(manager.memory_pool) if "lora_slots" in name or "xpu_lora" in name}
            marks[backend_name] = SlotZeroing.of(manager.memory_pool).requested
            handed[backend_name] = manager.lora_backend.lora_memory_pool is manager.memory_pool
    assert marks == {"intel_xpu": intel_xpu_zeroed, "torch_native": False}
    assert handed == {"intel_xpu": True, "torch_native": False}
    assert added == {"intel_xpu": {RECORD_ATTR}, "torch_native": {RECORD_ATTR}}  # the patch's one record


#: Provider mixes on CPU: (SGLANG_XPU_LORA_KERNELS, emulated build or None, portable routing, the
#: batch modes in which an op of the mix contracts over max_lora_rank: native ops, the portable
#: ones routed on the device; the host routing and SGLang's Triton kernels stop at the real rank).
MIXES = {
    "portable-host": ("torch", None, "host", ()),
    "portable-device": ("torch", None, "device", ("prefill", "decode")),
    "native-v0.1.0-shrink+portable-expand": ("auto", "v0.1.0", "device", ("prefill", "decode")),
    "native-v0.2.0": ("auto", "v0.2.0", "host", ("prefill",)),  # decode: portable chunked ops
    "native-full": ("auto", "full", "host", ("prefill", "decode")),
    "triton": ("triton", None, "host", ()),
}


@pytest.fixture(params=list(MIXES))
def mix_backend(request, emulate, monkeypatch, sglang_plugins_loaded):
    """``IntelXpuLoRABackend`` with the provider mix of the parameter (Triton in its interpreter)."""
    from sglang_xpu_lora.backend.xpu import IntelXpuLoRABackend
    from sglang_xpu_lora.providers import torch_ops

    kernels, build, routing, reads_past_rank = MIXES[request.param]
    monkeypatch.setattr(torch_ops, "routes_on_host", lambda x, weights, count_runs: routing == "host")
    monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", kernels)
    with emulate(build, kernels=kernels) if build else contextlib.nullcontext():
        yield IntelXpuLoRABackend(max_loras_per_batch=2, device=torch.device("cpu")), reads_past_rank


def reused_slot_qkv(pool_env, zeroed: bool, backend, mode: str):
    """Layer 0's qkv LoRA output for 5 rows of a rank-8 adapter loaded into a slot that held a
    rank-16 one (at max_lora_rank), through ``backend`` (a prefill or decode batch), and the PEFT
    result."""
    from lora_helpers import forward_batch

    pool = pool_env.new_pool(zeroed=zeroed)
    pool_env.load(pool, "doc", 1, pool_env.adapter("doc-r16")[0])
    small, raw = pool_env.adapter("sql-r8")
    pool_env.load(pool, "sql", 1, small)
    a, b = pool.A_buffer["qkv_proj"][0], pool.B_buffer["qkv_proj"][0]
    batch = forward_batch("EXTEND", 1, lens=[5]) if mode == "prefill" else forward_batch("DECODE", 5)
    backend.prepare_lora_batch(batch, [1] * batch.batch_size, [0, 8], [0.0, small.scaling], False)
    x = torch.randn(5, a.shape[2])
    q, k, v = (peft_weight(raw, 0, proj, "B").shape[0] for proj in STACKED["qkv_proj"])
    out = backend.run_qkv_lora(
        x=x, qkv_lora_a=a, qkv_lora_b=b, output_offset=torch.tensor([0, q, q + k, q + k + v], dtype=torch.int32),
        max_qkv_out_dim=q, base_output=None,
    )
    return out, peft_qkv(raw, x, small.scaling)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("zeroed", [True, False], ids=["pool-patch", "pool-patch-removed"])
def test_every_provider_mix_is_exact_on_the_patched_pool(pool_env, mix_backend, zeroed, mode):
    """The protection, and what removing it does: every provider mix reads a rank-8 adapter loaded
    over a rank-16 one exactly from the patched pool (PEFT's numbers); without the zeroing the ops
    that contract over max_lora_rank read the previous tenant's tail, while those that stop at the
    real rank (SGLang's Triton kernels, the portable host routing) stay exact."""
    backend, reads_past_rank = mix_backend
    out, expected = reused_slot_qkv(pool_env, zeroed, backend, mode)
    error = float((out - expected).abs().max())
    if zeroed or mode not in reads_past_rank:
        assert error < 1e-4
    else:
        assert error > 0.1  # a stale slot tail is caught by the same comparison


@pytest.mark.parametrize("on_host", [True, False], ids=["host-routing", "device-routing"])
def test_a_resident_nan_adapter_and_its_unload_leave_other_requests_bit_identical(pool_env, monkeypatch, on_host):
    """SGLang's real pool: a slot whose every A/B weight is NaN, resident but not requested, leaves
    the rows of the other adapter and of the base model (rows past the segments) bit-identical to
    the run without it; so does ``remove_lora`` (the unload path), which empties the slot in place:
    no op keeps a copy of a slot that could go stale."""
    from sglang_xpu_lora.providers import torch_ops

    monkeypatch.setattr(torch_ops, "routes_on_host", lambda x, weights, count_runs: on_host)
    from sglang_xpu_lora.providers import slice_layout

    pool = pool_env.new_pool(zeroed=True)
    pool_env.load(pool, "sql", 0, pool_env.adapter("sql-r8")[0])
    meta = dict(seg_indptr=torch.tensor([0, 3, 3], dtype=torch.int32), weight_indices=torch.tensor([0, 1], dtype=torch.int32),
                lora_ranks=torch.tensor([8, 16], dtype=torch.int32))
    x = torch.randn(5, pool.A_buffer["qkv_proj"][0].shape[2])  # rows 3 and 4: base-model requests
    index = slice_layout.spacing_index(meta["seg_indptr"], meta["weight_indices"], meta["lora_ranks"], 5, 3, MAX_RANK)

    def outputs():
        result = []
        for layer in range(pool_env.layers):
            a, b = pool.A_buffer["qkv_proj"][layer], pool.B_buffer["qkv_proj"][layer]
            q, kv = pool.B_buffer["o_proj"][layer].shape[1], (b.shape[1] - pool.B_buffer["o_proj"][layer].shape[1]) // 2
            mid = slice_layout.spaced_slices(torch_ops.sgemm_lora_a_fwd(input_x=x, weights=a, num_slices=3, **meta), index)
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


@pytest.fixture
def manager_with_pool(sglang_plugins_loaded, tiny_artifacts):
    """``build(backend)``: what ``LoRAManager.init_state`` does around the pool, on a stand-in
    manager: the backend's ``validate_lora_targets``, then SGLang's ``init_memory_pool`` (whatever
    hooks are applied to it), whose base-slot load goes through the real ``LoRAMemoryPool``."""
    from sglang.srt.lora.lora_manager import LoRAManager
    from sglang.srt.runtime_context import get_parallel
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_artifacts["base"])
    tp1 = dict(tp_size=1, tp_rank=0, attn_tp_size=1, attn_tp_rank=0, moe_ep_size=1, moe_ep_rank=0, moe_tp_size=1, moe_tp_rank=0)

    def build(backend):
        manager = types.SimpleNamespace(
            base_hf_config=config, max_loras_per_batch=2, dtype=torch.float32, max_lora_rank=MAX_RANK,
            target_modules=TARGETS, base_model=BaseModelStub(config), eviction_policy="lru",
            lora_added_tokens_size=0, experts_shared_outer_loras=False, lora_strict_loading=False,
            enable_lora_overlap_loading=False, loras={}, lora_refs={}, embed_tokens_module=None, lm_head_module=None,
            lora_modules=[{} for _ in range(config.num_hidden_layers)], lora_backend=backend,
        )
        manager.fetch_new_loras = lambda uids: LoRAManager.fetch_new_loras(manager, uids)
        manager._notify_lora_slots_updated = lambda slots: None
        backend.validate_lora_targets(base_model=manager.base_model, target_modules=TARGETS)
        LoRAManager.init_memory_pool(manager)
        return manager

    with get_parallel().override(**tp1):
        yield build


def unhook(monkeypatch, cls, method):
    """Put SGLang's original method back, as if ``HookRegistry`` had failed to apply the hook."""
    monkeypatch.setattr(cls, method, getattr(cls, method).__wrapped__)


@pytest.mark.parametrize("missing", [None, "init_memory_pool", "load_lora_weight_to_buffer"])
def test_backend_refuses_a_pool_without_zeroed_slots(manager_with_pool, monkeypatch, missing):
    """The backend's own check, which does not rely on the plugin's hooks having run: with both
    pool hooks it serves; with either one not applied it refuses at its first batch, naming why."""
    from lora_helpers import forward_batch
    from sglang.srt.lora.lora_manager import LoRAManager
    from sglang.srt.lora.mem_pool import LoRAMemoryPool

    from sglang.srt.lora.backend.lora_registry import get_backend_from_name

    monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", "torch")
    if missing:
        unhook(monkeypatch, LoRAManager if missing == "init_memory_pool" else LoRAMemoryPool, missing)
    backend = get_backend_from_name("intel_xpu")(max_loras_per_batch=2, device=torch.device("cpu"))
    manager = manager_with_pool(backend)

    def first_batch():
        backend.prepare_lora_batch(forward_batch("DECODE", 2), [0, 0], [0, 0], [0.0, 0.0], False)

    assert has_zeroed_slots(manager.memory_pool) == (missing is None)
    if missing is None:
        first_batch()  # serves: no RuntimeError
        assert backend.lora_memory_pool is manager.memory_pool
        return
    why = {"init_memory_pool": "hook on LoRAManager.init_memory_pool did not run",
           "load_lora_weight_to_buffer": "the pool's loads are not zeroing its slots"}[missing]
    with pytest.raises(RuntimeError, match=f"--lora-backend intel_xpu refuses to serve: .*{why}"):
        first_batch()
    with pytest.raises(RuntimeError, match="refuses to serve"):  # and keeps refusing
        backend.init_decode_cuda_graph_batch_info(max_bs_in_cuda_graph=2, num_tokens_per_req=1)


def test_backend_whose_ops_need_no_zeroing_serves_on_sglangs_own_pool(manager_with_pool, monkeypatch):
    """Whether slots must be zeroed is the backend's op selection's answer: Triton everywhere
    (real ranks only) serves on SGLang's own pool; the portable ops refuse that same pool."""
    from lora_helpers import forward_batch
    from sglang.srt.lora.lora_manager import LoRAManager

    from sglang.srt.lora.backend.lora_registry import get_backend_from_name

    unhook(monkeypatch, LoRAManager, "init_memory_pool")
    monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", "triton")  # in Triton's interpreter (tests/conftest.py)
    backend = get_backend_from_name("intel_xpu")(max_loras_per_batch=2, device=torch.device("cpu"))
    assert not backend.needs_zeroed_slots
    manager = manager_with_pool(backend)
    assert not has_zeroed_slots(manager.memory_pool)
    backend.prepare_lora_batch(forward_batch("DECODE", 1), [0], [0, 0], [0.0, 0.0], False)  # no RuntimeError
    # the same pool refused by a backend whose ops need zeroed slots: what the selection changed
    monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", "torch")
    portable = get_backend_from_name("intel_xpu")(max_loras_per_batch=2, device=torch.device("cpu"))
    assert portable.needs_zeroed_slots
    portable.use_memory_pool(manager.memory_pool)
    portable.validate_lora_targets(base_model=manager.base_model, target_modules=TARGETS)
    with pytest.raises(RuntimeError, match="refuses to serve: .*the pool's loads are not zeroing its slots"):
        portable.prepare_lora_batch(forward_batch("DECODE", 1), [0], [0, 0], [0.0, 0.0], False)


def test_bytes_per_slot_match_the_documented_formula(pool_env):
    """``benchmarks.common.ModelShape.lora_slot_bytes``, the formula behind the bytes per slot of
    docs/sizing.md, against SGLang's real pool for the tiny Llama (2 layers, hidden 128, 4 heads and 2
    key/value heads of 32, intermediate 256; every linear module a target): the pool's A and B
    buffers over its 2 slots."""
    from benchmarks.common import ModelShape

    pool = pool_env.new_pool(zeroed=False)
    total = sum(t.numel() * t.element_size() for buffers in (*pool.A_buffer.values(), *pool.B_buffer.values()) for t in buffers)
    tiny = ModelShape("tiny-llama", hidden=128, q=4 * 32, kv=2 * 32, intermediate=256)
    assert sorted(pool.A_buffer) == sorted(TARGETS) and len(pool.A_buffer["qkv_proj"]) == pool_env.layers == 2
    assert total == 2 * tiny.lora_slot_bytes(MAX_RANK, layers=2, dtype_bytes=4) == 2 * 16 * 4096 * 4
