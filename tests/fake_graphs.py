"""A device graph API on CPU for the capture probe's tests, with the behaviour measured for CUDA
graphs on an H200 (shared/research findings-2026-12.md section 2):

* capture records every top-level torch op (a ``TorchDispatchMode``) and replay runs them again on
  the same tensors, writing into the tensors the capture returned, as a graph replays its kernels
  on the captured addresses;
* a host read of tensor values while capturing (``.item()``, ``.tolist()``, ``.cpu()``, ``bool()``,
  ...) raises "operation not permitted when stream is capturing" and invalidates the capture:
  ending it raises a second error, and the pool it recorded into refuses every later capture;
* capturing on the stream that was current before (the stand-in for the default stream) is refused;
* a pool whose graph was released (reset, or garbage-collected) cannot be captured into again
  (CUDA's caching allocator asserts ``use_count > 0``).

Everything the probe does with it is recorded for assertions: pools made and captured into,
streams made and made current, captures begun and ended.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")
NOT_PERMITTED = "operation not permitted when stream is capturing"


class FakeStream:
    def __init__(self, name: str):
        self.name, self.waited_on = name, []

    def wait_stream(self, other) -> None:
        self.waited_on.append(other)

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class _Recorder(TorchDispatchMode):
    def __init__(self, ops: list):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        self.ops.append((func, args, kwargs or {}, result))
        return result


class FakeGraph:
    def __init__(self, graphs: "FakeGraphs"):
        self.graphs, self.ops, self.failed, self._saved, self._mode, self.pool = graphs, [], None, {}, None, None

    def reset(self) -> None:
        if self.pool is not None:
            self.graphs.released_pools.add(self.pool)
        self.ops, self.pool = [], None

    def __del__(self):
        self.reset()

    def capture_begin(self, pool=None) -> None:
        graphs = self.graphs
        if graphs.current is graphs.default_stream:
            raise RuntimeError("CUDA graphs must be captured on a non-default stream")
        if pool in graphs.broken_pools:
            raise RuntimeError(f"beginAllocateToPool: already recording to mempool_id {pool}")
        if pool in graphs.released_pools:
            raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED (a released pool)")
        self.pool = pool
        graphs.captures.append({"pool": pool, "stream": graphs.current, "ended": False})
        graphs.capturing = self
        for name in HOST_READS:
            self._saved[name] = torch.Tensor.__dict__.get(name)
            setattr(torch.Tensor, name, self._refuse(name))
        self._mode = _Recorder(self.ops)
        self._mode.__enter__()

    def _refuse(self, name):
        def refused(*args, **kwargs):
            self.failed = name
            raise RuntimeError(f"{NOT_PERMITTED} (Tensor.{name} reads device memory on the host)")

        return refused

    def capture_end(self) -> None:
        graphs = self.graphs
        self._mode.__exit__(None, None, None)
        for name, original in self._saved.items():
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)
        graphs.capturing = None
        graphs.captures[-1]["ended"] = True
        if self.failed:
            graphs.broken_pools.add(graphs.captures[-1]["pool"])
            raise RuntimeError("operation failed due to a previous error during capture")

    def replay(self) -> None:
        assert self.graphs.capturing is None and not self.failed
        with torch.no_grad():
            for func, args, kwargs, captured in self.ops:
                result = func(*args, **kwargs)
                if isinstance(captured, torch.Tensor) and result is not captured:
                    captured.copy_(result)


class FakeGraphs:
    """The :class:`sglang_xpu_lora.providers.capture_probe.DeviceGraphs` interface, on CPU."""

    name = "fake graph"

    def __init__(self):
        self.default_stream = FakeStream("current at start")
        self.current = self.default_stream
        self.streams, self.pools, self.captures, self.broken_pools, self.released_pools = [], [], [], set(), set()
        self.capturing = None

    def new_graph(self) -> FakeGraph:
        return FakeGraph(self)

    def new_pool(self):
        pool = ("private pool", len(self.pools))
        self.pools.append(pool)
        return pool

    def new_stream(self, device) -> FakeStream:
        stream = FakeStream(f"side stream {len(self.streams)}")
        self.streams.append(stream)
        return stream

    def current_stream(self, device) -> FakeStream:
        return self.current

    def set_stream(self, stream) -> None:
        self.current = stream

    def synchronize(self, device) -> None:
        assert self.capturing is None
