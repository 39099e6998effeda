"""The eager linears on SGLang's Triton kernels launched from compiled handles
(:mod:`sglang_xpu_lora.providers.triton_launch`).

Numbers: Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, tests/conftest.py), which
launches every kernel through the interpreted function, against a float64 per-row loop
(``lora_helpers.lora_reference``), for one slice, two equal (gate/up), two uneven (MLA), three
uneven (q/k/v) and four (GDN) slices and a layer whose LoRA covers only its leading output
columns, contiguous and permuted (decode) batches, fp32 and fp16. The pool holds ranks below the
maximum, a rank-0 slot, stale rank tails (a reused slot) and a slot of NaN: no other row may see it.
Tolerances relative to the reference's largest magnitude: fp32 1e-5, fp16 2e-3.

Compiled handles: a stand-in ``JITFunction`` records what is compiled and launched, since CPU has
no compiled Triton kernels; the key is shown to tell apart every argument Triton specializes on.
"""

from __future__ import annotations

import types

import pytest
import torch
from triton.runtime.jit import JITFunction

from lora_helpers import lora_reference, pool_weights

SLOTS, MAX_RANK, K = 5, 4, 24
RANKS, SCALINGS = [0, 2, 4, 3, 4], [0.0, 2.0, 0.5, 1.5, 1.0]
NAN_SLOT = 4
SLICES = {"one": (20,), "gate_up": (12, 12), "mla": (12, 8), "qkv": (16, 8, 8), "four": (8, 4, 4, 8)}
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}
#: Slot of each row: every slot, the NaN one included, rows of one slot not adjacent.
ROWS = [1, 0, 3, 4, 2, 1, 3, 2, 4, 1]


def pool(slices, dtype):
    """A ``(slots, n * max_rank, K)``, B ``(slots, N, max_rank)``, packed, rank tails stale (random,
    as a reused slot leaves them), the NaN slot all NaN."""
    a, b = pool_weights(RANKS, len(slices), slices, MAX_RANK, K, seed=0)
    gen = torch.Generator().manual_seed(1)
    for slot, rank in enumerate(RANKS):
        a[slot, len(slices) * rank :] = torch.randn(a[slot, len(slices) * rank :].shape, generator=gen)
        b[slot, :, rank:] = torch.randn(b[slot, :, rank:].shape, generator=gen)
    a[NAN_SLOT], b[NAN_SLOT] = float("nan"), float("nan")
    return a.to(dtype), b.to(dtype)


def batch_info(rows, permuted: bool):
    """SGLang's batch info of the linears: contiguous (one segment per run of equal slots, as an
    extend batch's requests) or permuted (decode: rows grouped by slot through ``permutation``)."""
    from sglang.srt.lora.utils import LoRABatchInfo

    if permuted:
        slots = sorted(set(rows))
        order = [row for slot in slots for row, s in enumerate(rows) if s == slot]
        lens = [rows.count(slot) for slot in slots]
        permutation = torch.tensor(order, dtype=torch.int64)
    else:
        slots, lens = [], []
        for slot in rows:
            if slots and slots[-1] == slot:
                lens[-1] += 1
            else:
                slots.append(slot), lens.append(1)
        permutation = None
    seg_lens = torch.tensor(lens, dtype=torch.int32)
    seg_indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    seg_indptr[1:] = torch.cumsum(seg_lens, 0)
    return LoRABatchInfo(
        use_cuda_graph=False, bs=len(lens), num_segments=len(lens), seg_indptr=seg_indptr, seg_lens=seg_lens,
        weight_indices=torch.tensor(slots, dtype=torch.int32), lora_ranks=torch.tensor(RANKS, dtype=torch.int32),
        scalings=torch.tensor(SCALINGS, dtype=torch.float32), max_len=max(lens), permutation=permutation,
    )


