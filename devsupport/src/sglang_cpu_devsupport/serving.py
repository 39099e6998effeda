"""Helpers shared by the CPU example and the end-to-end tests: engine/server settings, the HF + PEFT
reference, and an ``sglang serve`` process that is always shut down and leaves nothing behind."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator, Optional, Sequence

from sglang_cpu_devsupport import CPU_ENGINE_ENV, leftovers, tensor_parallel

#: Settings for SGLang on a 2-core CPU: torch-native attention, no graphs, a small KV pool (by
#: default SGLang sizes it from RAM: ~15 GB and ~27 s for this model), float32 for tight comparisons.
CPU_ENGINE_SETTINGS = dict(
    device="cpu",
    attention_backend="torch_native",
    cuda_graph_backend_decode="disabled",
    cuda_graph_backend_prefill="disabled",
    max_total_tokens=4096,
    dtype="float32",
)


#: Greedy tokens compared per request in the example and the end-to-end tests.
GREEDY_TOKENS = 16


def cpu_env(kernels: str = "torch", tp_size: int = 1, nnodes: int = 1) -> dict[str, str]:
    """Environment for an intel_xpu run on CPU: the CPU engine, the kernel selector and, for
    ``--tp-size tp_size`` (over ``--nnodes nnodes`` hosts), what SGLang's CPU engine needs to run this
    host's ranks (:func:`sglang_cpu_devsupport.tensor_parallel.tp_env`). Pass the same ``tp_size`` to
    the engine or server (:func:`engine_kwargs` / :func:`server_argv` ``tp_size=...``).

    Raises ``ValueError`` when this host's ranks outnumber the cores this process may use."""
    return {**CPU_ENGINE_ENV, "SGLANG_XPU_LORA_KERNELS": kernels, **tensor_parallel.tp_env(tp_size, nnodes)}


def engine_kwargs(paths: dict[str, Path], adapters: Sequence[str], **overrides) -> dict:
    """``sglang.Engine`` keyword arguments serving ``adapters`` through ``intel_xpu`` on CPU;
    ``overrides`` replace any of them."""
    return {
        "model_path": str(paths["base"]),
        "enable_lora": True,
        "lora_paths": [f"{name}={paths[name]}" for name in adapters],
        "lora_backend": "intel_xpu",
        "max_lora_rank": 32,
        "max_loras_per_batch": len(adapters) + 1,
        "log_level": "error",
        **CPU_ENGINE_SETTINGS,
        **overrides,
    }


def sglang_console_script() -> str:
    """SGLang's ``sglang`` console script installed next to this interpreter."""
    return str(Path(sys.executable).parent / "sglang")


def server_argv(paths: dict[str, Path], adapters: Sequence[str], port: int, **overrides) -> list[str]:
    """``sglang serve`` command line equivalent to :func:`engine_kwargs` (with the same ``overrides``)."""
    kwargs = engine_kwargs(paths, adapters, **overrides)
    argv = [sglang_console_script(), "serve", "--host", "127.0.0.1", "--port", str(port)]
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif isinstance(value, list):
            argv += [flag, *value]
        else:
            argv += [flag, str(value)]
    return argv + ["--served-model-name", "tiny-llama"]


def first_token_logprobs(meta_info: dict, vocab_size: int):
    """Dense ``(vocab_size,)`` float64 log-probs of the first generated token from SGLang's
    ``output_top_logprobs`` (requested with ``top_logprobs_num=vocab_size``)."""
    import torch

    dense = torch.full((vocab_size,), float("-inf"), dtype=torch.float64)
    for logprob, token_id, *_ in meta_info["output_top_logprobs"][0]:
        dense[token_id] = logprob
    return dense


