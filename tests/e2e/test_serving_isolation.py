"""A real ``launch_server`` on CPU (portable provider) under load and with a poisoned tenant.

* ``test_soak``: 4 adapters over 2 pool slots (``--max-loras-per-batch 2``: every adapter change
  evicts), several client threads and an unload/reload loop for a bounded time and request count.
  Every answer must carry exactly the transformers + PEFT greedy tokens of its (prompt, adapter);
  no 5xx; the server alive at the end; the resident memory of its processes flat (tolerance below).
* ``test_nan_tenant_is_isolated``: issue 10's table over HTTP. A tenant's pool slot holds NaN in
  its layer-0 q_proj LoRA-B (put there by ``sglang_cpu_devsupport.slot_poison`` after the load-time
  checks, since adapter files with NaN are refused). While it is resident but not requested, and
  after it is unloaded, batches of the other tenants (two adapters and the base model, decoded
  together, so the portable ops take their device routing) must match the reference.

Each test starts its own server (the only two servers of this file): the soak needs 2 slots so that
every adapter change evicts, the NaN table needs a slot that stays resident but unrequested next to
a batch of three tenants (4 slots). Measured on the shared 2-core machine under a load average of
10: 170 s for the soak (60 s of it serving), 91 s for the NaN table, plus the shared references.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import random
import shutil
import threading
import time
import urllib.error
import urllib.request

import pytest

from sglang_cpu_devsupport import serving, slot_poison, tiny_model

pytestmark = pytest.mark.e2e

PROMPTS = ("def main(self):", "import os\nfor path in", "class Foo(object):\n    def")
SOAK_ADAPTERS = (*tiny_model.ADAPTER_NAMES, tiny_model.EMBEDDING_ADAPTER.name)  # 4 adapters
#: Adapters the soak unloads and loads again (same weights) in a loop. A request naming one while it
#: is unloaded is refused with HTTP 400 (an unload is final: ``patches/unload_final.py``), tolerated
#: for these only; every load after an unload must succeed.
CYCLED = ("sql-r8", "emb-head-r8")
SOAK_SECONDS, SOAK_MAX_REQUESTS, SOAK_CLIENTS = 60.0, 2000, 4
#: The soak runs for at least SOAK_SECONDS and at least SOAK_MIN_CYCLES unload/reload cycles (each
#: cycled adapter twice), and stops at SOAK_MAX_SECONDS whatever happened (bounded on a slow machine).
SOAK_MIN_CYCLES, SOAK_MAX_SECONDS = 2 * len(CYCLED), 240.0
#: Resident memory of the server's processes may grow by at most this much between the end of the
#: first unload/reload cycle and the end of the soak (allocator caches settle in the first cycle;
#: each tiny adapter holds ~0.2 MB, so a leak of one per reload shows as several MB per minute).
RSS_TOLERANCE_BYTES = 32 << 20
PARAMS = {"temperature": 0.0, "max_new_tokens": serving.GREEDY_TOKENS, "ignore_eos": True}


def generate(url: str, input_ids, lora) -> dict:
    return serving.post_json(f"{url}/generate", {"input_ids": input_ids, "lora_path": lora, "sampling_params": PARAMS})


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health_generate", timeout=60) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


@pytest.fixture(scope="module")
def references(tokenizer, hf_reference):
    """(prompt, adapter or None) -> (input ids, transformers + PEFT greedy tokens)."""
    return {
        (prompt, lora): (tokenizer.encode(prompt), hf_reference(prompt, lora)[1])
        for prompt in PROMPTS
        for lora in (*SOAK_ADAPTERS, None)
    }


class Tally:
    """Outcomes of the soak's requests, shared by the client threads."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests = self.exact = 0
        self.wrong: list = []
        self.server_errors: list = []
        self.refused_while_cycled = 0
        self.other_errors: list = []

    def record(self, key, reference, outcome) -> None:
        with self.lock:
            self.requests += 1
            if isinstance(outcome, serving.HTTPStatusError):
                if outcome.status >= 500:
                    self.server_errors.append((key, outcome.status, outcome.body[:300]))
                elif outcome.status == 400 and key[1] in CYCLED:
                    self.refused_while_cycled += 1
                else:
                    self.other_errors.append((key, outcome.status, outcome.body[:300]))
            elif isinstance(outcome, Exception):
                self.other_errors.append((key, repr(outcome)))
            elif outcome == reference:
                self.exact += 1
            else:
                self.wrong.append((key, outcome))