def run(slices, dtype, permuted, *, extra_columns=0, launches=None, rows=ROWS):
    """One linear through :class:`TritonLinearLaunches` over a batch of ``rows`` (slot per row);
    returns (output, float64 reference)."""
    from sglang_xpu_lora.providers.triton_launch import TritonLinearLaunches

    launches = launches or TritonLinearLaunches()
    a, b = pool(slices, dtype)
    offsets = (0, *torch.tensor(slices).cumsum(0).tolist())
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(len(rows), K, generator=gen).to(dtype)
    weight = torch.randn(offsets[-1] + extra_columns, K, generator=gen).to(dtype)
    launches.begin_batch(batch_info(rows, permuted))
    out = launches.forward(x, lambda: x @ weight.t(), a, b, torch.tensor(offsets, dtype=torch.int32), offsets)
    base = (x.double() @ weight.double().t())
    ref = base.clone()
    ref[:, : offsets[-1]] = lora_reference(x, a, b, slices, rows, SCALINGS, RANKS, base=base[:, : offsets[-1]])
    return out, ref


def assert_other_rows_close(out, ref, dtype, rows=ROWS):
    live = [row for row, slot in enumerate(rows) if slot != NAN_SLOT]
    assert torch.isfinite(out[live]).all(), "a NaN slot reached another adapter's rows"
    scale = ref[live].abs().max()
    torch.testing.assert_close(out[live].double(), ref[live], rtol=0, atol=TOLERANCE[dtype] * float(scale))


@pytest.mark.parametrize("permuted", [False, True], ids=["contiguous", "permuted"])
@pytest.mark.parametrize("slices", list(SLICES), ids=list(SLICES))
def test_every_slice_form_equals_the_float64_loop(slices, permuted):
    out, ref = run(SLICES[slices], torch.float16, permuted)
    assert_other_rows_close(out, ref, torch.float16)


@pytest.mark.parametrize("slices", ["one", "qkv"])
def test_fp32_equals_the_float64_loop(slices):
    out, ref = run(SLICES[slices], torch.float32, True)
    assert_other_rows_close(out, ref, torch.float32)


def test_a_prefix_partition_layer_gets_lora_in_its_leading_columns_only():
    """Mamba2 / LFM2 ``in_proj``: the base output is wider than LoRA-B; the kernels add through its
    strides into the leading columns and leave the rest as the base GEMM wrote them."""
    out, ref = run(SLICES["gate_up"], torch.float32, False, extra_columns=6)
    assert out.shape[1] == sum(SLICES["gate_up"]) + 6
    assert_other_rows_close(out, ref, torch.float32)


#: A prefill-like batch: segments of 70 and 66 rows (the long-segment tiles), a NaN slot's and a
#: rank-0 slot's rows among them.
LONG_ROWS = [2] * 70 + [4] * 3 + [0] * 2 + [3] * 66


@pytest.mark.parametrize("slices", ["one", "qkv"])
def test_long_segments_run_their_own_tiles_and_equal_the_float64_loop(slices):
    from sglang_xpu_lora.providers.triton_launch import LONG_SEGMENT_ROWS, TritonLinearLaunches

    assert max(LONG_ROWS.count(slot) for slot in set(LONG_ROWS)) >= LONG_SEGMENT_ROWS
    launches = TritonLinearLaunches()
    out, ref = run(SLICES[slices], torch.float32, False, launches=launches, rows=LONG_ROWS)
    assert launches.tiles == launches.long_segment_tiles
    assert_other_rows_close(out, ref, torch.float32, rows=LONG_ROWS)


def test_the_nan_check_catches_a_leak():
    """The check above fails when a NaN slot's values land in another row."""
    out, ref = run(SLICES["one"], torch.float32, False)
    out[0, 0] = float("nan")
    with pytest.raises(AssertionError, match="NaN slot reached"):
        assert_other_rows_close(out, ref, torch.float32)


