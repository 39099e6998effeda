"""sglang-xpu-lora: an out-of-tree ``intel_xpu`` multi-LoRA backend for SGLang.

Installed, it is found by SGLang through the ``sglang.srt.plugins`` entry point
(:func:`sglang_xpu_lora.plugin.load`); backends join through the ``sglang.lora_backends`` group
(:mod:`sglang_xpu_lora.registry`).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("sglang-xpu-lora")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
