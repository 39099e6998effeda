"""A request's LoRA fields are checked where it enters (issue 27), through the real server and
engine on CPU, against transformers + PEFT.

SGLang 0.5.23 alone, on ``intel_xpu`` and ``torch_native`` alike: one prompt with a ``lora_path``
list kills the server (the scheduler dies) or the engine process; so does a ``lora_id`` without a
``lora_path``; a batch with fewer ``lora_path`` entries than prompts is an HTTP 500, one with more
is served with the extra entries dropped. With the plugin each is refused (HTTP 400, an error
event in a ``/generate`` stream, a ``ValueError`` from ``Engine.generate`` / ``async_generate``)
naming the field and the lengths, and the next good request is answered exactly as transformers +
PEFT answer it. A request for an unloaded adapter says it was unloaded, a name never loaded says
that, each with how many adapters are loaded and where to list them, not their names.

Both run with ``--max-loras-per-batch 2`` and a batch of two adapters and the base model (three
distinct entries): SGLang's scheduler serves it in turns, exactly (issue 27, item 5).

* One ``sglang serve`` on ``intel_xpu``: ``/generate`` (streamed and not), ``/v1/completions``,
  ``/v1/chat/completions`` (streamed and not), the OpenAI ``model: "<base>:<adapter>"`` form.
* One engine on SGLang's ``torch_native`` with ``SGLANG_XPU_LORA_ADAPTER_CHECKS=all``.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from sglang_cpu_devsupport import serving, tiny_model

pytestmark = pytest.mark.e2e

LOGPROB_TOLERANCE = 1e-4
P0, P1, P2 = "def main(self):", "import os\nfor path in", "class Foo(object):\n    def"
PARAMS = {"temperature": 0.0, "max_new_tokens": serving.GREEDY_TOKENS, "ignore_eos": True}
TWO = ["sql-r8", "doc-r16"]
SINGLE_LIST = "lora_path is a list of 2 for a single prompt; expected an adapter name (a string)"
N_SAMPLES = "lora_path has 2 entries for a batch of 1 prompt; expected 1"
LORA_ID_ALONE = "lora_id is the adapter id SGLang sets from lora_path"
#: How many adapters the server has loaded and where to list them, as its refusals of an adapter
#: that is not loaded say it (never the loaded adapters' names: issue 31).
LOADED = "Loaded adapters: 2 (GET /v1/models lists them)."
MIXED = [(P0, "sql-r8"), (P1, "doc-r16"), (P2, None)]  # three distinct entries, two slots


def batch_length(found, prompts):
    return f"lora_path has {found} entries for a batch of {prompts} prompts; expected {prompts}"


def assert_exact(prompt, lora, output_ids, hf_reference, first_logprobs=None):
    """``output_ids`` (and ``first_logprobs``) are transformers + PEFT's for ``prompt`` on
    ``lora``."""
    ref_logprobs, ref_tokens = hf_reference(prompt, lora)
    assert output_ids == ref_tokens, f"{lora} on {prompt[:20]!r}: not PEFT's greedy tokens"
    if first_logprobs is not None:
        logprobs = torch.tensor(first_logprobs, dtype=torch.float64)
        delta = float((logprobs - ref_logprobs).abs().max())
        assert delta <= LOGPROB_TOLERANCE, f"{lora} on {prompt[:20]!r}: |Δ logprob| {delta:.1e}"


@pytest.fixture(scope="module")
def server_log(tmp_path_factory):
    return tmp_path_factory.mktemp("request-checks-server") / "server.log"


@pytest.fixture(scope="module")
def server(tiny_artifacts, server_log):
    """``url``: one ``sglang serve`` on ``intel_xpu`` with sql-r8 and doc-r16, two LoRA slots per
    batch, and a chat template (the tiny tokenizer has none)."""
    template = server_log.parent / "plain.jinja"
    template.write_text("{% for message in messages %}{{ message['content'] }}\n{% endfor %}")
    port = serving.free_port()
    argv = serving.server_argv(
        tiny_artifacts, TWO, port, max_loras_per_batch=2, chat_template=str(template)
    )
    with serving.running_server(argv, port, serving.cpu_env(), server_log):
        yield f"http://127.0.0.1:{port}"


def post(url, payload):
    """``(HTTP status, body text)``; a streamed answer's body is its events."""
    data, headers = json.dumps(payload).encode(), {"Content-Type": "application/json"}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def stream_error(body):
    """The ``error`` object of a streamed answer's error event."""
    lines = [line[len("data: "):] for line in body.splitlines() if line.startswith("data: {")]
    (error,) = [event["error"] for event in map(json.loads, lines) if "error" in event]
    return error


