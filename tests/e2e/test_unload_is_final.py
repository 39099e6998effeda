"""Unload is final (issue 17, item 1), through the real engine and server on CPU (portable
kernels), against transformers + PEFT.

After a successful unload, a request naming the adapter is refused saying that it was unloaded (an
error from ``Engine.generate``, HTTP 400 over HTTP), and a later load under the name
serves the weights that load names. SGLang 0.5.23 alone loads the old weights again for such a
request and serves them, then refuses the new load as "already loaded" (``patches/unload_final.py``).
Adapters evicted under ``--max-loaded-loras`` are still loaded again when a request names them, with
their latest weights, exactly.

* One engine (``--max-loras-per-batch 2 --max-loaded-loras 2``), rounds in order: unload, a refused
  request, a load of other weights under the name; evictions and implicit reloads; the unload of an
  evicted adapter.
* One ``sglang serve`` with ``--enable-lora-overlap-loading`` (``--max-loaded-loras 3``): the same
  sequence with the HTTP 400 checked; concurrent unloads, loads and requests of one name from
  threads; implicit reloads of evicted adapters.

Answers are compared with transformers + PEFT for the weights each name serves at that point: 16
greedy tokens, and first-token log-probs over the whole vocabulary within 1e-4 where logged (the bar
of ``test_engine_parity.py``).
"""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from sglang_cpu_devsupport import serving, tiny_model

pytestmark = pytest.mark.e2e

LOGPROB_TOLERANCE = 1e-4
P0, P1, P2 = "def main(self):", "import os\nfor path in", "class Foo(object):\n    def"
NEVER_LOADED = "never-loaded"
PARAMS = {"temperature": 0.0, "max_new_tokens": serving.GREEDY_TOKENS, "ignore_eos": True}

#: The engine's rounds. Each comment names the weights the batch must be served with; ``extra`` is
#: loaded when two names are registered, so the least recently used one is evicted.
ENGINE_ROUNDS = [
    [(P0, "sql-r8"), (P1, "doc-r16")],  # 0: both as loaded at start-up
    {"unload": {"lora_name": "sql-r8"}},  # 1
    {"may_fail": [(P0, "sql-r8")]},  # 2: refused
    {"may_fail": [(P0, NEVER_LOADED)]},  # 3: refused as never loaded
    {"load": {"lora_name": "sql-r8", "lora_path": "qv-r4"}},  # 4: other weights under the name
    [(P0, "sql-r8")],  # 5: qv-r4's weights
    {"load": {"lora_name": "extra", "lora_path": "sql-r8"}},  # 6: evicts doc-r16
    [(P1, "doc-r16")],  # 7: doc-r16 loaded again by the request (evicts sql-r8)
    [(P0, "sql-r8")],  # 8: loaded again by the request, with its latest weights (qv-r4)
    {"unload": {"lora_name": "extra"}},  # 9: extra was evicted in 8: the unload still revokes it
    {"may_fail": [(P2, "extra")]},  # 10: refused
    {"load": {"lora_name": "extra", "lora_path": "doc-r16"}},  # 11
    [(P2, "extra")],  # 12: doc-r16's weights
]
#: Round -> {name: adapter directory whose weights that name must serve}.
ENGINE_WEIGHTS = {
    0: {"sql-r8": "sql-r8", "doc-r16": "doc-r16"},
    5: {"sql-r8": "qv-r4"},
    7: {"doc-r16": "doc-r16"},
    8: {"sql-r8": "qv-r4"},
    12: {"extra": "doc-r16"},
}


def assert_served(outputs, weights, hf_reference):
    """Each ``(prompt, name) -> output`` matches transformers + PEFT with ``weights[name]``."""
    for (prompt, name), out in outputs.items():
        ref_logprobs, ref_tokens = hf_reference(prompt, weights[name])
        delta = float((torch.tensor(out["first_logprobs"], dtype=torch.float64) - ref_logprobs).abs().max())
        assert delta <= LOGPROB_TOLERANCE, f"{name} on {prompt[:20]!r}: max |Δ logprob| {delta:.2e} against {weights[name]}"
        assert out["output_ids"] == ref_tokens, f"{name} on {prompt[:20]!r}: not {weights[name]}'s greedy tokens"


def refused_as(message: str, name: str, why: str) -> bool:
    """Whether ``message`` refuses adapter ``name`` saying ``why`` ("was unloaded", "has never been
    loaded"; ``patches/request_checks.py``), listing the loaded adapters."""
    return f"LoRA adapter {name!r} {why}" in message and "Loaded adapters: " in message


