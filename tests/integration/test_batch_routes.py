"""Per-batch preparation of ``IntelXpuLoRABackend``'s op calls (``backend/batch_routes.py``) on
SGLang's Triton kernels for permuted (decode) batches, and the backend's one launch cache that its
routes' Triton ops and its eager linears launch through (two backends in one process: two caches).

Decode batches, eager and with decode-graph batch infos (padded rows, routing left by a larger
batch), are compared with the float64 per-row reference (tolerance 1e-5, float32; Triton in its
interpreter, tests/conftest.py, on tiny shapes)."""

from __future__ import annotations

import random
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lora_helpers import forward_batch, lora_reference, pool_weights

MAX_LORAS, RANK, HIDDEN = 3, 4, 16
RANKS, SCALINGS = [0, 4, 2], [0.0, 2.0, 0.5]
#: (module, band widths): q/k/v, equal gate/up, one slice.
MODULES = (("qkv", (8, 4, 4)), ("gate_up", (6, 6)), ("o", (10,)))
QKV_OFFSETS = torch.tensor([0, 8, 12, 16], dtype=torch.int32)


@pytest.fixture
def triton_backend(monkeypatch, sglang_plugins_loaded):
    """Triton for every op (SGLang's packed pool, real ranks)."""
    from sglang.kernels.ops.lora.dense import lora_tuning_config

    from sglang_xpu_lora.backend.xpu import IntelXpuLoRABackend

    monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", "triton")
    # the kernels look up tuned block sizes by GPU name: none on CPU (the defaults apply)
    monkeypatch.setattr(lora_tuning_config, "get_device_name", lambda: "cpu")

    def make():
        backend = IntelXpuLoRABackend(max_loras_per_batch=MAX_LORAS, device=torch.device("cpu"))
        backend.lora_memory_pool = types.SimpleNamespace(max_lora_rank=RANK)
        return backend

    return make


def module_weights(seed=0):
    """(module, bands, pool A, pool B) of each module of MODULES."""
    return [
        (module, bands, *pool_weights(RANKS, len(bands), bands, RANK, HIDDEN, seed + k)) for k, (module, bands) in enumerate(MODULES)
    ]


def run_modules(backend, x, seed=0, weights=None):
    """Each module through the backend's run_* method, with its float64 reference."""
    outputs = []
    for module, bands, packed, b in weights or module_weights(seed):
        if module == "qkv":
            out = backend.run_qkv_lora(x=x, qkv_lora_a=packed, qkv_lora_b=b, output_offset=QKV_OFFSETS, max_qkv_out_dim=8)
        elif module == "gate_up":
            out = backend.run_gate_up_lora(x=x, gate_up_lora_a=packed, gate_up_lora_b=b)
        else:
            out = backend.run_lora_b_sgemm(x=backend.run_lora_a_sgemm(x, packed), weights=b)
        outputs.append((out, packed, b, bands))
    return outputs


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts of SGLang's Triton kernels launched through the provider (each through its
    ``CompiledLaunches``), by the kernel's name in ``triton_launch._kernels()``."""
    from sglang_xpu_lora.providers import triton_launch

    names = {id(kernel): name for name, kernel in vars(triton_launch._kernels()).items()}
    calls, launch = {}, triton_launch.CompiledLaunches.launch

    def counted(self, key, grid, args):
        name = names[id(self.kernel)]
        calls[name] = calls.get(name, 0) + 1
        return launch(self, key, grid, args)

    monkeypatch.setattr(triton_launch.CompiledLaunches, "launch", counted)
    return calls


def run_exact_decode(backend, kernel_calls, slots=(1,) * 17 + (2, 0, 2)) -> dict:
    """A decode batch (20 tokens over 3 slots by default) through every module, each against its
    float64 reference; the kernels it called."""
    slots = list(slots)
    backend.prepare_lora_batch(forward_batch("DECODE", len(slots)), slots, RANKS, SCALINGS, False)
    x = torch.randn(len(slots), HIDDEN)
    kernel_calls.clear()
    for out, a, b, bands in run_modules(backend, x):
        torch.testing.assert_close(out.double(), lora_reference(x, a, b, bands, slots, SCALINGS, RANKS), rtol=1e-5, atol=1e-5)
    return dict(kernel_calls)


DENSE = {"shrink": 3, "expand_bands": 1, "expand_two": 1, "expand_one": 1}


def test_eager_decode_is_exact(triton_backend, kernel_calls):
    """20 decode tokens over 3 slots, in shuffled order."""
    slots = [1] * 17 + [2, 0, 2]
    random.Random(0).shuffle(slots)
    assert run_exact_decode(triton_backend(), kernel_calls, slots) == DENSE


