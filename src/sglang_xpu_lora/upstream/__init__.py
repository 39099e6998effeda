"""The SGLang surface of sglang-xpu-lora: every SGLang name it reads or overrides
(:mod:`.targets`), the check of the installed SGLang against it (:mod:`.compat`), how an
instance or model attribute is found in SGLang's classes and sources (:mod:`.attributes`), and the
device SGLang picks and what its CPU engine needs (:mod:`.devices`).

A leaf package: of sglang-xpu-lora it imports only :mod:`sglang_xpu_lora.settings` (the names of
the environment variables), and neither torch nor SGLang at import time (:mod:`.devices` imports
torch, and :mod:`.compat` SGLang, inside the functions that need them).
"""
