"""Tenant isolation of every op, per provider and routing: a row reads only its own slot's weights.

A pool slot (here slot 2) is filled with NaN, +Inf or -Inf in every weight tensor an op reads:
LoRA-A (the shrink ops), LoRA-B (the expand ops, also at lm_head width), the embedding LoRA-A and
its extra (added-token) rows. Every row that does not belong to that slot must then be
**bit-identical** to the run where the slot holds zeros (an empty slot, as after SGLang's
``remove_lora``), whether the poisoned slot is only resident or also requested by other rows of the
batch, and the same again once the slot is emptied (zeroed in place, as ``remove_lora`` does).

Providers: the portable ops routed on the host and on the device (both forced on CPU tensors; on the
device both GEMM forms, forced too), the op table selected over each emulated sgl-kernel-xpu build
(native ops where the build has them), and SGLang's Triton kernels (the ``triton`` provider, in
Triton's interpreter: fp32 and fp16, since the interpreter has no bfloat16 arithmetic, see
test_triton_ops.py).
"""

from __future__ import annotations

import pytest
import torch

from sglang_cpu_devsupport import kernel_emulator

from sglang_xpu_lora import providers
from sglang_xpu_lora.providers import torch_ops
from sglang_xpu_lora.providers.torch_routing import device

ROWS, HIDDEN, RANK, SLOTS, VOCAB, EXTRA = 9, 16, 4, 3, 24, 2
POISONED = 2
OFFSETS = [0, 8, 12, 16]  # q, k, v bands of a 16-wide qkv output
LM_HEAD = 40  # an lm_head-like expand: vocabulary-wide output


@pytest.fixture(params=["torch-host", "torch-device", "torch-device-gathered", *(f"native-{build}" for build in kernel_emulator.BUILDS)])
def ops(request, monkeypatch, emulate):
    """The op table of one provider/routing: the portable ops with either routing (on the device in
    either GEMM form: every slot's product, or each row's own slot weights gathered), or what
    ``SGLANG_XPU_LORA_KERNELS=auto`` selects over an emulated sgl-kernel-xpu build (native ops where
    the build has them, the portable ones elsewhere)."""
    if request.param.startswith("native-"):
        with emulate(request.param.removeprefix("native-")):
            yield providers.select_ops().eager
        return
    on_host, gathered = request.param == "torch-host", request.param == "torch-device-gathered"
    monkeypatch.setattr(torch_ops, "routes_on_host", lambda x, weights, count_runs: on_host)
    monkeypatch.setattr(device, "gathers_rows", lambda *shape, **form: gathered)
    yield torch_ops


def batch(requested: bool):
    """Segments over slots 0 and 1 (and slot 2 when ``requested``), contiguous and permuted."""
    if requested:
        seg_indptr, weight_indices = [0, 3, 6, ROWS], [0, 2, 1]
    else:
        seg_indptr, weight_indices = [0, 3, 3, ROWS], [0, 2, 1]  # slot 2's segment is empty
    own = torch.zeros(ROWS, dtype=torch.int64)
    for s, slot in enumerate(weight_indices):
        own[seg_indptr[s] : seg_indptr[s + 1]] = slot
    permutation = torch.tensor([4, 0, 8, 2, 6, 1, 7, 3, 5], dtype=torch.int32)
    physical_slot = torch.empty_like(own)
    physical_slot[permutation.long()] = own
    meta = dict(
        seg_indptr=torch.tensor(seg_indptr, dtype=torch.int32),
        weight_indices=torch.tensor(weight_indices, dtype=torch.int32),
        lora_ranks=torch.tensor([RANK, 2, RANK], dtype=torch.int32),
    )
    return meta, permutation, own, physical_slot


def weights(poison: float, dtype) -> dict:
    """Every weight tensor of a small pool in SGLang's packed layout, rank tails zero (slot 1 has
    rank 2: its q/k/v A slices in rows 0-5); slot 2 filled with ``poison`` (0.0: an empty slot)."""
    gen = torch.Generator().manual_seed(0)
    w = dict(
        a=torch.randn(SLOTS, 3 * RANK, HIDDEN, generator=gen), b=torch.randn(SLOTS, OFFSETS[-1], RANK, generator=gen),
        lm_head_b=torch.randn(SLOTS, LM_HEAD, RANK, generator=gen), gate_up_b=torch.randn(SLOTS, 16, RANK, generator=gen),
        embedding=torch.randn(SLOTS, RANK, VOCAB, generator=gen), extra=torch.randn(SLOTS, EXTRA, RANK, generator=gen),
    )
    w["a"][1, 3 * 2 :] = 0
    for name in ("b", "lm_head_b", "gate_up_b", "extra"):
        w[name][1, :, 2:] = 0
    w["embedding"][1, 2:] = 0
    for tensor in w.values():
        tensor[POISONED] = poison
    return {name: tensor.to(dtype) for name, tensor in w.items()}


