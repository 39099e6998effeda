"""The development switch for tensor parallelism on SGLang's CPU engine (``devsupport``): one
OpenMP core group per rank of this host, the PyNccl path that does not load, and a clear refusal of
more ranks than cores."""

from __future__ import annotations

import os

import pytest

from sglang_cpu_devsupport import serving, tensor_parallel


@pytest.mark.parametrize(
    "cores, ranks, groups",
    [([0, 1], 2, "0|1"), ([0, 1, 2, 3], 2, "0-1|2-3"), ([0, 1, 2, 3, 4], 2, "0-2|3-4"), ([5, 1, 2, 7], 2, "1-2|5,7"), ([0, 1], 1, "0-1")],
)
def test_omp_bind_groups(cores, ranks, groups):
    assert tensor_parallel.omp_bind_groups(cores, ranks) == groups


def test_tp_env_sets_one_group_per_local_rank():
    assert tensor_parallel.tp_env(1) == {}
    assert tensor_parallel.tp_env(2, cores=[0, 1]) == {
        "SGLANG_CPU_OMP_THREADS_BIND": "0|1", "SGLANG_NCCL_SO_PATH": tensor_parallel.UNLOADABLE_NCCL,
    }
    # Two nodes, one rank each: that rank gets this host's cores (SGLang indexes by local device id).
    assert tensor_parallel.tp_env(2, nnodes=2, cores=[0, 1])["SGLANG_CPU_OMP_THREADS_BIND"] == "0-1"
    assert not os.path.exists(tensor_parallel.UNLOADABLE_NCCL)


def test_cpu_env_refuses_more_ranks_than_cores():
    cores = len(os.sched_getaffinity(0))
    assert serving.cpu_env(tp_size=cores)["SGLANG_CPU_OMP_THREADS_BIND"].count("|") == cores - 1
    refusal = rf"--tp-size {cores + 1} over 1 host\(s\) runs {cores + 1} ranks on this host, but this process may use only {cores} CPU cores"
    with pytest.raises(ValueError, match=refusal):
        serving.cpu_env(tp_size=cores + 1)
    with pytest.raises(ValueError, match="must be a positive multiple of --nnodes 2"):
        serving.cpu_env(tp_size=3, nnodes=2)
