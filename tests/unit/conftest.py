"""Fixtures shared by the portable-op tests."""

from __future__ import annotations

import pytest

from sglang_xpu_lora.providers import torch_ops
from sglang_xpu_lora.providers.torch_routing import device


@pytest.fixture(params=["host", "device", "device-gathered"])
def routing(request, monkeypatch):
    """Run the test with the portable ops routed on the host or on the device, forced whatever the
    problem size (both strategies run on CPU tensors); on the device in either GEMM form, forced too
    (:func:`device.gathers_rows`): every slot's product (``device``) or each row's own slot weights
    gathered (``device-gathered``). The value is the routing's name."""
    monkeypatch.setattr(torch_ops, "routes_on_host", lambda x, weights, count_runs: request.param == "host")
    gathered = request.param == "device-gathered"
    monkeypatch.setattr(device, "gathers_rows", lambda *shape, **form: gathered)
    return request.param
