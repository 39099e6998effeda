"""Scenario 10, tensor parallelism, at the layer level: the same adapters sharded over TP 2 give the
unsharded numbers.

Two processes joined by torch.distributed (gloo) each hold a TP shard of SGLang's real LoRA layer
classes, sliced by SGLang's own ``slice_lora_a/b_weights``: a column-parallel q/k/v projection
(outputs gathered) and a row-parallel projection (LoRA-A partial sums all-reduced by the backend's
``forward_with_base``, as ``RowParallelLinearWithLoRA`` does). Both are compared with a float64
computation of the unsharded layer (tolerance 1e-5, float32), for both providers, prefill and
decode. This isolates the backend's sharded math in seconds; the real engine and server at
``--tp-size 2`` and a two-node launch are tested end to end in
``tests/e2e/test_tensor_parallel_engine.py``. The workers share one process group, killed whole if
they hang (e.g. loopback down in a network namespace), so a timeout leaves nothing running.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from sglang_cpu_devsupport import serving

pytestmark = pytest.mark.launches

WORKER = textwrap.dedent(
    """
    import json, os, sys, types
    import torch, torch.distributed as dist

    rank, port, out_path, build = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from sglang.srt.plugins import load_plugins
    load_plugins()
    if build != "none":
        from sglang_cpu_devsupport import kernel_emulator
        kernel_emulator.install(build)
    from sglang.srt.lora import layers
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang_xpu_lora.backend.xpu import IntelXpuLoRABackend

    L, R, HID, HEAD, NH, NKV = 3, 4, 16, 4, 4, 2
    Q, KV, OUT = NH * HEAD, NKV * HEAD, 12
    RANKS, SCALINGS = [0, 4, 2], [0.0, 2.0, 0.5]
    gen = torch.Generator().manual_seed(0)
    A_qkv, B_qkv = torch.randn(L, 3 * R, HID, generator=gen), torch.randn(L, Q + 2 * KV, R, generator=gen)
    A_o, B_o = torch.randn(L, R, Q, generator=gen), torch.randn(L, OUT, R, generator=gen)
    for slot, r in enumerate(RANKS):  # SGLang's packed pool, zeroed tails: slice p of a rank-r slot at rows p * r
        A_qkv[slot, 3 * r:] = 0
        A_o[slot, r:] = 0
        B_qkv[slot, :, r:] = 0
        B_o[slot, :, r:] = 0
    group = types.SimpleNamespace(rank_in_group=rank, world_size=2)

    class Base(torch.nn.Module):
        def __init__(self, **attrs):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))
            self.bias = None
            self.__dict__.update(attrs)

    def reference(x, A, B, bands, slots):
        out = torch.zeros(x.shape[0], bands[-1], dtype=torch.float64)
        for row, slot in enumerate(slots):
            for p in range(len(bands) - 1):
                r = RANKS[slot]
                s = A[slot, p * r:(p + 1) * r].double() @ x[row].double()
                out[row, bands[p]:bands[p + 1]] = SCALINGS[slot] * (B[slot, bands[p]:bands[p + 1], :r].double() @ s)
        return out

    errors = {}
    for mode in ("prefill", "decode"):
        backend = IntelXpuLoRABackend(max_loras_per_batch=L, device=torch.device("cpu"))
        if mode == "prefill":
            lens, wi = [3, 4], [1, 2]
            fb = types.SimpleNamespace(forward_mode=ForwardMode.EXTEND, batch_size=2, spec_info=None, return_logprob=False,
                                       extend_seq_lens=torch.tensor(lens, dtype=torch.int32), extend_seq_lens_cpu=lens, extend_num_tokens=7)
            slots = [s for s, n in zip(wi, lens) for _ in range(n)]
        else:
            slots = wi = [2, 1, 2, 0, 1]
            fb = types.SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=5, spec_info=None, return_logprob=False)
        backend.prepare_lora_batch(fb, wi, RANKS, SCALINGS, False)
        x = torch.randn(len(slots), HID, generator=torch.Generator().manual_seed(1))

        qkv = layers.QKVParallelLinearWithLoRA(Base(
            output_partition_sizes=[Q // 2, KV // 2, KV // 2], q_proj_shard_size=Q // 2, kv_proj_shard_size=KV // 2,
            num_kv_head_replicas=1, tp_group=group, kv_tp_group=group, total_num_heads=NH, total_num_kv_heads=NKV,
            head_size=HEAD), backend)
        qkv.set_lora_info(torch.stack([qkv.slice_lora_a_weights(a) for a in A_qkv]),
                          torch.stack([qkv.slice_lora_b_weights(b) for b in B_qkv]))
        shard = qkv.apply_lora(torch.zeros(len(slots), (Q + 2 * KV) // 2), x)
        gathered = [torch.empty_like(shard) for _ in range(2)]
        dist.all_gather(gathered, shard)
        bands = [(0, Q // 2), (Q // 2, Q // 2 + KV // 2), (Q // 2 + KV // 2, (Q + 2 * KV) // 2)]
        full = torch.cat([g[:, lo:hi] for lo, hi in bands for g in gathered], dim=1)
        errors[f"qkv-{mode}"] = float((full.double() - reference(x, A_qkv, B_qkv, [0, Q, Q + KV, Q + 2 * KV], slots)).abs().max())

        row = layers.RowParallelLinearWithLoRA(Base(input_size_per_partition=Q // 2, output_size=OUT, tp_group=group), backend)
        row.set_lora_info(torch.stack([row.slice_lora_a_weights(a) for a in A_o]), B_o.clone())
        x_o = torch.randn(len(slots), Q, generator=torch.Generator().manual_seed(2))
        x_shard = x_o[:, rank * Q // 2:(rank + 1) * Q // 2].contiguous()

        def all_reduce(t):
            dist.all_reduce(t)
            return t

        out = backend.forward_with_base(row, x_shard, lambda: torch.zeros(len(slots), OUT), row.lora_a, row.lora_b,
                                        row.output_offset, row.lora_offsets, all_reduce=all_reduce)
        errors[f"row-{mode}"] = float((out.double() - reference(x_o, A_o, B_o, [0, OUT], slots)).abs().max())
    if rank == 0:
        open(out_path, "w").write(json.dumps(errors))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads can abort interpreter teardown ("terminate called ..."): skip it
    """
)


@pytest.mark.parametrize("build, kernels", [("none", "torch"), ("full", "native")], ids=["portable", "native"])
def test_lora_layers_sharded_over_tp2_match_unsharded(tmp_path, build, kernels):
    port, out = str(serving.free_port()), tmp_path / "errors.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_XPU_LORA")}
    env.update(SGLANG_USE_CPU_ENGINE="1", SGLANG_XPU_LORA_KERNELS=kernels)
    procs = []
    for rank in range(2):  # one process group (rank 0's), so a hang is killed whole
        group = procs[0].pid if procs else 0
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER, str(rank), port, str(out), build], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, process_group=group))
    try:
        logs = [p.communicate(timeout=300) for p in procs]
    finally:
        serving.kill_process_group(procs[0].pid)
    assert all(p.returncode == 0 for p in procs), "\n".join(err[-2000:] for _, err in logs)
    errors = json.loads(out.read_text())
    assert set(errors) == {"qkv-prefill", "row-prefill", "qkv-decode", "row-decode"}
    assert all(e < 1e-5 for e in errors.values()), errors