def test_a_linear_without_a_batch_is_refused():
    from sglang_xpu_lora.providers.triton_launch import TritonLinearLaunches

    launches = TritonLinearLaunches()
    with pytest.raises(RuntimeError, match="no prepared batch"):
        launches.forward(torch.zeros(1, K), lambda: torch.zeros(1, 4), None, torch.zeros(1, 4, 1), None, (0, 4))


# --- compiled handles ----------------------------------------------------------------------------


class StandInKernel(JITFunction):
    """A ``JITFunction`` stand-in: ``run`` compiles (records the call) and returns a compiled
    kernel whose launcher records its launches."""

    def __init__(self):  # not JITFunction's: there is no function to compile
        self.compiles, self.launches = [], []

    def run(self, *args, grid, warmup):
        self.compiles.append(args)
        compiled = types.SimpleNamespace(function="fn", packed_metadata="meta")
        compiled.launch_metadata = lambda grid, stream, *args: "launch-metadata"
        compiled.run = lambda *launch: self.launches.append(launch)
        return compiled


def test_the_first_launch_of_a_key_compiles_later_ones_call_the_launcher():
    from triton import knobs

    from sglang_xpu_lora.providers.triton_launch import CompiledLaunches

    kernel = StandInKernel()
    launches = CompiledLaunches(kernel, current_device=lambda: 0, current_stream=lambda device: "stream")
    launches.launch("k", (2, 3, 1), ("x", 7))
    assert kernel.compiles == [("x", 7)] and kernel.launches == []
    launches.launch("k", (2, 3, 1), ("y", 7))
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    assert kernel.launches == [(2, 3, 1, "stream", "fn", "meta", "launch-metadata", *hooks, "y", 7)]
    launches.launch("other", (2, 3, 1), ("x", 8))
    assert len(kernel.compiles) == 2 and launches.compiled_keys == 2


def stand_in_launches():
    from sglang_xpu_lora.providers.triton_launch import CompiledLaunches, TritonLinearLaunches

    kernels = {name: StandInKernel() for name in ("shrink", "expand_one", "expand_bands", "expand_two")}
    launches = TritonLinearLaunches(
        kernels=types.SimpleNamespace(**kernels), launches=lambda kernel: CompiledLaunches(kernel, current_device=lambda: 0, current_stream=lambda device: 0)
    )
    return launches, kernels


def forward_once(launches, x, lora_a, lora_b, offsets, rows=ROWS, permuted=False):
    launches.begin_batch(batch_info(rows, permuted))
    base = torch.zeros(x.shape[0], offsets[-1], dtype=x.dtype)
    launches.forward(x, lambda: base, lora_a, lora_b, torch.tensor(offsets, dtype=torch.int32), offsets)


def test_the_key_tells_apart_what_triton_specializes_on():
    """One compile per specialization, across layers and batches of the same shapes; a new compile
    for a misaligned input, another dtype, other shapes or a permuted batch. Without alignment in
    the key a misaligned input would be launched on a kernel that assumes 16-byte alignment."""
    launches, kernels = stand_in_launches()
    a, b = pool(SLICES["one"], torch.float16)
    offsets = (0, 20)
    x = torch.randn(len(ROWS), K, dtype=torch.float16)
    for _ in range(3):  # three layers, then a second batch
        forward_once(launches, x, a, b, offsets)
    forward_once(launches, x.clone(), a, b, offsets, rows=ROWS[:4])
    assert len(kernels["shrink"].compiles) == 1 and len(kernels["shrink"].launches) == 3
    assert len(kernels["expand_one"].compiles) == 1
    storage = torch.zeros(x.numel() + 1, dtype=torch.float16)
    misaligned = storage[1:].view_as(x)  # 2 bytes past a 16-byte boundary
    misaligned.copy_(x)
    assert misaligned.data_ptr() % 16 != 0
    forward_once(launches, misaligned, a, b, offsets)
    assert len(kernels["shrink"].compiles) == 2
    forward_once(launches, x.float(), a.float(), b.float(), offsets)
    assert len(kernels["shrink"].compiles) == 3
    forward_once(launches, x, a, b, offsets, permuted=True)
    assert len(kernels["shrink"].compiles) == 4 and len(kernels["expand_one"].compiles) == 3
    a3, b3 = pool(SLICES["qkv"], torch.float16)
    forward_once(launches, x, a3, b3, (0, 16, 24, 32))
    assert len(kernels["shrink"].compiles) == 5 and len(kernels["expand_bands"].compiles) == 1


