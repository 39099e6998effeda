"""The layer benchmark (benchmarks/layer.py) on CPU: its smoke run (a tiny layer through the paths
that run on CPU: base, SGLang's ``torch_native`` backend, ``intel_xpu``'s portable ops and the
emulated Intel-box build), its model of SGLang's LoRA layers against SGLang's own layer classes,
and its float64 check catching a wrong output. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import types
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.launches
def test_quick_run_through_the_device_script_checks_every_path_against_float64(tmp_path):
    """The quick run, through the script a device call runs (benchmarks/run_layer_gpu.sh, on CPU
    here), twice as two device calls would: each run kept under its label with its own order,
    the second (CONTINUE=1) counting on from the first, both merged, and tarred in the checkout's
    layout; a call that would mix its runs with a label's earlier ones unasked is refused."""
    out, back = tmp_path / "results", tmp_path / "out"
    back.mkdir()
    env = {
        **os.environ, "SGLANG_USE_CPU_ENGINE": "1", "DEVICE": "cpu", "LABEL": "smoke", "LAYER_OUT": str(out),
        "OUT": str(back), "PYTHON": sys.executable, "TRITON_CACHE_DIR": str(tmp_path / "triton-cache"),
        "NO_WHEELS_OK": "1", "WHEELS": str(tmp_path / "no-wheels"),  # not the cp312 wheels of a device carry
    }
    quick = ["--quick", "--calls", "2", "--rounds", "2", "--prefill-calls", "1", "--prefill-rounds", "2"]
    def call(**more):
        return subprocess.run(
            ["bash", "benchmarks/run_layer_gpu.sh", "1", *quick],
            cwd=REPO, env={**env, **more}, capture_output=True, text=True, timeout=300,
        )

    for result in (call(), call(CONTINUE="1")):
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    refused = call()
    assert refused.returncode == 2 and "set CONTINUE=1" in refused.stderr
    kept = [out / "layer-cpu-runs" / f"layer-cpu-smoke-run{i}.json" for i in (1, 2)]
    with tarfile.open(back / "layer-smoke.tar") as tar:
        assert sorted(tar.getnames()) == sorted(
            str(p).lstrip("/") for p in (*kept, *(out / f"layer-cpu.{ext}" for ext in ("json", "md", "png")))
        )
    runs = [json.loads(k.read_text()) for k in kept]
    assert [r["order_offset"] for r in runs] == [1, 2]
    merged = json.loads((out / "layer-cpu.json").read_text())
    assert "runs_of_other_modes" not in merged  # the first merge's points were all measured again
    assert [r["intel_xpu_portable_us"] for r in merged["rows"]] == [
        min(a["intel_xpu_portable_us"], b["intel_xpu_portable_us"]) for a, b in zip(runs[0]["rows"], runs[1]["rows"])
    ]
    data = runs[0]
    paths = ["base", "torch_native", "intel_xpu_portable", "intel_xpu_box"]
    assert data["paths"] == paths and data["points_not_run"] == 0 and not data["backend_failures"]
    assert [(r["mode"], r["adapters"]) for r in data["rows"]] == [
        ("eager", 4),
        ("prefill", 1),
        ("eager", 0),
    ]
    for row in data["rows"]:
        assert not [k for k in row if k.endswith("_failed")], row
        for path in paths:
            assert row[f"{path}_us"] > 0 and row[f"{path}_error"] < 1e-4, (path, row)
        for path in paths[1:]:
            assert row[f"{path}_overhead_us"] == pytest.approx(row[f"{path}_us"] - row["base_us"])
    # The emulated build's native ops ran outside graphs (its CPU kernels), portable ops elsewhere.
    assert data["intel_xpu_providers"]["intel_xpu_box"]["sgemm_lora_a_fwd"] == "native / torch"
    assert data["intel_xpu_providers"]["intel_xpu_portable"]["sgemm_lora_a_fwd"] == "torch / torch"
    # Neither selection gives a linear to SGLang's Triton kernels: no dense tier, no plan table read.
    assert data["intel_xpu_dense"] == {"intel_xpu_portable": None, "intel_xpu_box": None}
    assert (out / "layer-cpu.md").read_text().count("\n") >= 5


