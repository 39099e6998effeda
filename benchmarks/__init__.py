"""Benchmarks of sglang-xpu-lora; each module runs with ``python -m benchmarks.<name>``."""
