"""Which ops captured by trial run inside graphs, decided at graph set-up by trial captures
(:class:`TrialCaptures`), for ``IntelXpuLoRABackend.init_decode_cuda_graph_batch_info`` /
``init_prefill_cuda_graph_batch_info``.

SGLang calls the graph set-up hooks before it captures, so every capture sees the decided op table.
The trials themselves, their cases and verdicts: :mod:`sglang_xpu_lora.providers.capture_probe`;
the call each trial makes is bound by the provider of the op (``OpSelection.bind_trial``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from sglang_xpu_lora.providers import SelectionLog, capture_probe, select_ops
from sglang_xpu_lora.providers.selection import OpSelection

if TYPE_CHECKING:
    from sglang.srt.lora.mem_pool import LoRAMemoryPool


class TrialCaptures:
    """One backend's trial captures: its :class:`~sglang_xpu_lora.providers.capture_probe.CaptureProbe`
    (per-process state: side stream, verdicts per case) and the verdicts of every graph set-up so
    far, combined (an op keeps its trial provider in graphs only while every trial passed)."""

    def __init__(self):
        self.probe = capture_probe.CaptureProbe()
        self.verdicts: dict = {}

    def decide(
        self, selection: OpSelection, device: torch.device, tokens: int, slots: int,
        pool: Optional[LoRAMemoryPool], log: SelectionLog,
    ) -> OpSelection:
        """The op selection once each op ``selection`` would run inside graphs by trial
        (``graph_candidates``) was tried in a trial capture sized like this graph set-up
        (``tokens``, ``slots`` = ``max_loras_per_batch``, the rank and dtype of ``pool``), rebuilt
        from the verdicts combined with earlier set-ups' and reported to ``log``; ``selection``
        itself without candidates or when ``SGLANG_XPU_LORA_GRAPH_NATIVE`` decides (``never``,
        ``always``).

        Raises:
            ValueError: for an invalid ``SGLANG_XPU_LORA_GRAPH_NATIVE``.
        """
        if not selection.graph_candidates or capture_probe.graph_native_choice() != "probe":
            return selection
        case = capture_probe.ProbeCase.for_graph_setup(device, tokens, slots, pool)
        verdicts = self.probe.try_ops(selection.graph_candidates, case, selection.bind_trial)
        self.verdicts = capture_probe.merge(self.verdicts, verdicts)
        return select_ops(device, self.verdicts, log=log)