def refusals(tokenizer):
    """(what, route, payload, what the answer must contain): every malformed request and the two
    refusals of adapters that are not loaded, in the order they are sent."""
    ids = [tokenizer.encode(p) for p in (P0, P1, P2)]
    chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": P0}], "max_tokens": 4}
    n_samples = {"n": 2, "max_new_tokens": 2}
    completion = {"model": "tiny-llama", "prompt": P0, "lora_path": TWO}
    return [
        ("one prompt, a list", "/generate", {"input_ids": ids[0], "lora_path": TWO}, SINGLE_LIST),
        ("3 prompts, 2", "/generate", {"input_ids": ids, "lora_path": TWO}, batch_length(2, 3)),
        (
            "2 prompts, 3", "/generate", {"input_ids": ids[:2], "lora_path": [*TWO, None]},
            batch_length(3, 2),
        ),
        ("lora_id alone", "/generate", {"input_ids": ids[0], "lora_id": "some-id"}, LORA_ID_ALONE),
        (
            "n=2, a list of 2", "/generate",
            {"input_ids": ids[0], "lora_path": TWO, "sampling_params": n_samples}, N_SAMPLES,
        ),
        (
            "streamed", "/generate", {"input_ids": ids[0], "lora_path": TWO, "stream": True},
            SINGLE_LIST,
        ),
        ("completions", "/v1/completions", completion, SINGLE_LIST),
        (
            "completions batch", "/v1/completions", {**completion, "prompt": [P0, P1, P2]},
            batch_length(2, 3),
        ),
        ("completions streamed", "/v1/completions", {**completion, "stream": True}, SINGLE_LIST),
        ("chat", "/v1/chat/completions", {**chat, "lora_path": TWO}, SINGLE_LIST),
        (
            "chat streamed", "/v1/chat/completions", {**chat, "lora_path": TWO, "stream": True},
            SINGLE_LIST,
        ),
        (
            "unloaded, model form", "/v1/chat/completions", {**chat, "model": "tiny-llama:extra"},
            f"LoRA adapter 'extra' was unloaded (load it again to serve it). {LOADED}",
        ),
        (
            "never loaded", "/generate", {"input_ids": ids[0], "lora_path": "never"},
            f"LoRA adapter 'never' has never been loaded. {LOADED}",
        ),
    ]


def test_http_malformed_requests_are_refused_and_the_next_is_served_exactly(
    server, server_log, tokenizer, tiny_artifacts, hf_reference
):
    """Each request of :func:`refusals` (after ``extra`` was loaded and unloaded) is a 400, or in a
    ``/generate`` stream an error event, with its message (no loaded adapter's name in a refusal
    of an adapter that is not loaded; ``/v1/models``, where they point, lists them; an unload of a
    name never loaded is refused the same way); the server then serves a batch of two adapters and
    the base model with two LoRA slots exactly, and its scheduler never failed."""
    extra = {"lora_name": "extra", "lora_path": str(tiny_artifacts["qv-r4"])}
    assert post(f"{server}/load_lora_adapter", extra)[0] == 200
    assert post(f"{server}/unload_lora_adapter", {"lora_name": "extra"})[0] == 200
    for what, route, payload, message in refusals(tokenizer):
        status, body = post(server + route, payload)
        if payload.get("stream") and status == 200:  # /generate streams, then checks
            error = stream_error(body)
            assert message in error["message"] and error["code"] == 400, (what, body[:500])
        else:
            assert status == 400 and message in body, (what, status, body[:500])
        if "LoRA adapter '" in message:  # refused as not loaded: no other tenant's name
            assert not any(name in body for name in TWO), (what, body[:500])
    # The refusals' pointer: /v1/models lists the loaded adapters (after the base model).
    with urllib.request.urlopen(f"{server}/v1/models", timeout=60) as response:
        models = [card["id"] for card in json.loads(response.read())["data"]]
    assert models[0] == "tiny-llama" and sorted(models[1:]) == sorted(TWO), models
    # An unload of a name not loaded: SGLang's refusal listed every loaded adapter.
    status, body = post(f"{server}/unload_lora_adapter", {"lora_name": "never"})
    assert status == 400 and f"LoRA adapter 'never' has never been loaded: nothing to unload. {LOADED}" in body, body
    assert not any(name in body for name in TWO), body

    batch = {
        "input_ids": [tokenizer.encode(prompt) for prompt, _ in MIXED],
        "lora_path": [lora for _, lora in MIXED],
        "sampling_params": PARAMS,
        "return_logprob": True,
        "top_logprobs_num": tiny_model.VOCAB_SIZE,
    }
    status, body = post(f"{server}/generate", batch)
    assert status == 200, body[:500]
    for (prompt, lora), out in zip(MIXED, json.loads(body)):
        first = serving.first_token_logprobs(out["meta_info"], tiny_model.VOCAB_SIZE).tolist()
        assert_exact(prompt, lora, out["output_ids"], hf_reference, first)
    assert "Scheduler hit an exception" not in server_log.read_text()


