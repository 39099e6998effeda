"""Stub of ``sgl_kernel`` for running SGLang 0.5.23 on a CPU-only machine (development only).

SGLang's CPU platform imports ``*_cpu`` ops at module import time (e.g.
``sglang/kernels/ops/kvcache/cache_move.py``), and the PyPI CUDA wheel cannot load without
``libcuda.so.1``. This stub resolves only names ending in ``_cpu``; any other name raises
``ImportError``/``AttributeError`` so SGLang's ``try: from sgl_kernel import X`` fallbacks behave as
if the op were absent. A stub op raises ``NotImplementedError`` if called; with
``attention_backend="torch_native"`` on a Llama model none is.
"""

from __future__ import annotations

__version__ = "0.0.0+cpu-devsupport-stub"


def _make_stub(name: str):
    def stub(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is a CPU development stub (sglang-cpu-devsupport); "
            "this SGLang code path needs a real sgl_kernel build"
        )

    stub.__name__ = name
    return stub


def __getattr__(name: str):
    if name.endswith("_cpu"):
        fn = _make_stub(name)
        globals()[name] = fn
        return fn
    raise AttributeError(f"module 'sgl_kernel' (CPU dev stub) has no attribute {name!r}")
