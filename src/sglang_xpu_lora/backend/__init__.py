"""The ``intel_xpu`` LoRA backend (``xpu.py``) and its ``sglang.lora_backends`` registration."""
