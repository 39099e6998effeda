"""Shared fixtures. SGLang's CPU platform is selected before anything imports SGLang.

``TRITON_INTERPRET=1`` too: Triton decides when a kernel is defined (SGLang's LoRA kernels, at
import) whether it runs in its interpreter, the only way to run them on CPU tensors, as the Triton
provider's tests do. ``auto`` never selects Triton on CPU, so nothing else runs differently.
"""

from __future__ import annotations

import os

from sglang_cpu_devsupport import CPU_ENGINE_ENV

os.environ.update(CPU_ENGINE_ENV)
os.environ.setdefault("TRITON_INTERPRET", "1")

import triton.backends  # noqa: E402,F401 - decorates Triton's own jit helpers for the interpreter now,
# not in a test that unsets TRITON_INTERPRET (interpreted kernels cannot call compiled helpers)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_artifacts(tmp_path_factory):
    """The project's tiny Llama model, tokenizer and PEFT adapters, the embedding/lm_head adapter
    included (built once per session)."""
    from sglang_cpu_devsupport import tiny_model

    adapters = (*tiny_model.DEFAULT_ADAPTERS, tiny_model.EMBEDDING_ADAPTER)
    return tiny_model.build_all(tmp_path_factory.mktemp("tiny"), adapters=adapters)


@pytest.fixture(scope="session")
def sglang_plugins_loaded():
    """Run SGLang's own plugin loading in this process (registers intel_xpu, applies hooks)."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang_xpu_lora import plugin

    assert plugin.host_problems == [], plugin.host_problems


@pytest.fixture
def emulate(monkeypatch):
    """``with emulate("full", kernels="auto") as calls:`` installs an emulated sgl-kernel-xpu build
    for the block only; ``calls`` counts kernel calls."""
    import contextlib

    from sglang_cpu_devsupport import kernel_emulator

    @contextlib.contextmanager
    def use(build: str, kernels: str = "auto"):
        monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", kernels)
        kernel_emulator.install(build)
        try:
            yield kernel_emulator.CALLS
        finally:
            kernel_emulator.uninstall()

    return use
