"""Whether a CUDA/XPU graph is being captured on a device: state computed during a capture is
part of that graph (its values exist only once the graph runs), so the per-batch caches of the
backend and of the portable ops keep it apart from eager state.
"""

from __future__ import annotations

import torch


def capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device``'s backend (``torch.cuda``, ``torch.xpu``...) is
    capturing a graph; False for devices without graphs."""
    backend = getattr(torch, device.type, None)
    is_capturing = getattr(backend, "is_current_stream_capturing", None)
    return bool(is_capturing()) if is_capturing is not None else False