@pytest.fixture(scope="module")
def engine_run(run_engine, tiny_artifacts):
    rounds = [  # the adapter directories of the loads
        {"load": {**r["load"], "lora_path": str(tiny_artifacts[r["load"]["lora_path"]])}}
        if isinstance(r, dict) and "load" in r else r
        for r in ENGINE_ROUNDS
    ]
    results, _ = run_engine(
        "unload-final", rounds, serving.cpu_env(), adapters=("sql-r8", "doc-r16"),
        engine={"max_loras_per_batch": 2, "max_loaded_loras": 2},
    )
    return results


def test_engine_unloaded_adapter_is_refused_then_loads_new_weights(engine_run, hf_reference):
    """Unload → the request is refused as unloaded → a load of qv-r4's weights under the
    name succeeds and serves them."""
    assert engine_run[1]["success"], engine_run[1]
    assert "error" in engine_run[3], engine_run[3]
    assert "error" in engine_run[2], f"an unloaded adapter was served: {engine_run[2]}"
    assert refused_as(engine_run[2]["error"], "sql-r8", "was unloaded"), engine_run[2]
    assert refused_as(engine_run[3]["error"], NEVER_LOADED, "has never been loaded"), engine_run[3]
    assert engine_run[4]["success"], engine_run[4]
    assert_served(engine_run[0], ENGINE_WEIGHTS[0], hf_reference)
    assert_served(engine_run[5], ENGINE_WEIGHTS[5], hf_reference)


def test_engine_evicted_adapters_are_loaded_again_exactly(engine_run, hf_reference):
    """``--max-loaded-loras 2``: loading a third name evicts doc-r16; requests load evicted adapters
    again, each with its latest weights (sql-r8: qv-r4's, loaded under its name before)."""
    assert engine_run[6]["success"] and engine_run[6]["loaded"] == ["extra", "sql-r8"], engine_run[6]
    assert_served(engine_run[7], ENGINE_WEIGHTS[7], hf_reference)
    assert_served(engine_run[8], ENGINE_WEIGHTS[8], hf_reference)


def test_engine_unloading_an_evicted_adapter_revokes_it(engine_run, hf_reference):
    """An adapter evicted under ``--max-loaded-loras`` and then unloaded is refused, and its name
    loads other weights afterwards."""
    assert engine_run[9]["success"], engine_run[9]
    assert "error" in engine_run[10], f"an unloaded adapter was served: {engine_run[10]}"
    assert refused_as(engine_run[10]["error"], "extra", "was unloaded"), engine_run[10]
    assert engine_run[11]["success"], engine_run[11]
    assert_served(engine_run[12], ENGINE_WEIGHTS[12], hf_reference)


@pytest.fixture(scope="module")
def server_log(tmp_path_factory):
    return tmp_path_factory.mktemp("unload-final-server") / "server.log"


@pytest.fixture(scope="module")
def server(tiny_artifacts, server_log):
    """``url``: one ``sglang serve`` with sql-r8 and doc-r16 at start-up, overlap loading on."""
    port = serving.free_port()
    argv = serving.server_argv(
        tiny_artifacts, ("sql-r8", "doc-r16"), port, enable_lora_overlap_loading=True, max_loaded_loras=3
    )
    with serving.running_server(argv, port, serving.cpu_env(), server_log):
        yield f"http://127.0.0.1:{port}"


class Client:
    """Requests to the module's server; every answer is ``(HTTP status, decoded body or text)``."""

    def __init__(self, url, tokenizer, tiny_artifacts):
        self.url, self.tokenizer, self.paths = url, tokenizer, tiny_artifacts

    def post(self, route, payload):
        try:
            return 200, serving.post_json(f"{self.url}{route}", payload)
        except serving.HTTPStatusError as exc:
            return exc.status, exc.body

    def generate(self, prompt, name, logprobs=False):
        payload = {"input_ids": self.tokenizer.encode(prompt), "lora_path": name, "sampling_params": PARAMS}
        if logprobs:
            payload.update(return_logprob=True, top_logprobs_num=tiny_model.VOCAB_SIZE)
        status, body = self.post("/generate", payload)
        if status != 200 or not logprobs:
            return status, body["output_ids"] if status == 200 else body
        return status, {"output_ids": body["output_ids"], "first_logprobs": serving.first_token_logprobs(body["meta_info"], tiny_model.VOCAB_SIZE).tolist()}

    def load(self, name, weights):
        return self.post("/load_lora_adapter", {"lora_name": name, "lora_path": str(self.paths[weights])})

    def unload(self, name):
        return self.post("/unload_lora_adapter", {"lora_name": name})


@pytest.fixture(scope="module")
def client(server, tokenizer, tiny_artifacts):
    return Client(server, tokenizer, tiny_artifacts)


