"""Fixtures shared by the portable-op tests."""

from __future__ import annotations

import pytest

from sglang_xpu_lora.providers import torch_ops


@pytest.fixture(params=["host", "device"])
def routing(request, monkeypatch):
    """Run the test with the portable ops routed on the host or on the device, forced whatever the
    problem size (both strategies run on CPU tensors)."""
    monkeypatch.setattr(torch_ops, "routes_on_host", lambda x, weights, count_runs: request.param == "host")
    return request.param