def engine_rounds(tokenizer):
    """The engine's rounds (``sglang_cpu_devsupport.engine_batch``), each with what its error must
    say, the batch it must serve exactly, or None (an unload that must succeed)."""
    ids = [tokenizer.encode(p) for p in (P0, P1, P2)]
    n_samples = {"n": 2, "max_new_tokens": 2}
    return [
        ({"generate": {"input_ids": ids[0], "lora_path": TWO}}, SINGLE_LIST),
        ({"generate": {"input_ids": ids[0], "lora_path": TWO}, "async": True}, SINGLE_LIST),
        ({"generate": {"input_ids": ids, "lora_path": TWO}}, batch_length(2, 3)),
        ({"generate": {"input_ids": ids[:2], "lora_path": [*TWO, None]}}, batch_length(3, 2)),
        (
            {"generate": {"input_ids": ids[0], "lora_path": TWO, "sampling_params": n_samples}},
            N_SAMPLES,
        ),
        (MIXED, MIXED),  # served in turns: two adapters and the base model, two slots
        ({"unload": {"lora_name": "doc-r16"}}, None),
        (
            {"generate": {"input_ids": ids[1], "lora_path": "doc-r16"}},
            "LoRA adapter 'doc-r16' was unloaded",
        ),
        (
            {"generate": {"input_ids": ids[1], "lora_path": "never"}},
            "LoRA adapter 'never' has never been loaded. Loaded adapters: 1 (GET /v1/models lists them).",
        ),
        (
            {"generate": {"input_ids": ids[:2], "lora_path": ["sql-r8", None]}},
            [(P0, "sql-r8"), (P1, None)],
        ),
    ]


def test_engine_malformed_requests_raise_and_the_next_is_served_exactly(
    run_engine, tokenizer, hf_reference
):
    """``Engine.generate`` and ``async_generate`` on SGLang's ``torch_native`` with the checks on:
    each malformed request raises ``ValueError`` in the caller, the engine keeps serving, and the
    batches after the refusals are served exactly."""
    rounds = engine_rounds(tokenizer)
    env = {**serving.cpu_env(), "SGLANG_XPU_LORA_ADAPTER_CHECKS": "all"}
    results, _ = run_engine(
        "request-checks", [r for r, _ in rounds], env, adapters=TWO,
        engine={"lora_backend": "torch_native", "max_loras_per_batch": 2},
    )
    for (request, expected), result in zip(rounds, results):
        if isinstance(expected, str):
            error = result.get("error", "")
            assert error.startswith("ValueError: ") and expected in error, (request, result)
        elif request == MIXED:
            for (prompt, lora), out in result.items():
                assert_exact(prompt, lora, out["output_ids"], hf_reference, out["first_logprobs"])
        elif expected is None:
            assert result["success"], result
        else:
            assert "output_ids" in result, result
            for (prompt, lora), output_ids in zip(expected, result["output_ids"]):
                assert_exact(prompt, lora, output_ids, hf_reference)
