"""Development-only support for running SGLang 0.5.23 on a CPU-only machine.

Never shipped with ``sglang-xpu-lora``; see this package's README for the three workarounds.
"""

#: Environment that makes SGLang pick its CPU platform (without it the scheduler fails in RoPE
#: setup importing ``vllm._custom_ops``).
CPU_ENGINE_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}

__all__ = ["CPU_ENGINE_ENV"]