def test_decode_beside_spaced_slice_prefill_ops_is_exact(triton_backend, kernel_calls):
    """A real Intel box's eager table: native (here: portable) prefill expands that read spaced
    slices, Triton decode ops; the decode route stays exact (only the permuted ops' providers
    matter to it)."""
    import dataclasses

    from sglang_xpu_lora.providers import torch_ops
    from sglang_xpu_lora.providers.selection import OpChoice

    backend = triton_backend()
    selection = backend.op_selection
    portable = {op: OpChoice(op, torch_ops.PROVIDER, "test", True) for op in ("sgemm_lora_a_fwd", "qkv_lora_b_fwd", "gate_up_lora_b_fwd")}
    backend.op_selection = dataclasses.replace(selection, choices={**selection.choices, **portable})
    assert backend.op_selection.reads_spaced_slices("qkv_lora_b_fwd", False)
    assert run_exact_decode(backend, kernel_calls) == DENSE


def test_decode_graph_batches_on_padded_rows_ignore_stale_routing(triton_backend, kernel_calls):
    """Decode-graph batch infos live in persistent buffers sized for the largest graph; a smaller
    live batch replayed at a larger captured size (padded rows) must not read the routing a larger
    earlier batch left there, and the padding rows get no LoRA."""
    backend = triton_backend()
    backend.init_decode_cuda_graph_batch_info(max_bs_in_cuda_graph=48, num_tokens_per_req=1)
    first = [1] * 20 + [2] * 28
    backend.prepare_lora_batch(forward_batch("DECODE", len(first)), first, RANKS, SCALINGS, True)
    run_modules(backend, torch.randn(len(first), HIDDEN))
    live = [2, 1, 1, 2, 1]
    backend.prepare_lora_batch(forward_batch("DECODE", len(live)), live, RANKS, SCALINGS, True)
    x = torch.randn(24, HIDDEN)  # the 5 live rows, run at a captured size of 24
    kernel_calls.clear()
    for out, a, b, bands in run_modules(backend, x, seed=3):
        torch.testing.assert_close(out[:5].double(), lora_reference(x[:5], a, b, bands, live, SCALINGS, RANKS), rtol=1e-5, atol=1e-5)
        assert torch.count_nonzero(out[5:]) == 0
    assert kernel_calls == DENSE


def test_routes_are_built_once_per_batch_and_offsets_once_per_shape(triton_backend, monkeypatch):
    """A layer's run_* calls reuse the batch's routes: an eager batch builds the one route its
    modules use at the first call, a graph batch every route at preparation, no later call builds
    one; the persistent slice offsets are built once per shape, and offsets first built while a
    graph is being captured are not kept (their values exist only once that graph runs)."""
    from sglang_xpu_lora.backend import route_table

    backend = triton_backend()
    built = []
    make_route = backend.routes.make_route
    monkeypatch.setattr(backend.routes, "make_route", lambda info, *args: built.append(info) or make_route(info, *args))
    slots = [1, 2, 1, 0]
    for use_graph in (False, False, True):
        if use_graph:
            backend.init_decode_cuda_graph_batch_info(max_bs_in_cuda_graph=8, num_tokens_per_req=1)
        before = len(built)
        backend.prepare_lora_batch(forward_batch("DECODE", len(slots)), slots, RANKS, SCALINGS, use_graph)
        assert len(built) - before == (len(backend._batch_infos()) if use_graph else 0)
        run_modules(backend, torch.randn(len(slots), HIDDEN))
        after_first_layer = len(built)
        assert after_first_layer - before == (len(backend._batch_infos()) if use_graph else 1)
        for _ in range(2):  # two more layers
            run_modules(backend, torch.randn(len(slots), HIDDEN))
        assert len(built) == after_first_layer  # nothing built per op
    offsets = backend.routes.uniform_offsets(2, 6)
    assert offsets.tolist() == [0, 6, 12] and backend.routes.uniform_offsets(2, 6) is offsets
    monkeypatch.setattr(route_table, "capturing", lambda device: True)
    in_capture = backend.routes.uniform_offsets(2, 7)
    assert in_capture.tolist() == [0, 7, 14] and (2, 7) not in backend.routes.kept_uniform_offsets


