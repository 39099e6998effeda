"""The SGLang surface of sglang-xpu-lora: every SGLang name it reads or overrides
(:mod:`.targets`) and the check of the installed SGLang against it (:mod:`.compat`).

A leaf package: it imports nothing of sglang-xpu-lora, and neither torch nor SGLang at import time.
"""
