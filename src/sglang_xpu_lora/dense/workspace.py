"""Scratch, routes and base-GEMM overlap for the dense tier on any device.

:class:`DeviceLoraWorkspace` is SGLang 0.5.23's ``LoraWorkspace`` (``srt/lora/workspace.py``:
persistent graph scratch grown only outside capture, eager buffers, the per-forward route cache)
with its CUDA-only parts replaced:

* **capture detection** by the device's own backend (``torch.cuda``/``torch.xpu``
  ``is_current_stream_capturing``), so a buffer that would have to grow inside an XPU capture
  raises as it does on CUDA, instead of allocating inside the graph;
* **one key for every stream** (SGLang keys scratch and routes by the caller's raw CUDA stream and
  0 elsewhere). The dense runner forks and joins per linear (A of the next linear waits on an event
  recorded after B of this one), so the caller and its side stream never use one buffer at once,
  and routes built on the side stream are seen by the caller without copying them between streams;
* **overlap** (:meth:`run_parallel`) with ``torch.<device>.Stream`` / ``Event`` on CUDA and XPU
  alike: the side work waits for an event recorded on the caller's stream, runs on a side stream,
  and the caller waits for its ``done`` event after running the base GEMM. On CPU, and inside
  graphs on a device where :func:`fork_join_captures` said no, the side work runs first, in order.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch
from sglang.srt.lora.workspace import LoraWorkspace

from sglang_xpu_lora.providers.graph_capture import capturing

_T = TypeVar("_T")

#: Device types whose streams and events ``torch.<type>`` exposes (``Stream``, ``Event``,
#: ``stream``, ``current_stream``, ``graph``).
STREAM_DEVICES = ("cuda", "xpu")


def fork_join_captures(device: torch.device) -> bool:
    """Whether a fork/join over a side stream (the overlap of :meth:`DeviceLoraWorkspace.run_parallel`)
    can be captured in a graph on ``device`` and replays equal to eager: a trial capture of a tiny
    fork/join, run at graph set-up. False on devices without graphs, and for any error.

    The trial decides because nothing documents it for XPU graphs (PyTorch XPU's Level Zero
    graphs); on CUDA it is known to work (SGLang's ``triton_v2`` captures the same pattern).
    """
    if device.type not in STREAM_DEVICES:
        return False
    gpu = getattr(torch, device.type)
    graph_class = getattr(gpu, "CUDAGraph" if device.type == "cuda" else "XPUGraph", None)
    if graph_class is None:
        return False
    workspace = DeviceLoraWorkspace()
    x = torch.arange(8, dtype=torch.float32, device=device)
    side_out = torch.zeros_like(x)

    def step():
        def side():
            side_out.copy_(x * 2)

        return workspace.run_parallel(name="probe", device=device, compute=lambda: x + 1, side=side) + side_out

    try:
        stream = gpu.Stream(device)
        stream.wait_stream(gpu.current_stream(device))
        with gpu.stream(stream):
            step()
        stream.synchronize()
        graph = graph_class()
        with gpu.graph(graph, stream=stream):
            out = step()
        x.copy_(torch.arange(8, 16, dtype=torch.float32, device=device))
        graph.replay()
        gpu.synchronize(device)
        return bool(torch.equal(out, x * 3 + 1))
    except Exception:  # noqa: BLE001 - any failure means: do not capture the overlap
        return False


class DeviceLoraWorkspace(LoraWorkspace):
    """SGLang's ``LoraWorkspace`` on any device (module docstring).

    :attr:`overlap_in_graphs` (default True): whether :meth:`run_parallel` forks onto a side stream
    while a graph is being captured (:func:`fork_join_captures` decides it per device at graph
    set-up); outside graphs it forks on every device with streams.
    """

    def __init__(self) -> None:
        super().__init__()
        self.overlap_in_graphs = True
        self._side_streams: dict = {}
        self._fork_events: dict = {}

    @staticmethod
    def _capturing(device: torch.device) -> bool:
        return capturing(device)

    @staticmethod
    def _caller(device: torch.device) -> int:
        """One key for every stream (module docstring): SGLang's ``tensor`` and ``route`` key their
        scratch and routes by this."""
        return 0

    def _side_stream(self, device: torch.device, current):
        stream = self._side_streams.get(device)
        if stream is None:
            gpu = getattr(torch, device.type)
            stream = gpu.Stream(device)
            while stream == current:  # a stream pool can hand out the caller's stream
                stream = gpu.Stream(device)
            self._side_streams[device] = stream
        return stream

    def _fork_join_events(self, device: torch.device, name: str):
        events = self._fork_events.get((device, name))
        if events is None:
            gpu = getattr(torch, device.type)
            events = self._fork_events[(device, name)] = (gpu.Event(), gpu.Event())
        return events

    def run_parallel(self, *, name: str, device: torch.device, compute: Callable[[], _T], side: Callable[[], object]) -> _T:
        """``side()`` on a side stream while ``compute()`` runs on the caller's; returns what
        ``compute`` returned, once both are done from the caller stream's point of view. In order
        (side, then compute) on CPU and, unless :attr:`overlap_in_graphs`, inside graphs."""
        device = torch.device(device)
        if device.type not in STREAM_DEVICES or (not self.overlap_in_graphs and capturing(device)):
            side()
            return compute()
        gpu = getattr(torch, device.type)
        current = gpu.current_stream(device)
        side_stream = self._side_stream(device, current)
        ready, done = self._fork_join_events(device, name)
        ready.record(current)
        side_stream.wait_event(ready)
        with gpu.stream(side_stream):
            side()
            done.record(side_stream)
        result = compute()
        current.wait_event(done)
        return result