def test_the_key_tells_apart_the_band_offsets_dtype():
    """Triton specializes the expand's ``n_offs`` pointer on its dtype as on every tensor's: a kernel
    compiled for int32 band offsets must not be launched with int64 ones (it would read each int64
    as two int32s, band bounds of another layout, and add into other columns)."""
    launches, kernels = stand_in_launches()
    a, b = pool(SLICES["qkv"], torch.float16)
    offsets = (0, 16, 24, 32)
    x = torch.randn(len(ROWS), K, dtype=torch.float16)
    for dtype in (torch.int32, torch.int64):
        launches.begin_batch(batch_info(ROWS, False))
        base = torch.zeros(x.shape[0], offsets[-1], dtype=x.dtype)
        launches.forward(x, lambda: base, a, b, torch.tensor(offsets, dtype=dtype), offsets)
    assert len(kernels["expand_bands"].compiles) == 2 and kernels["expand_bands"].launches == []


def test_a_compiled_kernel_is_launched_only_on_the_device_it_was_loaded_for():
    """A compiled kernel's handle is loaded on one device; ``JITFunction.run`` keeps a cache per
    current device. After the current device changes, a key seen on another device goes through
    ``JITFunction.run`` (which loads it there) rather than to the first device's handle, and each
    launch gets the stream of the device it runs on."""
    from sglang_xpu_lora.providers.triton_launch import CompiledLaunches

    kernel, current = StandInKernel(), [0]
    launches = CompiledLaunches(
        kernel, current_device=lambda: current[0], current_stream=lambda device: f"stream-{device}"
    )
    for device in (0, 0, 1, 1, 0):
        current[0] = device
        launches.launch("k", (2, 3, 1), ("x", 7))
    assert len(kernel.compiles) == 2 and launches.compiled_keys == 2
    assert [launch[3] for launch in kernel.launches] == ["stream-0", "stream-1", "stream-0"]


def test_a_triton_that_launches_otherwise_gets_every_launch_through_jitfunction_run(monkeypatch):
    """The direct launch repeats the launcher call of Triton's ``JITFunction.run``, whose argument
    list has changed between Triton releases (3.0-3.2 passed the non-constexpr arguments alone,
    and ``kernel.metadata`` before ``packed_metadata``). With a ``JITFunction.run`` that does not
    launch exactly as expected, nothing is launched directly: every launch goes through it."""
    from sglang_xpu_lora.providers import triton_launch

    assert triton_launch.launches_like_jit_run(), "the pinned Triton's JITFunction.run launches as expected"

    def run(self, *args, grid, warmup, **kwargs):  # Triton 3.2's launch, never called
        kernel = non_constexpr_vals = grid_0 = grid_1 = grid_2 = stream = launch_metadata = CompiledKernel = None
        kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata,
                   CompiledKernel.launch_enter_hook, CompiledKernel.launch_exit_hook, *non_constexpr_vals)

    monkeypatch.setattr(JITFunction, "run", run)
    assert not triton_launch.launches_like_jit_run()
    kernel = StandInKernel()
    launches = triton_launch.CompiledLaunches(kernel, current_device=lambda: 0, current_stream=lambda device: 0)
    for _ in range(3):
        launches.launch("k", (2, 3, 1), ("x", 7))
    assert len(kernel.compiles) == 3 and kernel.launches == [] and launches.compiled_keys == 0