def hf_reference(base_dir: Path, adapter_dir: Optional[Path], input_ids: Sequence[int], max_new_tokens: int):
    """Transformers (+ PEFT when ``adapter_dir``) in float32: first-token log-probs over the whole
    vocabulary (float64 tensor) and ``max_new_tokens`` greedy token ids (no EOS stop)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    ids = torch.tensor([list(input_ids)])
    tokens: list[int] = []
    first = None
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(ids).logits[0, -1].to(torch.float64)
            if first is None:
                first = torch.log_softmax(logits, dim=-1)
            next_id = int(torch.argmax(logits))
            tokens.append(next_id)
            ids = torch.cat([ids, torch.tensor([[next_id]])], dim=1)
    return first, tokens


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class HTTPStatusError(RuntimeError):
    """A non-2xx answer; ``status`` and ``body`` hold what the server said."""

    def __init__(self, url: str, status: int, body: str):
        super().__init__(f"{url}: HTTP {status}: {body[:500]}")
        self.status, self.body = status, body


def post_json(url: str, payload: dict, timeout: float = 120.0) -> dict:
    """POST ``payload`` as JSON and return the decoded answer; raises :class:`HTTPStatusError`."""
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise HTTPStatusError(url, exc.code, exc.read().decode(errors="replace")) from None


def post_when_drained(url: str, payload: dict, timeout: float = 120.0) -> dict:
    """:func:`post_json`, retried on HTTP 400 for up to ``timeout`` seconds: SGLang drains an
    unloaded adapter's in-flight requests before its name can be loaded again and answers 400
    meanwhile; retry as a client would."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return post_json(url, payload)
        except HTTPStatusError as exc:
            if exc.status != 400 or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@contextlib.contextmanager
def started_process(argv: Sequence[str], env: dict, log_path: Path) -> Iterator[subprocess.Popen]:
    """Start ``argv`` (an SGLang server or one node of a multi-node server) in its own session with
    its own ``$TMPDIR`` (its IPC sockets), output to ``log_path``; yield the process; always stop it
    and its whole process group (:func:`stop_server`), then remove the SGLang ``/dev/shm`` files its
    processes mapped (read while they ran) and its ``$TMPDIR``."""
    log = open(log_path, "w")
    tmpdir = tempfile.mkdtemp(prefix="sglang-server-")
    proc = subprocess.Popen(
        list(argv), env={**os.environ, **env, "TMPDIR": tmpdir}, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    proc.shm_files = set()  # filled by wait_until_healthy and before the stop
    try:
        yield proc
    finally:
        proc.shm_files |= leftovers.server_files(proc.pid)
        stop_server(proc)
        log.close()
        leftovers.remove(proc.shm_files)
        shutil.rmtree(tmpdir, ignore_errors=True)


def wait_until_healthy(proc: subprocess.Popen, port: int, log_path: Path, timeout: float = 240.0) -> None:
    """Wait until ``/health_generate`` on ``127.0.0.1:port`` answers 200 (the model served a request;
    on a multi-node server's other nodes, their schedulers are ready); raises ``RuntimeError`` if
    the process exits first, ``TimeoutError`` after ``timeout`` seconds. Then records the SGLang
    ``/dev/shm`` files the process tree maps (for :func:`started_process` to remove)."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health_generate", timeout=30) as r:
                if r.status == 200:
                    break
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server is not ready after {timeout:.0f} s; see {log_path}")
        time.sleep(1.0)
    proc.shm_files = getattr(proc, "shm_files", set()) | leftovers.server_files(proc.pid)


@contextlib.contextmanager
def running_server(argv: Sequence[str], port: int, env: dict, log_path: Path, timeout: float = 240.0) -> Iterator[subprocess.Popen]:
    """:func:`started_process` that yields once the server is healthy (:func:`wait_until_healthy`):
    always stopped by its PID and process group, leaving no files behind."""
    with started_process(argv, env, log_path) as proc:
        wait_until_healthy(proc, port, log_path, timeout)
        yield proc


def process_group_rss(pgid: int) -> int:
    """Resident memory, in bytes, of every live process in process group ``pgid`` (the server
    started by :func:`running_server`: launcher, scheduler, detokenizer), read from ``/proc``."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:  # fields after the command: state, ppid, pgrp, ...
                continue
            status = (stat.parent / "status").read_text()
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


def stop_server(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM the server by PID; then SIGKILL whatever is left of its process group (scheduler,
    detokenizer, resource tracker) and wait until the group is gone."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
    kill_process_group(proc.pid)
    proc.wait(10)


def kill_process_group(pgid: int, wait: float = 15.0) -> None:
    """SIGKILL every process of process group ``pgid`` (a process started with
    ``start_new_session=True`` and all it started) and wait up to ``wait`` seconds until none is left."""
    deadline = time.monotonic() + wait
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
        while time.monotonic() < deadline:
            os.killpg(pgid, 0)  # raises ProcessLookupError once no member is left
            time.sleep(0.2)
