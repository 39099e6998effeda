"""The line a backend logs when it is built: which provider runs each op, eager and in graphs, and
the pool layout its ops read."""

from __future__ import annotations

import torch

from sglang_xpu_lora.settings import KERNELS_ENV


def built_line(name: str, device, selection, dense=None) -> str:
    """The line a backend logs when it is built: the provider of each op eager / in graphs (ops
    grouped by provider pair), which providers' ops in graphs still wait for their trial capture,
    and the pool layout the ops read (``selection``: an
    :class:`~sglang_xpu_lora.providers.OpSelection`); with a dense tier (``dense``, a
    :class:`~sglang_xpu_lora.dense.runner.DeviceDenseRunner`), where its plans come from."""
    groups: dict[str, list[str]] = {}
    for op, choice in selection.choices.items():
        groups.setdefault(f"{choice.provider.name}/{selection.graph_choices[op].provider.name}", []).append(op)
    ops = "; ".join(
        f"{pair} for {'all ' + str(len(ops)) + ' ops' if len(ops) == len(selection.choices) else ', '.join(ops)}"
        for pair, ops in groups.items()
    )
    if not selection.graph_decided:
        waiting = sorted({choice.provider.name for choice in selection.trial_choices.values()})
        ops += f" ({'/'.join(waiting)} ops in graphs once a trial capture at graph set-up accepts them)"
    if dense is not None:
        ops += (
            "; linears where triton is named: dense tier (SGLang's triton_v2 kernels, "
            f"plans from {', '.join(dense.plans.sources)})"
        )
    return (
        f"{name} LoRA backend built on {torch.device(device).type} ({KERNELS_ENV}={selection.setting.value}): "
        f"providers eager/in graphs: {ops}; LoRA pool: {selection.pool_layout}"
    )
