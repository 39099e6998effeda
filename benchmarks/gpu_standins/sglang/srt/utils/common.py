"""Stand-in for ``sglang.srt.utils.common``: what the LoRA backend modules import."""

import torch


def empty_device_cache():
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
