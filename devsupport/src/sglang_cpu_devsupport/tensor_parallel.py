"""Tensor parallelism on SGLang 0.5.23's CPU engine: the environment that lets ``--tp-size N`` run.

Stock SGLang fails twice on a CPU-only host at ``--tp-size`` > 1:

- ``distributed/bootstrap.py`` binds each rank's OpenMP threads through
  ``utils/numa_utils.init_threads_binding``, which asserts that the ranks do not outnumber the NUMA
  nodes unless ``SGLANG_CPU_OMP_THREADS_BIND`` names one ``|``-separated core group per rank of
  this host (SGLang indexes the groups by the rank's local device id). Without AMX (or arm64) the
  group is only logged; with them SGLang binds the rank's threads to it.
- ``parallel_state.init_model_parallel_group`` turns PyNccl on for the CPU platform; PyPI's torch
  ships ``libnccl``, so it loads and ``pynccl.py`` raises "Expected a cuda device, but got: cpu".
  Given a library path that does not load, SGLang disables PyNccl itself (``pynccl.py``: one
  logged "Failed to load NCCL library" line per rank) and all-reduces over gloo.

:func:`tp_env` returns both settings for the ranks SGLang starts on this host, from the cores this
process may run on (``os.sched_getaffinity``), and refuses more ranks than cores.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

#: A libnccl path that cannot load, so SGLang disables PyNccl and all-reduces over gloo.
UNLOADABLE_NCCL = "/nonexistent/libnccl.so.2"


def omp_bind_groups(cores: Sequence[int], ranks: int) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND`` for ``ranks`` ranks over ``cores``: the sorted cores split into
    ``ranks`` contiguous groups of near-equal size (the first ``len(cores) % ranks`` one larger),
    each written as comma-separated ranges, joined by ``|`` (``[0, 1, 2, 3], 2`` -> ``"0-1|2-3"``).

    Raises ``ValueError`` when there are fewer cores than ranks (each rank needs one of its own)."""
    cores = sorted(set(cores))
    if ranks < 1 or ranks > len(cores):
        raise ValueError(f"cannot give {ranks} ranks a CPU core each: this process may use {len(cores)} cores {cores}")
    size, larger = divmod(len(cores), ranks)
    groups, start = [], 0
    for rank in range(ranks):
        end = start + size + (rank < larger)
        groups.append(_ranges(cores[start:end]))
        start = end
    return "|".join(groups)


def _ranges(cores: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    spans: list[list[int]] = []
    for core in cores:
        if spans and core == spans[-1][1] + 1:
            spans[-1][1] = core
        else:
            spans.append([core, core])
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in spans)


def tp_env(tp_size: int, nnodes: int = 1, cores: Optional[Sequence[int]] = None) -> dict[str, str]:
    """Environment for SGLang's CPU engine at ``--tp-size tp_size --nnodes nnodes``, for the
    ``tp_size / nnodes`` ranks of this host: one OpenMP core group per rank over ``cores`` (default:
    ``os.sched_getaffinity(0)``) and the PyNccl library path that does not load. Empty at
    ``tp_size`` 1 (SGLang needs neither).

    Raises ``ValueError`` when ``tp_size`` is not a positive multiple of ``nnodes`` or this host's
    ranks outnumber its cores."""
    if tp_size < 1 or nnodes < 1 or tp_size % nnodes:
        raise ValueError(f"--tp-size {tp_size} must be a positive multiple of --nnodes {nnodes}")
    if tp_size == 1:
        return {}
    local_ranks = tp_size // nnodes
    cores = sorted(os.sched_getaffinity(0) if cores is None else cores)
    if local_ranks > len(cores):
        raise ValueError(
            f"--tp-size {tp_size} over {nnodes} host(s) runs {local_ranks} ranks on this host, but this process may "
            f"use only {len(cores)} CPU cores ({_ranges(cores)}): SGLang's CPU engine needs a core per rank; lower "
            f"--tp-size or add hosts (--nnodes)"
        )
    return {"SGLANG_CPU_OMP_THREADS_BIND": omp_bind_groups(cores, local_ranks), "SGLANG_NCCL_SO_PATH": UNLOADABLE_NCCL}