class Recorder:
    """A backend that records the calls a layer makes (and returns its base output)."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return kwargs.get("base_output", "lora_a_output")

        return call


@pytest.mark.parametrize("kind", ["qkv", "gate_up", "o", "down"])
def test_lora_linear_calls_the_backend_as_sglangs_layers_do(kind):
    """``LoraLinear.apply_lora`` makes exactly the backend calls of SGLang's own layer class for
    the kind (its ``apply_lora`` run on the benchmark's layer object)."""
    from sglang.srt.lora import layers

    from benchmarks.layer import LoraLinear

    cls = {
        "qkv": layers.QKVParallelLinearWithLoRA,
        "gate_up": layers.MergedColumnParallelLinearWithLoRA,
        "o": layers.RowParallelLinearWithLoRA,
        "down": layers.RowParallelLinearWithLoRA,
    }[kind]
    outs = {"qkv": (8, 4, 4), "gate_up": (6, 6), "o": (5,), "down": (5,)}[kind]
    rank = 2
    a, b = torch.zeros(3, len(outs) * rank, 7), torch.zeros(3, sum(outs), rank)
    x, base = torch.zeros(4, 7), torch.zeros(4, sum(outs))
    ours, theirs = Recorder(), Recorder()
    layer = LoraLinear(kind, torch.zeros(sum(outs), 7), a, b, outs, ours)
    layer.apply_lora(base, x)
    layer.lora_backend = theirs
    if hasattr(cls, "_get_lora_n_slices"):  # the merged layer counts its slices from the buffers
        layer._get_lora_n_slices = types.MethodType(cls._get_lora_n_slices, layer)
    cls.apply_lora(layer, base, x)
    assert [name for name, _, _ in ours.calls] == [name for name, _, _ in theirs.calls]
    for (_, args1, kw1), (_, args2, kw2) in zip(ours.calls, theirs.calls):
        assert all(x1 is x2 for x1, x2 in zip(args1, args2)) and len(args1) == len(args2)
        assert kw1.keys() == kw2.keys() and all(kw1[k] is kw2[k] for k in kw1), (kw1, kw2)


def test_the_float64_check_fails_a_path_that_drops_the_lora():
    """A point whose output misses the LoRA term (the reference of the adapters' batch against a
    path that ran as if no adapter were active) is failed, not timed as a pass."""
    from benchmarks import layer as bench

    args = types.SimpleNamespace(
        tolerance=None,
        calls=1,
        rounds=1,
        prefill_calls=1,
        prefill_rounds=1,
        emulated_build=None,
        modes=["eager"],
    )
    device = torch.device("cpu")
    server = bench.Server(bench.TINY, 16, ["base", "torch_native"], torch.float32, device, args)
    case = bench.Case(bench.TINY, 16, 4, 8, "decode", torch.float32, device, real_rank=16)
    with_lora = bench.reference(server, case, adapters=4)
    good = bench.measure_path(server, "torch_native", case, "eager", 4, with_lora, args)
    assert "torch_native_failed" not in good and good["torch_native_error"] < 1e-4
    dropped = bench.measure_path(server, "torch_native", case, "eager", 0, with_lora, args)
    assert (
        bench.measure_path(server, "base", case, "eager", 4, with_lora, args)["base_error"] < 1e-4
    )
    assert dropped["torch_native_error"] > 1e-3
    assert "over tolerance" in dropped["torch_native_failed"]


def test_triton_v2_routes_long_batches_without_the_jit_alignment_kernel(monkeypatch):
    """Past 512 tokens (8 slots) SGLang's dense runner calls its CUDA JIT alignment kernel, which the GPU
    carry does not hold; the benchmark's ``triton_v2`` builds that route with SGLang's pure-Triton
    builder instead, the route ``intel_xpu``'s dense tier builds (same tensors)."""
    from sglang.kernels.ops.lora.common import routing
    from sglang.srt.lora.dense.runner import DenseLoraRunner
    from sglang.srt.lora.utils import Phase

    from benchmarks.layer import route_large_batches_in_triton
    from sglang_xpu_lora.dense.runner import DeviceDenseRunner
    from sglang_xpu_lora.dense.workspace import DeviceLoraWorkspace

    jit_calls = []

    def jit_alignment(*args, **kwargs):
        jit_calls.append(args)
        raise RuntimeError("the CUDA JIT alignment kernel")

    monkeypatch.setattr(routing, "_align_block_size_jit", jit_alignment)
    cpu = torch.device("cpu")
    slots = torch.tensor([1] * 300 + [-1] * 50 + [3] * 250 + [2] * 10, dtype=torch.int32)

    def bound(runner):
        runner.begin_batch(
            token_slots=slots, lora_ranks=torch.tensor([0, 4, 4, 4, 0, 0, 0, 0], dtype=torch.int32),
            scalings=torch.ones(8), num_tokens=slots.numel(), phase=Phase.PREFILL, graph_mode=False,
        )
        return runner

    sglang_runner = bound(DenseLoraRunner(DeviceLoraWorkspace(), max_loras=8, device=cpu, architecture="default"))
    with pytest.raises(RuntimeError, match="JIT alignment"):
        sglang_runner.route(16)
    assert len(jit_calls) == 1
    route_large_batches_in_triton(sglang_runner)
    theirs = sglang_runner.route(16)
    ours = bound(DeviceDenseRunner(DeviceLoraWorkspace(), max_loras=8, device=cpu, architecture="default")).route(16)
    assert len(jit_calls) == 1
    padded = int(ours.maybe_num_pairs_post_padded.reshape(-1)[0])
    assert int(theirs.maybe_num_pairs_post_padded.reshape(-1)[0]) == padded
    torch.testing.assert_close(theirs.maybe_sorted_pair_ids[:padded], ours.maybe_sorted_pair_ids[:padded])
    torch.testing.assert_close(theirs.maybe_block_bucket_ids, ours.maybe_block_bucket_ids)
    # a route at all: every row once, past the block padding
    pairs = theirs.maybe_sorted_pair_ids[:padded]
    assert sorted(pairs[pairs < slots.numel()].tolist()) == list(range(slots.numel()))


def test_paths_of_a_point_are_timed_in_turn_each_in_every_place_and_after_every_other():
    """A drift of the device's speed over a point must fall on every path alike: each round times
    every path once, each path holds each place equally often and follows each other path equally
    often (at the power cap a block after a slow, low-power one starts at a higher clock; with the
    order only rotated, a path would always follow the same one)."""
    import collections

    from benchmarks.common import interleaved_replay_times

    for names in ("ab", "abc", "abcd", "abcde"):
        order = []
        fns = {name: (lambda name=name: order.append(name)) for name in names}
        times = interleaved_replay_times(fns, torch.device("cpu"), calls=2, rounds=2)
        n = len(names)
        assert order[:n] == list(names)  # one untimed call each
        blocks = order[n::2]
        assert order[n:] == [name for name in blocks for _ in range(2)]  # calls back to back
        rounds = [blocks[i:i + n] for i in range(0, len(blocks), n)]
        assert len(rounds) == (n if n % 2 == 0 else 2 * n)  # 2 asked: rounded up to a whole design
        assert all(sorted(r) == list(names) for r in rounds)
        places = collections.Counter((name, place) for r in rounds for place, name in enumerate(r))
        after = collections.Counter(pair for r in rounds for pair in zip(r, r[1:]))
        assert set(places.values()) == {len(rounds) // n} and len(places) == n * n
        assert set(after.values()) == {len(rounds) // n} and len(after) == n * (n - 1)
        assert set(times) == set(names) and all(seconds > 0 for seconds, _ in times.values())
    # Rotating the order would have given "c" after "b" in every round: the design does not.
    order = []
    interleaved_replay_times({n: (lambda n=n: order.append(n)) for n in "abc"}, torch.device("cpu"), calls=1, rounds=3)
    assert {tuple(order[3 + i:6 + i]) for i in range(0, 18, 3)} >= {("a", "b", "c"), ("c", "b", "a")}


def test_a_point_measures_its_paths_together_and_fails_only_the_wrong_one():
    import benchmarks.layer as bench

    args = types.SimpleNamespace(
        tolerance=None, calls=1, rounds=2, prefill_calls=1, prefill_rounds=1, emulated_build=None, modes=["eager"]
    )
    device = torch.device("cpu")
    server = bench.Server(bench.TINY, 16, ["base", "torch_native"], torch.float32, device, args)
    case = bench.Case(bench.TINY, 16, 4, 8, "decode", torch.float32, device, real_rank=16)
    with_lora = bench.reference(server, case, adapters=4)
    row = bench.measure_point(server, ["torch_native", "base", "triton"], case, "eager", 4, with_lora, args)
    assert row["torch_native_error"] < 1e-4 and "torch_native_failed" not in row
    assert row["base_error"] < 1e-4 and row["base_us"] > 0
    assert row["triton_failed"] == "not built"
    assert row["timed_from"] < row["timed_to"]  # the window the point's clocks cover (ISO local times)


def test_layer_profile_splits_kernels_into_calls_and_drops_the_first():
    from benchmarks.layer_profile import per_call

    # three calls of two kernels each, 100 us apart; the first call is slower (dropped)
    spans = [(0, 50, "gemm"), (50, 70, "lora"), (100, 130, "gemm"), (130, 140, "lora"), (200, 230, "gemm"), (230, 240, "lora")]
    got = per_call(spans, 3)
    assert got["period_us"] == 100
    assert got["kernel_us"] == 40
    assert got["kernels"] == {"gemm": {"launches": 1, "us": 30}, "lora": {"launches": 1, "us": 10}}
    with pytest.raises(ValueError, match="do not split"):
        per_call(spans[:5], 3)
    with pytest.raises(ValueError, match="do not split"):
        per_call([], 3)


def test_clock_log_summarises_the_samples_of_a_points_window(tmp_path):
    """A point's clocks come from the samples inside its window only; a cut-short last line and
    ``[N/A]`` fields are skipped, and no samples (no ``nvidia-smi``) give no columns."""
    from datetime import datetime

    from benchmarks.clock_log import ClockLog, read_samples, summarise

    log = tmp_path / "clocks.csv"
    log.write_text(
        "2026/12/04 19:14:26.207, 1980, 240.48, 0x0000000000000000\n"
        "2026/12/04 19:14:26.257, 1560, 690.10, 0x0000000000000004\n"
        "2026/12/04 19:14:26.307, 1200, 698.53, 0x0000000000000004\n"
        "2026/12/04 19:14:26.358, [N/A], 700.00, 0x0000000000000004\n"
        "2026/12/04 19:14:29.000, 345, 79.3, 0x0000000000000001\n"
        "2026/12/04 19:14:29.05"
    )
    samples = read_samples(log)
    assert len(samples) == 4
    window = summarise(samples, datetime(2026, 12, 4, 19, 14, 26, 200000), datetime(2026, 12, 4, 19, 14, 26, 400000))
    assert window == {"sm_mhz": 1560, "power_w": 698.53, "power_capped": 2 / 3, "clock_samples": 3}
    assert summarise(samples, datetime(2026, 12, 4, 19, 15), datetime(2026, 12, 4, 19, 16)) == {}
    with ClockLog(tmp_path / "none.csv", enabled=False) as clocks:
        pass
    assert clocks.window(datetime(2026, 1, 1), datetime(2027, 1, 1)) == {}


def test_clock_log_runs_nvidia_smi_on_the_devices_gpu_and_reads_its_samples_after_closing(tmp_path, monkeypatch):
    """The command line ``ClockLog`` starts (the GPU by ``-i``, the query, the loop, the file) and
    a window read after the log closed, through a stand-in ``nvidia-smi`` on the PATH that writes
    samples as the real one does. ``CUDA_VISIBLE_DEVICES`` maps the process's device to the GPU."""
    import sys
    import time
    from datetime import datetime

    from benchmarks.clock_log import QUERY, ClockLog, physical_gpu

    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import sys, time, datetime\n"
        f"open({str(tmp_path / 'argv')!r}, 'w').write(' '.join(sys.argv[1:]))\n"
        "out = next(a.split('=', 1)[1] for a in sys.argv if a.startswith('--filename='))\n"
        "with open(out, 'w') as f:\n"
        "    while True:\n"
        "        f.write(datetime.datetime.now().strftime('%Y/%m/%d %H:%M:%S.%f')[:-3] + ', 1500, 690.5, 0x0000000000000004\\n')\n"
        "        f.flush()\n"
        "        time.sleep(0.02)\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert physical_gpu(1) == "5" and physical_gpu(0) == "3"
    with ClockLog(tmp_path / "clocks.csv", gpu=physical_gpu(1)) as clocks:
        deadline = time.monotonic() + 30
        while not (tmp_path / "clocks.csv").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        start = datetime.now()
        time.sleep(0.3)
        end = datetime.now()
    assert (tmp_path / "argv").read_text().split() == [
        "--id=5", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "--loop-ms=50", f"--filename={tmp_path / 'clocks.csv'}"
    ]
    window = clocks.window(start, end)
    assert window["sm_mhz"] == 1500 and window["power_w"] == 690.5 and window["power_capped"] == 1.0
    assert 5 <= window["clock_samples"] <= 20


def test_best_of_keeps_the_fastest_time_per_path_and_each_runs_clocks():
    """``--best-of`` merges runs point by point: per path the fastest run's time, the runs' spread,
    and the clocks of every run in order (None for a run without them), not one run's clocks
    beside another run's times."""
    from benchmarks.layer import best_of_runs

    point = dict(model="m", mode="graph", max_rank=16, rank=16, adapters=8, tokens=1)

    def row(base, xpu, **clocks):
        return {**point, "base_us": base, "base_spread": 0.01, "base_error": 0.0,
                "intel_xpu_us": xpu, "intel_xpu_spread": 0.02, "intel_xpu_error": 1e-3, **clocks}

    runs = [
        {"rows": [row(100.0, 130.0, sm_mhz=1980.0, power_w=300.0, power_capped=0.0, clock_samples=4)]},
        {"rows": [row(98.0, 135.0)]},
        {"rows": [row(99.0, 120.0, sm_mhz=1500.0, power_w=699.0, power_capped=0.9, clock_samples=5)]},
    ]
    (merged,) = best_of_runs(runs)
    assert (merged["base_us"], merged["intel_xpu_us"]) == (98.0, 120.0)
    assert merged["intel_xpu_runs_spread"] == pytest.approx(15 / 120)
    assert merged["sm_mhz_runs"] == [1980.0, None, 1500.0] and merged["power_capped_runs"] == [0.0, None, 0.9]
    assert "sm_mhz" not in merged


def test_a_merge_states_how_each_modes_figures_were_timed(tmp_path):
    """A merge keeps each mode's calls x rounds and order of paths: the runs' for the modes they
    measured, the earlier result's for the modes it keeps, so the report's header names the
    settings behind every figure (a prefill run of 40 decode calls does not relabel graph figures
    timed with 30). Runs of different modes merge; two runs timing one mode differently do not; a
    merge from before the record says its modes' settings are not recorded rather than guess."""
    from benchmarks.layer import main
    from benchmarks.report import layer as layer_report

    def result(mode, calls=30, rounds=5, prefill_rounds=3, **more):
        row = dict(model="m", mode=mode, max_rank=16, rank=16, adapters=8, tokens=1, base_us=100.0,
                   base_spread=0.01, base_error=0.0, intel_xpu_us=120.0, intel_xpu_spread=0.01, intel_xpu_error=1e-3)
        return {"machine": {"date": "d", "torch": "2", "python": "3", "cpu": "x86_64", "cpu_count": 2}, "calls": calls,
                "rounds": rounds, "prefill_calls": 8, "prefill_rounds": prefill_rounds, "rows": [row], **more}

    def write(name, data):
        (tmp_path / name).write_text(json.dumps(data))
        return str(tmp_path / name)

    def merge(out, *runs, keep=None):
        main(["--device", "cpu", "--out", str(tmp_path / out), "--best-of", *runs,
              *(["--keep-other-modes", keep] if keep else [])])
        return json.loads((tmp_path / out / "layer-cpu.json").read_text())

    graph, eager = write("graph.json", result("graph", order="williams")), write("eager.json", result("eager"))
    earlier = merge("earlier", graph, eager)  # runs of different modes: each mode its own settings
    assert earlier["timing_by_mode"] == {"graph": {"calls": 30, "rounds": 5, "order": "williams"},
                                         "eager": {"calls": 30, "rounds": 5, "order": "rotated"}}
    runs = [write(f"prefill{i}.json", result("prefill", calls=40, order="williams")) for i in (1, 2)]
    merged = merge("merged", *runs, keep=str(tmp_path / "earlier" / "layer-cpu.json"))
    assert merged["timing_by_mode"] == {"prefill": {"calls": 8, "rounds": 3, "order": "williams"}, **earlier["timing_by_mode"]}
    header = layer_report(merged).split("\n")[0]
    assert "graph 30 x 5 (williams order)" in header and "prefill 8 x 3" in header and "40" not in header

    unlike = write("prefill3.json", result("prefill", calls=40, prefill_rounds=5, order="williams"))
    with pytest.raises(SystemExit):
        merge("refused", runs[0], unlike)
    old_merge = {**json.loads((tmp_path / "earlier" / "layer-cpu.json").read_text()), "runs": ["d", "d"]}
    del old_merge["timing_by_mode"]
    kept = merge("onto-an-old-merge", *runs, keep=write("old-merge.json", old_merge))
    assert kept["timing_by_mode"]["graph"] is None and "graph not recorded" in layer_report(kept)
