"""Tensor parallelism through SGLang's real engine on CPU: ``--tp-size 2`` with ``sglang.Engine``, with
``sglang serve``, and as a two-node launch (``--nnodes 2``), serving adapters through ``intel_xpu``
against transformers + PEFT.

The bar is the TP 1 tests' (``test_engine_parity.py``, ``test_correctness_matrix.py``): float32,
first-token log-probs over the whole vocabulary within 1e-4 and 16 identical greedy tokens. The
two ranks split every layer (q/k/v, gate/up and lm_head LoRA-B, o/down LoRA-A sliced; the rest
replicated) and all-reduce over gloo (``sglang_cpu_devsupport.tensor_parallel``).

* Engine, portable provider and the emulated full sgl-kernel-xpu build (one engine each): a mixed
  batch of the base model and four adapters (ranks 4/8/16 and the embedding + lm_head adapter, all
  below ``--max-lora-rank 32``); adapters loaded between batches so that 7 tenants pass through
  5 slots (evictions, slots reused by adapters of other target modules); an unload. Then each
  rank's pool slots are compared with the slice of the PEFT tensors that rank must hold, and the
  comparison is shown to fail with the two ranks' snapshots swapped.
* ``sglang serve``: the mixed batch over HTTP; an unload and a load of other weights under the name
  while requests stream in; a tenant whose slot holds NaN on rank 1 only
  (``sglang_cpu_devsupport.slot_poison``) next to a batch of other tenants, resident and unloaded.
* Two nodes: ``sglang serve --nnodes 2 --node-rank 0|1 --dist-init-addr 127.0.0.1:<port>`` as two
  process trees on this host, one rank each, forming one TP 2 server: the mixed batch over HTTP and
  each rank's slice.

Every engine and server start costs real time on 2 cores, so the scenarios share four starts.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sglang_cpu_devsupport import kernel_emulator, pool_snapshot, serving, slot_poison, tiny_model
from sglang_xpu_lora import __version__

pytestmark = pytest.mark.e2e

TP = 2
MAX_RANK = 32
LOGPROB_TOLERANCE = 1e-4
P0, P1, P2 = "def main(self):", "import os\nfor path in", "class Foo(object):\n    def"
EMB = tiny_model.EMBEDDING_ADAPTER.name
ADAPTERS = [*tiny_model.ADAPTER_NAMES, EMB]  # sql-r8, doc-r16, qv-r4, emb-head-r8
PROVIDERS = {
    "portable": {"SGLANG_XPU_LORA_KERNELS": "torch"},
    "native": {"SGLANG_XPU_LORA_KERNELS": "native", kernel_emulator.BUILD_ENV: "full"},
    # The dense tier for every batch's linears: one collective of base + LoRA per row-parallel linear;
    # decode batches on the fused per-row kernel (gate_up beside the GEMM, the others after it:
    # fused_decode.plans.json), prefill on SGLang's plans.
    "dense": {
        "SGLANG_XPU_LORA_KERNELS": "triton", "TRITON_INTERPRET": "1", "SGLANG_XPU_LORA_EAGER_DENSE_MIN_TOKENS": "1",
        "SGLANG_XPU_LORA_PLANS": str(Path(__file__).with_name("fused_decode.plans.json")),
    },
}
#: Every op of the emulated full build that this model's adapters use, the embedding's included.
FULL_BUILD_OPS = {
    "embedding_lora_a_fwd", "sgemm_lora_a_fwd", "sgemm_lora_b_fwd", "qkv_lora_b_fwd", "gate_up_lora_b_fwd",
    "chunked_sgmv_lora_shrink_fwd", "chunked_sgmv_lora_expand_fwd",
}
MIXED = [(prompt, lora) for prompt in (P0, P1) for lora in (None, *ADAPTERS)]
#: Served name -> the adapter directory whose weights it serves (names loaded at run time).
WEIGHTS = {**{name: name for name in ADAPTERS}, "late-qv": "qv-r4", "late-doc": "doc-r16"}
#: The engine's rounds, ``--max-loras-per-batch 5``: the mixed batch fills the 5 slots (base + 4);
#: two more names make 7 tenants, so each later batch evicts and reuses slots (late-qv, q/v only,
#: lands in a slot that held an all-module adapter; adapters come back into other tenants' slots).
ENGINE_ROUNDS = [
    MIXED,
    {"load": {"lora_name": "late-qv", "lora_path": "qv-r4"}},
    {"load": {"lora_name": "late-doc", "lora_path": "doc-r16"}},
    [(P0, "late-doc"), (P1, "late-qv"), (P2, None)],
    [(P2, EMB), (P0, "sql-r8"), (P1, "qv-r4")],
    {"unload": {"lora_name": "qv-r4"}},
    [(P1, "late-qv"), (P0, "late-doc"), (P2, "sql-r8")],
    [(P0, EMB), (P1, "doc-r16"), (P2, "sql-r8")],
]
PARAMS = {"temperature": 0.0, "max_new_tokens": serving.GREEDY_TOKENS, "ignore_eos": True}


def assert_matches_reference(outputs, hf_reference):
    for (prompt, lora), out in outputs.items():
        ref_logprobs, ref_tokens = hf_reference(prompt, WEIGHTS.get(lora))
        got = torch.tensor(out["first_logprobs"], dtype=torch.float64)
        delta = float((got - ref_logprobs).abs().max())
        assert delta <= LOGPROB_TOLERANCE, f"{lora or 'base'} on {prompt[:20]!r}: max |Δ logprob| {delta:.2e}"
        assert out["output_ids"] == ref_tokens, f"{lora or 'base'} on {prompt[:20]!r}"


# Each rank's slice of an adapter, written out from the Llama layout (not from SGLang's slicing
# code): q/k/v, gate/up and lm_head LoRA-B are split by output rows (q by heads, k/v by kv heads,
# lm_head by vocabulary), o/down LoRA-A by input columns; every other tensor is whole on each rank.
# Stacked LoRA-A slices sit at rows p * max_lora_rank (the pool patch), rank tails are zero.
STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
ROW_PARALLEL = {"o_proj": "self_attn", "down_proj": "mlp"}


def peft_tensors(adapter_dir) -> dict:
    """``(module path, "A" | "B") -> tensor`` of a PEFT adapter, module paths without PEFT's prefix
    (``model.layers.0.self_attn.q_proj``, ``model.embed_tokens``, ``lm_head``)."""
    tensors = {}
    for key, tensor in load_file(adapter_dir / "adapter_model.safetensors").items():
        for marker, kind in ((".lora_A.weight", "A"), (".lora_B.weight", "B"), (".lora_embedding_A", "A"), (".lora_embedding_B", "B")):
            if key.endswith(marker):
                tensors[(key.removeprefix("base_model.model.").removesuffix(marker), kind)] = tensor
    return tensors


def rank_share(tensor, dim: int, rank: int):
    """The ``rank``-th of TP equal parts of ``tensor`` along ``dim``."""
    return tensor.chunk(TP, dim=dim)[rank]


def out_features(base_dir) -> dict:
    """Output features of each projection of the base model (its ``config.json``)."""
    config = json.loads((base_dir / "config.json").read_text())
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    return {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": config["intermediate_size"], "up_proj": config["intermediate_size"]}


def expected_slots(adapter_dir, base_dir, rank: int, shapes: dict) -> dict:
    """What TP rank ``rank``'s pool slot must hold for the adapter at ``adapter_dir``, keyed and
    shaped like a ``pool_snapshot`` file's entries (``shapes``: key -> slot shape)."""
    peft, outs = peft_tensors(adapter_dir), out_features(base_dir)
    name, expected = adapter_dir.name, {}

    def place(key, block, rows=0):
        slot = expected.setdefault(key, torch.zeros(shapes[key]))
        slot[rows:rows + block.shape[0], :block.shape[1]] = block

    layers = sorted({int(path.split(".")[2]) for path, _ in peft if path.startswith("model.layers.")})
    for layer in layers:
        for fused, parts in STACKED.items():
            paths = [f"model.layers.{layer}.{'self_attn' if fused == 'qkv_proj' else 'mlp'}.{part}" for part in parts]
            if not any((path, "A") in peft for path in paths):
                continue
            lora_rank = next(peft[(path, "A")].shape[0] for path in paths if (path, "A") in peft)
            for p, path in enumerate(paths):
                if (path, "A") in peft:
                    place(f"{name}/{fused}/{layer}/A", peft[(path, "A")], rows=p * lora_rank)  # SGLang's packed layout
            shares = [rank_share(peft[(path, "B")], 0, rank) if (path, "B") in peft else torch.zeros(outs[part] // TP, lora_rank)
                      for part, path in zip(parts, paths)]
            place(f"{name}/{fused}/{layer}/B", torch.cat(shares))
        for module, group in ROW_PARALLEL.items():
            path = f"model.layers.{layer}.{group}.{module}"
            if (path, "A") in peft:
                place(f"{name}/{module}/{layer}/A", rank_share(peft[(path, "A")], 1, rank))
                place(f"{name}/{module}/{layer}/B", peft[(path, "B")])
    if ("model.embed_tokens", "A") in peft:
        place(f"{name}/embed_tokens/A", peft[("model.embed_tokens", "A")])
        place(f"{name}/embed_tokens/B", peft[("model.embed_tokens", "B")])
    if ("lm_head", "A") in peft:
        place(f"{name}/lm_head/A", peft[("lm_head", "A")])
        place(f"{name}/lm_head/B", rank_share(peft[("lm_head", "B")], 0, rank))
    return expected


def slice_mismatches(snapshots: dict, tiny_artifacts, live_only: bool = False) -> list[str]:
    """Every pool entry of every rank (``snapshots``: rank -> ``pool_snapshot`` file contents) that
    differs from :func:`expected_slots`, and every expected entry that is missing. ``live_only``:
    compare only where the expected slice is nonzero (a pool whose slots are not zeroed before a
    load keeps what the slot's previous adapter left past the new adapter's rank)."""
    mismatches = []
    for rank, snapshot in snapshots.items():
        shapes = {key: tuple(tensor.shape) for key, tensor in snapshot.items()}
        for name in sorted({key.split("/")[0] for key in snapshot}):
            expected = expected_slots(tiny_artifacts[name], tiny_artifacts["base"], rank, shapes)
            for key, tensor in snapshot.items():
                if not key.startswith(name + "/"):
                    continue
                want = expected.pop(key, torch.zeros(tensor.shape))  # modules the adapter lacks are empty
                got = tensor.float()
                if live_only and got.shape == want.shape:
                    got, want = got[want != 0], want[want != 0]
                if not torch.equal(got, want):
                    mismatches.append(f"rank {rank} {key}: max |Δ| {float((got - want).abs().max()) if got.shape == want.shape else 'shape'}")
            mismatches += [f"rank {rank} {key}: missing" for key in expected]
    return mismatches


def read_snapshots(directory) -> dict:
    return {rank: load_file(directory / f"rank{rank}.safetensors") for rank in range(TP)}


def assert_each_rank_holds_its_slice(snapshots, tiny_artifacts, must_hold, live_only=False):
    """Both ranks hold the same adapters, ``must_hold`` among them, and each rank's slots equal its
    slices of the PEFT tensors (``live_only``: :func:`slice_mismatches`); with the two ranks'
    snapshots swapped the check fails for every adapter (so it tells the ranks apart)."""
    resident = {key.split("/")[0] for key in snapshots[0]}
    assert resident == {key.split("/")[0] for key in snapshots[1]} and resident >= set(must_hold), resident
    assert slice_mismatches(snapshots, tiny_artifacts, live_only) == []
    swapped = slice_mismatches({0: snapshots[1], 1: snapshots[0]}, tiny_artifacts, live_only)
    assert {line.split()[2].split("/")[0] for line in swapped} == resident, swapped


@pytest.fixture(scope="module", params=list(PROVIDERS))
def engine_run(request, run_engine, tiny_artifacts, tmp_path_factory):
    """The engine's rounds at TP 2 for one provider, and each rank's pool at the end."""
    snapshots = tmp_path_factory.mktemp(f"pool-{request.param}")
    rounds = [
        {"load": {**batch["load"], "lora_path": str(tiny_artifacts[batch["load"]["lora_path"]])}}
        if isinstance(batch, dict) and "load" in batch else batch
        for batch in ENGINE_ROUNDS
    ]
    results, kernels = run_engine(
        f"tp2-{request.param}", rounds, {**PROVIDERS[request.param], pool_snapshot.SNAPSHOT_ENV: str(snapshots)},
        engine={"max_loras_per_batch": 5, "max_lora_rank": MAX_RANK}, adapters=ADAPTERS, tp_size=TP,
    )
    return request.param, results, kernels, read_snapshots(snapshots)


def test_engine_batches_match_transformers_peft(engine_run, hf_reference):
    """The mixed batch and every batch after the loads, evictions and the unload."""
    _, results, _, _ = engine_run
    actions = [result for batch, result in zip(ENGINE_ROUNDS, results) if isinstance(batch, dict)]
    assert all(action["success"] for action in actions), actions
    for batch, outputs in zip(ENGINE_ROUNDS, results):
        if not isinstance(batch, dict):
            assert_matches_reference(outputs, hf_reference)


def test_engine_ops_ran_on_the_expected_provider(engine_run):
    provider, _, kernels, _ = engine_run
    assert kernels == (FULL_BUILD_OPS if provider == "native" else set())


def test_engine_ranks_hold_their_slices(engine_run, tiny_artifacts):
    """After the last batch, whose adapters (embedding and lm_head LoRA, rank 16, rank 8) are resident.
    With SGLang's Triton kernels alone (``dense``) the plugin does not zero slots before a load (the
    kernels read only each slot's real rank), so there only the adapters' own entries are compared."""
    provider, _, _, snapshots = engine_run
    assert_each_rank_holds_its_slice(snapshots, tiny_artifacts, {EMB, "doc-r16", "sql-r8"}, live_only=provider == "dense")


def generate(url, tokenizer, prompt, lora):
    return serving.post_json(f"{url}/generate", {"input_ids": tokenizer.encode(prompt), "lora_path": lora, "sampling_params": PARAMS})


def generate_all(url, tokenizer, requests) -> dict:
    """``(prompt, lora) -> output ids`` for ``requests`` sent concurrently (decoded together)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(requests)) as pool:
        futures = {key: pool.submit(generate, url, tokenizer, *key) for key in requests}
        return {key: future.result()["output_ids"] for key, future in futures.items()}


def group_members(pgid: int) -> list[str]:
    return subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True).stdout.split()


def assert_one_plugin_line_per_process(log: str, members: set) -> None:
    """The server's log at SGLang's default level: the plugin's line once in each process (the
    launcher, the detokenizer, both ranks' schedulers), each process its own pid; the backend's
    line once per rank."""
    loaded = [line for line in log.splitlines() if f"sglang-xpu-lora {__version__} loaded (SGLang 0.5.23, pid " in line]
    assert all(line.endswith("): --lora-backend intel_xpu registered") for line in loaded), loaded
    pids = [line.split(", pid ")[1].split(")")[0] for line in loaded]
    assert len(pids) == len(set(pids)) >= 4 and set(pids) <= members, (loaded, members)
    assert sum(" TP0] " in line for line in loaded) == sum(" TP1] " in line for line in loaded) == 1, loaded
    built = [line for line in log.splitlines() if "] intel_xpu LoRA backend built on cpu (SGLANG_XPU_LORA_KERNELS=torch): " in line]
    # A rank's label is read from its log prefix wherever it starts: another process's progress bar
    # (tqdm, no newline) can precede it on the same line.
    ranks = [re.search(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (TP\d+)\] intel_xpu LoRA backend built", line) for line in built]
    assert sorted(match.group(1) for match in ranks if match) == ["TP0", "TP1"], built
    assert all(line.endswith(
        "providers eager/in graphs: torch/torch for all 7 ops; LoRA pool: SGLang's packed layout at real ranks, "
        "slots zeroed before each load"
    ) for line in built), built


def test_sglang_serve_tp2(tiny_artifacts, tokenizer, hf_reference, tmp_path):
    """One ``sglang serve --tp-size 2`` (portable kernels) at SGLang's default log level: the mixed
    batch; unload and reload under another adapter's weights with requests in flight; a NaN tenant
    on rank 1; nothing left after; the plugin's line once per process."""
    nan_dir = tmp_path / "nan-q"
    shutil.copytree(tiny_artifacts["sql-r8"], nan_dir)
    port = serving.free_port()
    url = f"http://127.0.0.1:{port}"
    argv = serving.server_argv(tiny_artifacts, ADAPTERS, port, tp_size=TP, max_loras_per_batch=6)
    del argv[argv.index("--log-level") : argv.index("--log-level") + 2]
    env = {**serving.cpu_env("torch", tp_size=TP), slot_poison.NAN_ADAPTER_ENV: str(nan_dir), slot_poison.NAN_RANK_ENV: "1"}
    others = [(prompt, lora) for prompt in (P0, P1) for lora in ("qv-r4", "doc-r16", None)]
    with serving.running_server(argv, port, env, tmp_path / "server.log") as proc:
        members = set(group_members(proc.pid))
        mixed = generate_all(url, tokenizer, [(P0, lora) for lora in (None, *ADAPTERS)])
        with concurrent.futures.ThreadPoolExecutor(max_workers=6) as pool:
            in_flight = {key: pool.submit(generate, url, tokenizer, *key) for key in others * 2}
            unloaded = serving.post_json(f"{url}/unload_lora_adapter", {"lora_name": "sql-r8"})
            reloaded = serving.post_when_drained(f"{url}/load_lora_adapter", {"lora_name": "sql-r8", "lora_path": str(tiny_artifacts["doc-r16"])})
            in_flight = {key: future.result()["output_ids"] for key, future in in_flight.items()}
        renamed = generate(url, tokenizer, P0, "sql-r8")["output_ids"]
        loaded = serving.post_json(f"{url}/load_lora_adapter", {"lora_name": "nan-q", "lora_path": str(nan_dir)})
        poisoned = generate(url, tokenizer, P0, "nan-q")["output_ids"]  # now resident, NaN on rank 1
        while_resident = generate_all(url, tokenizer, others)
        unloaded_nan = serving.post_json(f"{url}/unload_lora_adapter", {"lora_name": "nan-q"})
        after_unload = generate_all(url, tokenizer, others)
        mapped = set(proc.shm_files)
    for response in (unloaded, reloaded, loaded, unloaded_nan):
        assert response.get("success", True), response
    assert {key: tokens for key, tokens in mixed.items() if tokens != hf_reference(*key)[1]} == {}
    assert {key: tokens for key, tokens in in_flight.items() if tokens != hf_reference(*key)[1]} == {}
    assert renamed == hf_reference(P0, "doc-r16")[1]
    assert poisoned != hf_reference(P0, "sql-r8")[1], "the NaN slot on rank 1 did not reach its own tenant"
    wrong = {
        phase: {key: tokens for key, tokens in outputs.items() if tokens != hf_reference(*key)[1]}
        for phase, outputs in (("while resident", while_resident), ("after unload", after_unload))
    }
    assert wrong == {"while resident": {}, "after unload": {}}, f"other tenants' requests went wrong: {wrong}"
    assert any(path.name.startswith("sgl_shm_mq_") for path in mapped), mapped  # the TP broadcast queue
    assert not [path for path in mapped if path.exists()], "the server's /dev/shm files are still there"
    assert group_members(proc.pid) == [], "server processes left behind"
    assert_one_plugin_line_per_process((tmp_path / "server.log").read_text(), members)


def test_two_nodes_form_one_tp2_server(tiny_artifacts, tokenizer, hf_reference, tmp_path):
    """``--nnodes 2``: node 1 (schedulers only) and node 0 (HTTP server and rank 0), one rank each,
    rendezvous at ``--dist-init-addr``; node 0 serves the mixed batch exactly and each node's rank
    holds its slice; both stop completely."""
    snapshots = tmp_path / "pool"
    snapshots.mkdir()
    dist_init = f"127.0.0.1:{serving.free_port()}"
    ports = {rank: serving.free_port() for rank in (0, 1)}
    env = {**serving.cpu_env("torch", tp_size=TP, nnodes=2), pool_snapshot.SNAPSHOT_ENV: str(snapshots)}
    with contextlib.ExitStack() as nodes:
        procs = {}
        for rank in (1, 0):  # stopped in reverse: node 0 first, which tells node 1's scheduler to exit
            argv = serving.server_argv(tiny_artifacts, ADAPTERS, ports[rank], tp_size=TP, nnodes=2, node_rank=rank, dist_init_addr=dist_init)
            procs[rank] = nodes.enter_context(serving.started_process(argv, env, tmp_path / f"node{rank}.log"))
        for rank in (1, 0):
            serving.wait_until_healthy(procs[rank], ports[rank], tmp_path / f"node{rank}.log", timeout=400)
        mixed = generate_all(f"http://127.0.0.1:{ports[0]}", tokenizer, [(P0, lora) for lora in (None, *ADAPTERS)])
        mapped = procs[0].shm_files | procs[1].shm_files
    assert {key: tokens for key, tokens in mixed.items() if tokens != hf_reference(*key)[1]} == {}
    assert_each_rank_holds_its_slice(read_snapshots(snapshots), tiny_artifacts, ADAPTERS)
    assert not [path for path in mapped if path.exists()], "the nodes' /dev/shm files are still there"
    assert [group_members(proc.pid) for proc in procs.values()] == [[], []], "node processes left behind"
