"""GPU clocks and power beside a benchmark: ``nvidia-smi`` sampled in the background.

A long prefill batch can hold an H200 at its power cap (about 700 W): the driver then lowers the SM
clock (``clocks_event_reasons.active`` bit ``0x4``, software power cap), and the time of a timed
block depends on what ran just before it. :class:`ClockLog` records the samples to a CSV file, and
:meth:`ClockLog.window` sums up one time window of them, so that a benchmark row can say at which
clock and how much of the time capped it was measured. ``power.draw`` is what ``nvidia-smi``
reports under that name (on recent drivers an average over about a second), so a short window
can carry some of the work before it.

    with ClockLog(Path("layer-cuda-clocks.csv"), enabled=device.type == "cuda") as clocks:
        started = datetime.now()
        ...                                   # the timed work
        ended = datetime.now()
    row.update(clocks.window(started, ended))   # once the log is closed: all samples on disk

Without ``nvidia-smi`` on the PATH (CPU, XPU) or with ``enabled`` False it records nothing and
:meth:`ClockLog.window` returns ``{}``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
from datetime import datetime
from pathlib import Path
from typing import Optional

#: ``nvidia-smi --query-gpu`` fields, in the order :func:`read_samples` parses them.
QUERY = "timestamp,clocks.sm,power.draw,clocks_event_reasons.active"
#: ``clocks_event_reasons.active`` bit of the software power cap (``nvidia-smi -q``: "SW Power Cap").
SW_POWER_CAP = 0x4
#: ``nvidia-smi``'s timestamp, in the machine's local time.
TIMESTAMP = "%Y/%m/%d %H:%M:%S.%f"


def read_samples(path: Path) -> list[tuple[datetime, float, float, int]]:
    """``(local time, SM clock MHz, power W, event-reason bits)`` of each complete sample in
    ``path`` (``nvidia-smi --format=csv,noheader,nounits`` of :data:`QUERY`); lines that do not
    parse (a sample cut short when the log stopped, ``[N/A]``) are skipped."""
    samples = []
    for line in Path(path).read_text().splitlines():
        fields = [f.strip() for f in line.split(",")]
        try:
            samples.append((datetime.strptime(fields[0], TIMESTAMP), float(fields[1]), float(fields[2]), int(fields[3], 16)))
        except (IndexError, ValueError):
            continue
    return samples


#: The columns :func:`summarise` gives a point (the layer benchmark's rows).
CLOCK_COLUMNS = ("sm_mhz", "power_w", "power_capped", "clock_samples")


def summarise(samples: list[tuple[datetime, float, float, int]], start: datetime, end: datetime) -> dict:
    """Of the samples from ``start`` to ``end`` (local times): ``sm_mhz`` the median SM clock (MHz),
    ``power_w`` the largest power draw (W), ``power_capped`` the share of samples at the software
    power cap (0-1), ``clock_samples`` their count; ``{}`` when none falls in the window."""
    inside = [s for s in samples if start <= s[0] <= end]
    if not inside:
        return {}
    return {
        "sm_mhz": statistics.median(s[1] for s in inside),
        "power_w": max(s[2] for s in inside),
        "power_capped": sum(1 for s in inside if s[3] & SW_POWER_CAP) / len(inside),
        "clock_samples": len(inside),
    }


def physical_gpu(index: int) -> str:
    """``nvidia-smi -i``'s name of the process's CUDA device ``index``: its entry in
    ``CUDA_VISIBLE_DEVICES`` (an index or a UUID) where that is set, ``index`` otherwise."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return visible[index] if index < len(visible) else str(index)


class ClockLog:
    """``nvidia-smi`` writing :data:`QUERY` of GPU ``gpu`` (:func:`physical_gpu`) every
    ``interval_ms`` to ``path`` while the context is open (module docstring)."""

    def __init__(self, path: Path, *, enabled: bool = True, gpu: str = "0", interval_ms: int = 50):
        self.path = Path(path)
        self.enabled = enabled and shutil.which("nvidia-smi") is not None
        self.gpu = gpu
        self.interval_ms = interval_ms
        self.process = None
        self._samples: Optional[list] = None

    def __enter__(self) -> "ClockLog":
        if self.enabled:
            self.process = subprocess.Popen(
                ["nvidia-smi", f"--id={self.gpu}", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                 f"--loop-ms={self.interval_ms}", f"--filename={self.path}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
        return self

    def __exit__(self, *exc) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None

    def window(self, start: datetime, end: datetime) -> dict:
        """:func:`summarise` of the samples from ``start`` to ``end`` (local times from
        ``datetime.now()``); ``{}`` when nothing is recorded. Call it after the context closed
        (``nvidia-smi`` may hold samples in its buffer until then); the file is read once."""
        if not self.enabled or not self.path.is_file():
            return {}
        if self._samples is None:
            self._samples = read_samples(self.path)
        return summarise(self._samples, start, end)