def test_each_backend_launches_through_its_own_launch_cache_and_binds_one_batch_launches_per_batch(triton_backend, monkeypatch):
    """Target and draft in one process, their batches prepared and run interleaved: each backend's
    eager linears and its per-op tier's Triton ops launch through one launch cache, the backend's
    own (compiled kernels kept across batches), never through another backend's or one kept in the
    process. The per-op tier binds one ``BatchLaunches`` per batch (its first layer, for the route
    of the batch info its modules read; every bound Triton op is a method of it), later layers
    none; the numbers are exact."""
    from sglang_xpu_lora.providers import triton_launch

    made = []  # (launch cache, batch info) of every BatchLaunches
    init = triton_launch.BatchLaunches.__init__
    monkeypatch.setattr(
        triton_launch.BatchLaunches, "__init__", lambda self, launches, info: made.append((launches, info)) or init(self, launches, info)
    )
    target, draft = triton_backend(), triton_backend()
    batches = {target: [1, 2, 1, 0], draft: [2, 2, 1]}
    linears = {}
    for backend, slots in batches.items():
        made.clear()
        backend.prepare_lora_batch(forward_batch("DECODE", len(slots)), slots, RANKS, SCALINGS, False)
        assert backend.launch_batch  # small eager batches: the linears launch from compiled handles
        [(linears[backend], _)] = made
    assert linears[target] is not linears[draft]
    for backend, slots in batches.items():  # both batches prepared: the target's runs after the draft's preparation
        made.clear()
        for layer in range(2):
            x = torch.randn(len(slots), HIDDEN)
            for out, a, b, bands in run_modules(backend, x, seed=layer):
                torch.testing.assert_close(out.double(), lora_reference(x, a, b, bands, slots, SCALINGS, RANKS), rtol=1e-5, atol=1e-5)
        assert all(launches is linears[backend] for launches, _ in made), "a Triton op launched through another launch cache"
        assert [info for _, info in made] == [backend._sgemm_info()]


class KernelLaunches(TorchDispatchMode):
    """Records the Triton kernels launched in the interpreter (name, grid as three integers,
    arguments), whoever launches them, and every aten op run outside them."""

    def __init__(self):
        super().__init__()
        self.launches, self.own_ops, self._in_kernel = [], [], False

    def wrap(self, run):
        def launched(kernel, *args, grid, warmup, **kwargs):
            self.launches.append((kernel.fn.__name__, (*grid, 1, 1)[:3], args))
            self._in_kernel = True
            try:
                return run(kernel, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                self._in_kernel = False

        return launched

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        if not self._in_kernel:
            self.own_ops.append(func)
        return func(*args, **(kwargs or {}))


def test_triton_routes_launch_sglang_kernels_as_its_triton_backend_does_and_make_no_other_tensors(triton_backend, monkeypatch):
    """Eager decode on the Triton provider: after the first layer (which binds the batch's ops),
    every run_* call launches SGLang's kernel with the grid and arguments SGLang's wrapper gives it
    for TritonLoRABackend on the same layer, the prepared batch info's tensors among them; no aten
    op runs outside the kernels but the allocation of their outputs (no index slicing, offsets or
    copies per call); the outputs match the float64 reference."""
    from sglang.srt.lora.backend import triton_backend as sglang_triton
    from triton.runtime.interpreter import InterpretedFunction

    from sglang_xpu_lora.providers import triton_ops

    recorder = KernelLaunches()
    monkeypatch.setattr(InterpretedFunction, "run", recorder.wrap(InterpretedFunction.run))
    binds = []
    bind = triton_ops.bind
    monkeypatch.setattr(triton_ops, "bind", lambda names, *args: binds.extend(names) or bind(names, *args))

    slots = [1, 2, 1, 0, 2]
    x = torch.randn(len(slots), HIDDEN)
    peer = sglang_triton.TritonLoRABackend(max_loras_per_batch=MAX_LORAS, device=torch.device("cpu"))
    backend = triton_backend()
    for each in (peer, backend):
        each.prepare_lora_batch(forward_batch("DECODE", len(slots)), slots, RANKS, SCALINGS, False)
    weights = module_weights()
    run_modules(backend, x, weights=weights)  # the first layer binds the batch's ops
    bound = len(binds)
    recorder.launches.clear()
    with recorder:
        outputs = run_modules(backend, x, weights=weights)
    ours, own_ops = recorder.launches, recorder.own_ops
    assert len(binds) == bound  # nothing bound per call
    # per module the shrink's output and the expand's (no base output given), as SGLang's wrappers make them
    assert own_ops == [torch.ops.aten.empty.memory_format, torch.ops.aten.zeros.default] * len(MODULES)
    recorder.launches = []
    run_modules(peer, x, weights=weights)
    expected = recorder.launches

    def described(a):  # integer dtypes aside: the backend makes lora_ranks int32, SGLang's eager batches int64
        return (a.shape, a.stride(), a.dtype if a.is_floating_point() else "int") if isinstance(a, torch.Tensor) else a

    def shape(launches):
        return [(name, grid, [described(a) for a in args]) for name, grid, args in launches]

    assert shape(ours) == shape(expected) and len(ours) == 2 * len(MODULES)
    info = backend._sgemm_info()
    assert all(any(a is info.seg_indptr for a in args) and any(a is info.permutation for a in args) for _, _, args in ours)
    for out, a, b, bands in outputs:
        torch.testing.assert_close(out.double(), lora_reference(x, a, b, bands, slots, SCALINGS, RANKS), rtol=1e-5, atol=1e-5)
