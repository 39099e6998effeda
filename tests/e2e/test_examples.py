"""Every example script, run end to end on CPU as a user would, leaving nothing behind.

- ``examples/serve_lora_cpu.py`` (the CPU demo behind ``scripts/run_example.sh``): an engine and
  an ``sglang serve`` server, checked against transformers + PEFT; its output must end with its
  ``OK`` line (no ``resource_tracker`` warning or ``KeyError`` traceback after it) and hold only
  the demo's own lines: SGLang's warnings and progress bars are in the log it names.
- ``examples/xpu/bench_serving.sh``, which starts each server with
  ``examples/xpu/serve_multi_lora.sh``: with the device, the kernel selector and the sizes set for
  this CPU machine and the tiny model, for ``intel_xpu`` and SGLang's ``torch_native``. Every
  request picks one of the adapters; with all names passed as one argument (the old bug) the
  server would fail them, so ``completed`` counts them.
- The README's command that serves the demo's model and adapters by hand on the CPU, as written
  (with the chat template the demo writes): every adapter answers as transformers + PEFT, with the
  small KV cache the README promises, and the README's chat request after it answers as
  ``/generate`` on the chat-templated prompt.

Each run gets a private ``/dev/shm`` and ``$TMPDIR`` (``tests/sandbox.py``) that must be empty
afterwards.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import sys
from pathlib import Path

import pytest
from sandbox import run_leaving_nothing

from sglang_cpu_devsupport import serving, tiny_model

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
ALARMING = ("Traceback", "KeyError", "resource_tracker", "leaked", "Error")
#: Every line the CPU demo prints itself (examples/serve_lora_cpu.py).
DEMO_LINE = re.compile(
    r"SGLang's own output \(warnings, progress bars, logs\) goes to (?P<log>\S+)"
    r"|\[\d/5 \+ *\d+\.\ds\] \S.*"  # a step
    r"| {11}\S.*"  # a note under a step
    r"| +(base|[\w-]+): 'def main\(self\):' -> .*"  # an engine completion
    r"| {12}max \|Δ logprob\| vs transformers\+PEFT = .*"
    r"|  (/generate|/v1/completions|/v1/chat/completions) .*: (True|False)"
    r"|OK: intel_xpu served every adapter and matched transformers \+ PEFT\."
)


def user_env(**extra) -> dict:
    """This environment with the venv's scripts first on PATH (as after ``source .venv/bin/activate``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_XPU_LORA")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return {**env, **extra}


def test_cpu_example(tiny_artifacts, tmp_path):
    artifacts = tiny_artifacts["base"].parent  # the example reuses the session's tiny model and adapters
    result, left = run_leaving_nothing(
        [sys.executable, str(REPO / "examples" / "serve_lora_cpu.py"), "--artifacts", str(artifacts)],
        user_env(), tmp_path / "tmp", timeout=900,
    )
    assert result.returncode == 0, result.stdout[-4000:]
    lines = result.stdout.rstrip().splitlines()
    assert lines[-1] == "OK: intel_xpu served every adapter and matched transformers + PEFT.", result.stdout[-3000:]
    assert "starting sglang serve on 127.0.0.1:" in result.stdout
    # The README's chat example (OpenAI client, model "<base>:<adapter>"), for the base and each adapter.
    chat = [line.split(":", 1)[0].split()[-1] for line in lines if "/v1/chat/completions" in line and line.endswith(": True")]
    assert chat == ["base", *tiny_model.ADAPTER_NAMES], result.stdout[-3000:]
    assert not [word for word in ALARMING if word in result.stdout], result.stdout[-3000:]
    assert left == [], f"the example left {left} behind"
    # Only the demo's own lines (stderr included); SGLang's warnings and progress bars are in its log.
    assert [line for line in lines if not DEMO_LINE.fullmatch(line)] == [], result.stdout[-3000:]
    log = Path(DEMO_LINE.fullmatch(lines[0])["log"])
    assert log == artifacts / "run_example.log"
    sglangs = log.read_text()
    assert "Only CUDA, HIP and XPU support AWQ currently." in sglangs and "Multi-thread loading shards" in sglangs


def readme_block(after: str) -> str:
    """The first ``bash`` code block of README.md after the text ``after``."""
    text = (REPO / "README.md").read_text()
    return text[text.index(after):].split("```bash\n", 1)[1].split("```", 1)[0]


