"""The capture probe's logic on CPU (providers/capture_probe.py): the emulated host-syncing build is
rejected and the sync-free build accepted by real trial captures driven through a graph API on CPU
(tests/fake_graphs.py, which refuses host reads while capturing as CUDA does), the fallback and
reason per op, the capture always ended and the current stream always restored, one side stream,
private pools only (a fresh one after a failed capture), verdicts cached, and the overrides.

The same trial on real CUDA graphs: benchmarks/capture_probe.py (results in benchmarks/results)."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

from fake_graphs import HOST_READS, NOT_PERMITTED, FakeGraphs
from sglang_xpu_lora import providers
from sglang_xpu_lora.providers import capture_probe, native, selection, triton_ops
from sglang_xpu_lora.providers.base import OP_NAMES
from sglang_xpu_lora.providers.capture_probe import CaptureProbe, ProbeCase, Verdict

CASE = ProbeCase(torch.device("cpu"), tokens=6, slots=3, max_rank=4, dtype=torch.float32)


@pytest.fixture
def as_on_xpu(monkeypatch):
    """An XPU where Triton runs and the emulated build's kernels are registered for it."""
    monkeypatch.setattr(triton_ops, "triton_support", lambda device: (True, "Triton test backend"))
    monkeypatch.setattr(native, "has_kernel_for_device", lambda kernel, device_type: True)


def probe_build(emulate, build, graphs, device="cpu", case=CASE, probe=None):
    with emulate(build):
        before = providers.choose(device)
        verdicts = (probe or CaptureProbe(graphs)).try_ops(before.graph_candidates, case, native.bind)
        return before, verdicts, providers.choose(device, verdicts)


def test_host_syncing_build_falls_back_to_triton_and_sync_free_build_runs_natively_in_graphs(emulate, as_on_xpu):
    graphs = FakeGraphs()
    before, verdicts, after = probe_build(emulate, "full", graphs, "xpu")
    assert not before.graph_decided and set(before.graph_candidates) == set(OP_NAMES)
    assert {c.provider.name for c in before.graph_choices.values()} == {"triton"}  # untried: not in graphs yet
    assert after.graph_decided
    # Eager: native, except decode's permuted ops, which prefer Triton to host-syncing native ops.
    decode = set(selection.DECODE_OPS)
    assert {op: c.provider.name for op, c in after.choices.items()} == {op: "triton" if op in decode else "native" for op in OP_NAMES}
    assert {op: c.provider.name for op, c in after.graph_choices.items()} == dict.fromkeys(OP_NAMES, "triton")
    for op in OP_NAMES:
        assert not verdicts[op].capture_safe and (op in decode or not after.choices[op].capture_safe)
        assert f"capture failed in a trial fake graph ({CASE.describe()}) (RuntimeError: {NOT_PERMITTED}" in verdicts[op].reason
        assert after.graph_choices[op].reason.startswith(f"native op not run inside graphs: {verdicts[op].reason}; Triton test backend")

    _, verdicts, after = probe_build(emulate, "full-syncfree", FakeGraphs(), "xpu")
    assert all(v.capture_safe and v.reason == f"captured in a trial fake graph ({CASE.describe()}) and replayed equal to eager"
               for v in verdicts.values())
    assert {op: c.provider.name for op, c in after.graph_choices.items()} == dict.fromkeys(OP_NAMES, "native")
    assert {op: c.provider.name for op, c in after.choices.items()} == dict.fromkeys(OP_NAMES, "native")  # sync-free: native eagerly too
    assert after.graph is after.eager or all(getattr(after.graph, op).__qualname__ == f"native.{op}" for op in OP_NAMES)
    assert triton_ops.PROVIDER not in after.providers


def test_on_cpu_a_rejected_op_falls_back_to_the_portable_op(emulate):
    _, verdicts, after = probe_build(emulate, "full", FakeGraphs())
    assert {c.provider.name for c in after.graph_choices.values()} == {"torch"}
    assert "no Triton: " in after.graph_choices["qkv_lora_b_fwd"].reason


def test_a_rejected_shrink_takes_its_expands_to_triton_with_it(emulate, as_on_xpu):
    """The Triton-shrink pairing holds for the rebuilt table: an accepted expand that reads a
    rejected (now Triton) shrink's output runs Triton too."""
    with emulate("full-syncfree"):
        accepted = {op: Verdict(op, True, "accepted") for op in OP_NAMES}
        rejected = {**accepted, "sgemm_lora_a_fwd": Verdict("sgemm_lora_a_fwd", False, "rejected")}
        chosen = providers.choose("xpu", rejected).graph_choices
    assert {op for op, c in chosen.items() if c.provider.name == "triton"} == {
        "sgemm_lora_a_fwd", "sgemm_lora_b_fwd", "qkv_lora_b_fwd", "gate_up_lora_b_fwd", "chunked_sgmv_lora_expand_fwd",
    }
    assert "reads the Triton sgemm_lora_a_fwd output" in chosen["qkv_lora_b_fwd"].reason


