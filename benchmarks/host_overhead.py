"""Host overhead per forward: ``prepare_lora_batch`` plus routing for decode batches over 8
adapters, ``intel_xpu`` against SGLang's ``triton`` backend code on the same device, and the number
of device-to-host synchronisations each adds per decode step.

Synchronisations are counted by intercepting the aten ops that read device memory on the host or
produce data-dependent shapes (``_local_scalar_dense`` behind ``.item()``/``.tolist()``, ``nonzero``,
``masked_select``, ``unique``...) during one prepare + one layer's LoRA ops. The layer's ops run
with the portable provider's device routing, the one every accelerator uses; on a CPU the ops
otherwise route on the host, reading index tensors that live in host memory, which is no device
synchronisation.

    python -m benchmarks.host_overhead [--device cuda] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import types
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.common import RESULTS, time_call, write

MAX_LORAS = 8
SYNC_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "item", "is_nonzero", "equal")


class SyncCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        if func.overloadpacket.__name__.startswith(SYNC_OPS):
            self.count += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def device_routing():
    """Run the portable ops with their device (accelerator) routing, even on CPU tensors."""
    from sglang_xpu_lora.providers import torch_ops

    saved = torch_ops.routes_on_host
    torch_ops.routes_on_host = lambda x, weights, count_runs: False
    try:
        yield
    finally:
        torch_ops.routes_on_host = saved


def decode_batch(batch_size):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return types.SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=batch_size, spec_info=None, return_logprob=False)


def backends(device):
    from sglang.srt.lora.backend.triton_backend import TritonLoRABackend

    from sglang_xpu_lora.backend.xpu import IntelXpuLoRABackend

    return {
        "intel_xpu": IntelXpuLoRABackend(max_loras_per_batch=MAX_LORAS, device=device),
        "triton": TritonLoRABackend(max_loras_per_batch=MAX_LORAS, device=device),
    }


def one_layer(backend, x, a, b):
    backend.run_lora_b_sgemm(x=backend.run_lora_a_sgemm(x, a), weights=b, base_output=None)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    os.environ.setdefault("SGLANG_XPU_LORA_KERNELS", "torch")
    from sglang.srt.plugins import load_plugins

    load_plugins()
    device = torch.device(args.device)
    rng = random.Random(0)
    ranks, scalings = [16] * MAX_LORAS, [2.0] * MAX_LORAS
    a = torch.randn(MAX_LORAS, 16, 256, device=device)
    b = torch.randn(MAX_LORAS, 256, 16, device=device)
    rows = []
    for batch_size in [1, 16, 256] if args.quick else [1, 4, 16, 64, 256, 1024, 2048]:
        weight_indices = [rng.randrange(MAX_LORAS) for _ in range(batch_size)]
        fb = decode_batch(batch_size)
        row = {"batch_size": batch_size}
        for name, backend in backends(device).items():
            def prepare():
                backend.prepare_lora_batch(fb, weight_indices, ranks, scalings, False)
                backend._sgemm_info()

            row[f"{name}_us"] = time_call(prepare, device, min_seconds=0.1 if args.quick else 0.3) * 1e6
            if name == "intel_xpu":
                x = torch.randn(batch_size, 256, device=device)
                with device_routing(), SyncCounter() as counter:
                    prepare()
                    one_layer(backend, x, a, b)
                row["intel_xpu_syncs"] = counter.count
            else:
                with SyncCounter() as counter:
                    prepare()
                row["triton_prepare_syncs"] = counter.count
        row["ratio"] = row["intel_xpu_us"] / row["triton_us"]
        row["added_syncs"] = row["intel_xpu_syncs"] - row["triton_prepare_syncs"]
        rows.append(row)
        print(row, flush=True)
    write("host_overhead-" + args.device + ("-quick" if args.quick else ""), rows,
          ["batch_size", "triton_us", "intel_xpu_us", "ratio", "triton_prepare_syncs", "intel_xpu_syncs", "added_syncs"], args.out)


if __name__ == "__main__":
    main()