def demo_chat_template() -> str:
    """The chat template the CPU demo writes to ``artifacts/chat_template.jinja``."""
    spec = importlib.util.spec_from_file_location("serve_lora_cpu", REPO / "examples" / "serve_lora_cpu.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    return demo.CHAT_TEMPLATE


def test_readme_cpu_serve_command(tiny_artifacts, hf_reference, tokenizer, tmp_path):
    artifacts = tiny_artifacts["base"].parent
    port = serving.free_port()
    template = tmp_path / "chat_template.jinja"  # as the demo leaves it in artifacts/
    template.write_text(demo_chat_template())
    command = (
        readme_block("To serve them by hand on the CPU:")
        .replace(".venv/bin/", f"{Path(sys.executable).parent}/")
        .replace("artifacts/chat_template.jinja", str(template))
        .replace("artifacts/", f"{artifacts}/")
        .replace("--port 30000", f"--port {port}")
    )
    words = shlex.split(command.replace("\\\n", " "))
    lora_paths = words[words.index("--lora-paths") + 1 : words.index("--max-lora-rank")]
    adapters = {name: Path(path).name for name, path in (pair.split("=") for pair in lora_paths)}
    assert sorted(adapters.values()) == sorted(tiny_model.ADAPTER_NAMES), command

    log = tmp_path / "server.log"
    with serving.started_process(["bash", "-c", command], {}, log) as server:
        serving.wait_until_healthy(server, port, log, timeout=600)
        prompt = "The quick brown fox"
        for name, lora in [(None, None), *adapters.items()]:
            out = serving.post_json(
                f"http://127.0.0.1:{port}/generate",
                {"input_ids": tokenizer.encode(prompt), "lora_path": name,
                 "sampling_params": {"temperature": 0.0, "max_new_tokens": serving.GREEDY_TOKENS, "ignore_eos": True}},
            )
            assert out["output_ids"] == hf_reference(prompt, lora)[1], name
        curl = readme_block("the adapter after it:")  # the README's chat request to this server
        chat = json.loads(curl.split("-d '", 1)[1].rsplit("'", 1)[0])
        base, adapter = chat["model"].split(":")
        assert base == words[words.index("--served-model-name") + 1] and adapter in adapters, chat["model"]
        reply = serving.post_json(f"http://127.0.0.1:{port}/v1/chat/completions", chat)
        templated = tokenizer.apply_chat_template(
            chat["messages"], chat_template=template.read_text(), add_generation_prompt=True, tokenize=True,
            return_dict=False,
        )
        out = serving.post_json(
            f"http://127.0.0.1:{port}/generate",
            {"input_ids": templated, "lora_path": adapter,
             "sampling_params": {"temperature": 0.0, "max_new_tokens": chat["max_tokens"]}},
        )
        assert reply["choices"][0]["message"]["content"] == out["text"], (reply, out)
    assert "KV Cache is allocated. dtype: torch.float32, #tokens: 4096," in log.read_text()


def test_bench_serving_script_on_cpu(tiny_artifacts, tmp_path):
    adapters = list(tiny_model.ADAPTER_NAMES)
    out = tmp_path / "results"
    env = user_env(
        **serving.cpu_env("torch"),
        MODEL=str(tiny_artifacts["base"]),
        ADAPTERS=" ".join(f"{name}={tiny_artifacts[name]}" for name in adapters),
        DEVICE="cpu",
        BACKENDS="intel_xpu torch_native",
        MAX_LORA_RANK="32",
        EXTRA_ARGS="--attention-backend torch_native --cuda-graph-backend-decode disabled --max-total-tokens 4096 --dtype float32",
        SCENARIOS="decode 16 8 4 8",
        PORT=str(serving.free_port()),
        OUT=str(out),
        PYTHON=sys.executable,
        READY_TIMEOUT="600",
    )
    result, left = run_leaving_nothing(
        ["bash", str(REPO / "examples" / "xpu" / "bench_serving.sh")], env, tmp_path / "tmp", timeout=900
    )
    assert result.returncode == 0, result.stdout[-4000:]
    server_log = (out / "intel_xpu-server.log").read_text()
    assert "OK: --lora-backend intel_xpu can serve on this machine." in server_log  # doctor ran first
    for backend in ("intel_xpu", "torch_native"):
        report = json.loads((out / f"{backend}-decode.jsonl").read_text().splitlines()[-1])
        assert report["completed"] == 8, (backend, report)
        assert f"| {backend} | decode | 8 |" in result.stdout
        server_args = (out / f"{backend}-server.log").read_text()  # SGLang logs its arguments
        assert f"'lora_backend': '{backend}'" in server_args
    assert left == [], f"the benchmark left {left} behind"