def run_all(ops, w, meta, permutation, dtype) -> dict:
    """Each op's output for one pool state (each op gets its own copy of ``base_output``: the Triton
    and portable B ops add into it in place, as SGLang's kernels do)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS, HIDDEN, generator=gen).to(dtype)
    mid = torch.randn(ROWS, 3 * RANK, generator=gen).to(dtype)
    base = torch.randn(ROWS, OFFSETS[-1], generator=gen).to(dtype)
    ids = torch.tensor([0, 5, VOCAB, 23, VOCAB + 1, 7, 3, 11, 2])
    scalings = torch.tensor([0.5, 2.0, 1.0])
    offsets = torch.tensor(OFFSETS, dtype=torch.int32)
    return {
        "embedding": ops.embedding_lora_a_fwd(
            input_ids=ids, weights=w["embedding"], vocab_size=VOCAB, extra_embeddings=w["extra"], max_len=ROWS, **meta
        ),
        "shrink": ops.sgemm_lora_a_fwd(input_x=x, weights=w["a"], num_slices=3, **meta),
        "expand": ops.sgemm_lora_b_fwd(
            input_x=mid[:, :RANK].contiguous(), weights=w["b"], scalings=scalings, base_output=base.clone(), **meta
        ),
        "lm_head": ops.sgemm_lora_b_fwd(input_x=mid[:, :RANK].contiguous(), weights=w["lm_head_b"], scalings=scalings, **meta),
        "qkv": ops.qkv_lora_b_fwd(
            input_x=mid, qkv_lora_b=w["b"], output_offset=offsets, max_qkv_out_dim=8, scalings=scalings, base_output=base.clone(), **meta
        ),
        "gate_up": ops.gate_up_lora_b_fwd(
            input_x=mid[:, : 2 * RANK].contiguous(), gate_up_lora_b=w["gate_up_b"], output_dim=8, scalings=scalings, **meta
        ),
        "chunked_shrink": ops.chunked_sgmv_lora_shrink_fwd(
            input_x=x, weights=w["a"], num_slices=3, num_segments=3, permutation=permutation, **meta
        ),
        "chunked_expand": ops.chunked_sgmv_lora_expand_fwd(
            input_x=mid, weights=w["b"], slice_offsets=offsets, max_slice_size=8, num_slices=3, num_segments=3,
            scalings=scalings, permutation=permutation, base_output=base.clone(), **meta,
        ),
    }


class TritonOps:
    """The ``triton`` provider as the backend calls it: each op also gets SGLang's batch info for
    its segments, with the slots' real ranks. A shrink leaves each row's columns from
    ``num_slices * rank`` on unwritten (uninitialised memory, read by no Triton expand:
    :mod:`sglang_xpu_lora.providers.triton_ops`); they are zeroed here, so the comparison covers
    what the kernel writes."""

    def __getattr__(self, op):
        from test_triton_ops import sglang_batch_info

        from sglang_xpu_lora.providers import triton_ops
        from sglang_xpu_lora.providers.torch_routing.device import row_slots

        def call(**kwargs):
            info = sglang_batch_info(
                kwargs["seg_indptr"], kwargs["weight_indices"], kwargs["lora_ranks"],
                kwargs.get("scalings", torch.ones(SLOTS)), kwargs.get("permutation"),
            )
            out = getattr(triton_ops, op)(**kwargs, batch_info=info)
            if op not in ("sgemm_lora_a_fwd", "chunked_sgmv_lora_shrink_fwd"):
                return out
            slots = row_slots(kwargs["seg_indptr"], kwargs["weight_indices"], out.shape[0], kwargs.get("permutation"))
            written = kwargs["num_slices"] * kwargs["lora_ranks"].long()[slots.clamp(min=0)]
            return out.masked_fill(torch.arange(out.shape[1]) >= written.unsqueeze(1), 0)

        return call


POISONS = pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
REQUESTED = pytest.mark.parametrize("requested", [False, True], ids=["resident", "requested"])


@REQUESTED
@POISONS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_non_finite_slot_leaves_every_other_row_bit_identical(ops, poison, requested, dtype):
    check_isolation(ops, poison, requested, dtype)


@REQUESTED
@POISONS
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_triton_provider_keeps_a_non_finite_slot_to_its_own_rows(poison, requested, dtype):
    check_isolation(TritonOps(), poison, requested, dtype)


def check_isolation(ops, poison, requested, dtype):
    """Rows of other slots are bit-identical with the poisoned slot resident (or requested) and after
    it is emptied in place."""
    meta, permutation, own, physical_slot = batch(requested)
    clean = run_all(ops, weights(0.0, dtype), meta, permutation, dtype)
    poisoned_pool = weights(poison, dtype)
    poisoned = run_all(ops, poisoned_pool, meta, permutation, dtype)
    for name, out in clean.items():
        other = (physical_slot if name.startswith("chunked") else own) != POISONED
        assert torch.equal(poisoned[name][other], out[other]), name
        assert torch.isfinite(out).all(), name
    for tensor in poisoned_pool.values():  # the slot is emptied in place, as remove_lora does
        tensor[POISONED].zero_()
    emptied = run_all(ops, poisoned_pool, meta, permutation, dtype)
    for name, out in clean.items():
        assert torch.equal(emptied[name], out), name
