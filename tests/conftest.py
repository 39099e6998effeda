"""Shared fixtures. SGLang's CPU platform is selected before anything imports SGLang."""

from __future__ import annotations

import os

from sglang_cpu_devsupport import CPU_ENGINE_ENV

os.environ.update(CPU_ENGINE_ENV)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_artifacts(tmp_path_factory):
    """The project's tiny Llama model, tokenizer and PEFT adapters (built once per session)."""
    from sglang_cpu_devsupport import tiny_model

    return tiny_model.build_all(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def sglang_plugins_loaded():
    """Run SGLang's own plugin loading in this process (registers intel_xpu, applies hooks)."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang_xpu_lora import plugin

    assert plugin.host_problems == [], plugin.host_problems