def test_soak(tiny_artifacts, references, tmp_path):
    port = serving.free_port()
    url = f"http://127.0.0.1:{port}"
    argv = serving.server_argv(tiny_artifacts, SOAK_ADAPTERS, port, max_loras_per_batch=2)
    tally, cycles, rss = Tally(), [], []
    with serving.running_server(argv, port, serving.cpu_env(), tmp_path / "server.log") as server:
        start = time.monotonic()
        stop = threading.Event()

        def client(seed: int) -> None:
            rng = random.Random(seed)
            while not stop.is_set() and time.monotonic() < start + SOAK_MAX_SECONDS:
                with tally.lock:
                    if tally.requests >= SOAK_MAX_REQUESTS:
                        return
                key = rng.choice(list(references))
                input_ids, reference = references[key]
                try:
                    outcome = generate(url, input_ids, key[1])["output_ids"]
                except Exception as exc:  # noqa: BLE001 - every failure is tallied and asserted on
                    outcome = exc
                tally.record(key, reference, outcome)

        def soaking() -> bool:
            elapsed = time.monotonic() - start
            return elapsed < SOAK_MAX_SECONDS and (elapsed < SOAK_SECONDS or len(cycles) < SOAK_MIN_CYCLES)

        def reload_loop() -> None:
            try:
                cycle_until_done()
            finally:
                stop.set()  # the clients stop with the loop

        def cycle_until_done() -> None:
            for name in itertools.cycle(CYCLED):
                if not soaking():
                    return
                unloaded = serving.post_json(f"{url}/unload_lora_adapter", {"lora_name": name})
                if not unloaded.get("success", True):
                    cycles.append((name, unloaded, None))
                    return
                time.sleep(0.5)
                try:
                    loaded = serving.post_when_drained(
                        f"{url}/load_lora_adapter", {"lora_name": name, "lora_path": str(tiny_artifacts[name])},
                        timeout=30,
                    )
                except serving.HTTPStatusError as exc:
                    cycles.append((name, unloaded, {"success": False, "error": str(exc)}))
                    return
                cycles.append((name, unloaded, loaded))
                if len(cycles) == len(CYCLED):  # every cycled adapter went round once: the baseline
                    rss.append(serving.process_group_rss(server.pid))
                time.sleep(1.0)

        with concurrent.futures.ThreadPoolExecutor(max_workers=SOAK_CLIENTS + 1) as pool:
            futures = [pool.submit(client, seed) for seed in range(SOAK_CLIENTS)] + [pool.submit(reload_loop)]
            try:
                for future in futures:
                    future.result(timeout=SOAK_MAX_SECONDS + 240)
            finally:
                stop.set()
        rss.append(serving.process_group_rss(server.pid))
        alive = server.poll() is None and healthy(url)
    summary = (
        f"{tally.requests} requests: {tally.exact} exact, {len(tally.wrong)} wrong, "
        f"{len(tally.server_errors)} 5xx, {tally.refused_while_cycled} 400s for cycled adapters, "
        f"{len(tally.other_errors)} other errors; {len(cycles)} unload/reload cycles; RSS {[r >> 20 for r in rss]} MiB"
    )
    print(summary)
    assert tally.wrong == [], summary + f"; first wrong: {tally.wrong[:3]}"
    assert tally.server_errors == [] and tally.other_errors == [], (summary, tally.server_errors[:3], tally.other_errors[:3])
    assert alive, summary
    assert all(load and load.get("success", True) for _, _, load in cycles) and len(cycles) >= SOAK_MIN_CYCLES, cycles
    assert tally.exact >= 20, summary  # the soak really served (about 50-80 on a loaded 2-core machine)
    assert len(rss) == 2 and rss[1] - rss[0] <= RSS_TOLERANCE_BYTES, summary


def test_nan_tenant_is_isolated(tiny_artifacts, references, tmp_path):
    """Issue 10's table: [sql-r8, doc-r16, base] decoded together while the NaN tenant is resident
    but not requested, and again after it is unloaded, match transformers + PEFT."""
    nan_dir = tmp_path / "nan-q"
    shutil.copytree(tiny_artifacts["sql-r8"], nan_dir)
    port = serving.free_port()
    url = f"http://127.0.0.1:{port}"
    argv = serving.server_argv(tiny_artifacts, ("sql-r8", "doc-r16"), port, max_loras_per_batch=4)
    env = {**serving.cpu_env(), slot_poison.NAN_ADAPTER_ENV: str(nan_dir)}
    others = [(prompt, lora) for prompt in PROMPTS[:2] for lora in ("sql-r8", "doc-r16", None)]

    def batch_of_others():
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(others)) as pool:
            futures = {key: pool.submit(generate, url, references[key][0], key[1]) for key in others}
            return {key: future.result()["output_ids"] for key, future in futures.items()}

    with serving.running_server(argv, port, env, tmp_path / "server.log"):
        loaded = serving.post_json(f"{url}/load_lora_adapter", {"lora_name": "nan-q", "lora_path": str(nan_dir)})
        poisoned = generate(url, references[(PROMPTS[0], None)][0], "nan-q")["output_ids"]  # now resident
        while_resident = batch_of_others()
        unloaded = serving.post_json(f"{url}/unload_lora_adapter", {"lora_name": "nan-q"})
        after_unload = batch_of_others()
    assert loaded.get("success", True) and unloaded.get("success", True), (loaded, unloaded)
    assert poisoned != references[(PROMPTS[0], "sql-r8")][1], "the NaN slot did not reach its own tenant"
    wrong = {
        phase: {key: tokens for key, tokens in outputs.items() if tokens != references[key][1]}
        for phase, outputs in (("while resident", while_resident), ("after unload", after_unload))
    }
    assert wrong == {"while resident": {}, "after unload": {}}, f"other tenants' requests went wrong: {wrong}"