def test_http_unloaded_adapter_is_refused_with_400_then_loads_new_weights(client, hf_reference):
    assert client.unload("sql-r8")[0] == 200
    refused = client.generate(P0, "sql-r8")
    never = client.generate(P0, NEVER_LOADED)
    assert never[0] == 400, never
    assert refused[0] == 400, f"an unloaded adapter was served: {refused}"
    assert refused_as(refused[1], "sql-r8", "was unloaded"), refused
    assert refused_as(never[1], NEVER_LOADED, "has never been loaded"), never
    assert client.load("sql-r8", "qv-r4")[0] == 200
    status, served = client.generate(P0, "sql-r8", logprobs=True)
    assert status == 200, served
    assert_served({(P0, "sql-r8"): served}, {"sql-r8": "qv-r4"}, hf_reference)


def run_together(calls):
    """Run the ``(function, *args)`` calls at once from threads; their answers, in order."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(calls)) as pool:
        futures = [pool.submit(*call) for call in calls]
        return [future.result() for future in futures]


def test_http_concurrent_unloads_loads_and_requests_of_one_name(client, hf_reference):
    """doc-r16, from threads: six unloads with requests; then three loads of sql-r8's weights under
    the name with requests; then unloads and loads of qv-r4's weights interleaved with requests.
    A request is answered with the weights the name had before or after, or refused (400); never
    with weights an unload removed; the name ends as the operations left it."""
    tokens = {weights: hf_reference(P1, weights)[1] for weights in ("doc-r16", "sql-r8", "qv-r4")}
    requests = [(client.generate, P1, "doc-r16")] * 6

    answers = run_together([(client.unload, "doc-r16")] * 6 + requests)
    unloads, served = answers[:6], answers[6:]
    assert sorted(status for status, _ in unloads) == [200] + [400] * 5, unloads
    assert all(answer in ((200, tokens["doc-r16"]),) or answer[0] == 400 for answer in served), served
    assert client.generate(P1, "doc-r16")[0] == 400, "an unloaded adapter was served after six unloads"

    answers = run_together([(client.load, "doc-r16", "sql-r8")] * 3 + requests)
    loads, served = answers[:3], answers[3:]
    assert sorted(status for status, _ in loads) == [200, 400, 400], loads
    assert all(answer == (200, tokens["sql-r8"]) or answer[0] == 400 for answer in served), served
    assert client.generate(P1, "doc-r16") == (200, tokens["sql-r8"])

    answers = run_together([(client.unload, "doc-r16"), (client.load, "doc-r16", "qv-r4")] * 3 + requests)
    served = answers[6:]
    assert all(answer[0] == 400 or answer[1] in (tokens["sql-r8"], tokens["qv-r4"]) for answer in served), served
    final = client.generate(P1, "doc-r16")
    if final[0] == 200:  # the last operation was a load: the name serves it, and a new load is refused
        assert final[1] == tokens["qv-r4"], "sql-r8's weights were unloaded and still served"
        assert client.load("doc-r16", "qv-r4")[0] == 400
    else:  # the last operation was an unload: the name loads again
        assert final[0] == 400, final
        assert client.load("doc-r16", "qv-r4")[0] == 200
        assert client.generate(P1, "doc-r16") == (200, tokens["qv-r4"])


def test_http_evicted_adapters_are_loaded_again_exactly(client, hf_reference):
    """``--max-loaded-loras 3`` with overlap loading: three more names evict ``evicted-doc``; a
    request loads it again with its weights, exactly."""
    assert client.load("evicted-doc", "doc-r16")[0] == 200
    for name in ("fill-1", "fill-2", "fill-3"):
        status, body = client.load(name, "sql-r8")
        assert status == 200, body
    assert "evicted-doc" not in body["loaded_adapters"], body
    status, served = client.generate(P2, "evicted-doc", logprobs=True)
    assert status == 200, served
    assert_served({(P2, "evicted-doc"): served}, {"evicted-doc": "doc-r16"}, hf_reference)


def test_http_refused_requests_leave_no_traceback_in_the_log(client, server_log):
    """Each request refused for naming an adapter that is not loaded (here and in the tests above)
    is one HTTP 400; SGLang alone also logs a ``TypeError`` traceback for it ("Task exception was
    never retrieved", from releasing the adapter the request never acquired)."""
    assert client.generate(P0, NEVER_LOADED)[0] == 400
    assert client.generate(P0, None)[0] == 200  # a later request: the refused one's release ran
    log = server_log.read_text()
    assert "Task exception was never retrieved" not in log and "Traceback" not in log, log[-3000:]