def test_every_trial_ends_its_capture_restores_the_stream_and_uses_one_side_stream_and_private_pools(emulate):
    graphs = FakeGraphs()
    shared = graphs.new_pool()  # as SGLang's own graph pool would be
    probe = CaptureProbe(graphs)
    start, host_reads = graphs.current, {name: torch.Tensor.__dict__.get(name) for name in HOST_READS}
    probe_build(emulate, "full", graphs, probe=probe)  # every capture fails
    _, synced_free, _ = probe_build(emulate, "full-syncfree", graphs, case=ProbeCase(CASE.device, 8, 3, 4, torch.float32), probe=probe)
    assert graphs.current is start and graphs.capturing is None
    assert len(graphs.captures) == 2 * len(OP_NAMES) and all(c["ended"] for c in graphs.captures)
    assert graphs.streams == [graphs.captures[0]["stream"]] and {c["stream"] for c in graphs.captures} == set(graphs.streams)
    pools = [c["pool"] for c in graphs.captures]
    assert shared not in pools and set(pools) <= set(graphs.pools)
    # A pool a failed capture recorded into refuses later captures, and one whose graph was released
    # cannot be captured into again: every trial takes a fresh pool and releases it, so the
    # sync-free trials after the failures, and after each other, all capture.
    assert len(set(pools)) == len(pools) and set(pools) <= graphs.released_pools
    assert all(probe_verdict.capture_safe for probe_verdict in synced_free.values())
    assert {name: torch.Tensor.__dict__.get(name) for name in HOST_READS} == host_reads  # capture mode left


def test_an_op_that_freezes_host_values_into_the_capture_is_rejected_by_the_replay_check():
    calls = itertools.count(1)

    def frozen_scale(input_x, **kwargs):  # reads a host value at each call: the capture keeps its value
        return input_x * next(calls)

    verdict = CaptureProbe(FakeGraphs()).try_op("sgemm_lora_a_fwd", frozen_scale, CASE)
    assert not verdict.capture_safe and "differs from eager (largest difference" in verdict.reason


def test_an_op_that_fails_eagerly_is_rejected_without_a_capture():
    graphs = FakeGraphs()

    def broken(**kwargs):
        raise RuntimeError("input_x must be a XPU tensor")

    verdict = CaptureProbe(graphs).try_op("sgemm_lora_a_fwd", broken, CASE)
    assert verdict == Verdict("sgemm_lora_a_fwd", False, "the eager trial call failed (RuntimeError: input_x must be a XPU tensor)", verdict.seconds)
    assert graphs.captures == [] and graphs.current is graphs.default_stream


def test_a_capture_that_cannot_begin_is_a_verdict_and_the_next_trial_takes_a_fresh_pool():
    graphs = FakeGraphs()
    graphs.broken_pools.add(("private pool", 0))  # the probe's first pool refuses to capture
    probe = CaptureProbe(graphs)

    verdict = probe.try_op("sgemm_lora_a_fwd", lambda input_x, **kw: input_x + 1, CASE)
    assert not verdict.capture_safe and "could not begin a trial fake graph" in verdict.reason
    assert "already recording to mempool_id" in verdict.reason
    assert graphs.current is graphs.default_stream and graphs.capturing is None
    assert probe.try_op("sgemm_lora_a_fwd", lambda input_x, **kw: input_x + 1, CASE).capture_safe


def test_verdicts_are_cached_per_op_and_case_and_logged_once(emulate, caplog):
    graphs = FakeGraphs()
    probe = CaptureProbe(graphs)
    with caplog.at_level(logging.INFO, logger="sglang_xpu_lora.providers"):
        probe_build(emulate, "full-syncfree", graphs, probe=probe)
        probe_build(emulate, "full-syncfree", graphs, probe=probe)
        assert len(graphs.captures) == len(OP_NAMES)
        probe_build(emulate, "full-syncfree", graphs, case=ProbeCase(CASE.device, 16, 3, 4, torch.float32), probe=probe)
    assert len(graphs.captures) == 2 * len(OP_NAMES)
    lines = [r.getMessage() for r in caplog.records if "capture probe" in r.getMessage()]
    assert len(lines) == 2 * len(OP_NAMES) and all("runs natively inside graphs" in line for line in lines)


def test_merged_verdicts_keep_an_op_native_only_while_every_trial_passed():
    ok, bad = Verdict("op", True, "decode ok"), Verdict("op", False, "prefill failed")
    assert capture_probe.merge({}, {"op": ok}) == {"op": ok}
    assert capture_probe.merge({"op": ok}, {"op": bad}) == {"op": bad}
    assert capture_probe.merge({"op": bad}, {"op": ok}) == {"op": bad}


def test_without_device_graphs_nothing_is_tried():
    verdict = CaptureProbe().try_op("sgemm_lora_a_fwd", lambda **kw: pytest.fail("called"), CASE)
    assert not verdict.capture_safe
    assert verdict.reason == "not tried: cpu has no device graphs to try a capture in, so the native op stays out of graph batches"
    assert capture_probe.device_graphs("xpu")[0] is None  # no XPU on the test machine: nothing to try either


@pytest.mark.parametrize("value, provider, reason", [
    ("always", "native", "SGLANG_XPU_LORA_GRAPH_NATIVE=always: runs inside graphs untried"),
    ("never", "torch", "native op not run inside graphs: SGLANG_XPU_LORA_GRAPH_NATIVE=never; no Triton"),
])
def test_the_override_decides_without_a_trial(emulate, monkeypatch, value, provider, reason):
    monkeypatch.setenv("SGLANG_XPU_LORA_GRAPH_NATIVE", value)
    with emulate("full"):
        chosen = providers.choose("cpu")
    assert chosen.graph_decided
    assert {c.provider.name for c in chosen.graph_choices.values()} == {provider}
    assert chosen.graph_choices["qkv_lora_b_fwd"].reason.startswith(reason)
    monkeypatch.setenv("SGLANG_XPU_LORA_GRAPH_NATIVE", "sometimes")
    with pytest.raises(ValueError, match="'sometimes' is not one of probe, never, always"):
        providers.choose("cpu")
