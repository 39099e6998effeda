from __future__ import annotations

import contextlib

import pytest

from sglang_cpu_devsupport import kernel_emulator


@pytest.fixture
def emulate(monkeypatch):
    """``with emulate("full", kernels="auto"):`` installs an emulated build for the block only."""

    @contextlib.contextmanager
    def use(build: str, kernels: str = "auto"):
        monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", kernels)
        kernel_emulator.install(build)
        try:
            yield kernel_emulator.CALLS
        finally:
            kernel_emulator.uninstall()

    return use
