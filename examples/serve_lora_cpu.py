"""CPU demo: a real SGLang engine and server serving LoRA adapters through --lora-backend intel_xpu.

1. Builds a tiny Llama model, its tokenizer and three PEFT LoRA adapters (ranks 4, 8 and 16, all
   below --max-lora-rank 32) locally; nothing is downloaded.
2. Serves one mixed batch (the base model and every adapter) with
   sglang.Engine(..., lora_backend="intel_xpu") on the portable PyTorch kernels, and prints each
   completion.
3. Compares the first token's log-probabilities over the whole vocabulary and 16 greedy tokens with
   Hugging Face transformers + PEFT.
4. Starts "sglang serve" on 127.0.0.1, checks /generate and /v1/completions against the engine's
   tokens, and /v1/chat/completions (through the OpenAI client, model "tiny-llama:<adapter>")
   against /generate on the chat-templated prompt, and stops the server. The tiny tokenizer has no
   chat template, so the server gets a minimal one (--chat-template); an instruction-tuned model
   brings its own.

The exit status is 0 when every check passes. The completions are gibberish on purpose (the model
is tiny and random): what matters is that they equal the reference token for token.
The terminal shows the demo's steps and results only; what SGLang, transformers and PEFT print
themselves (warnings, progress bars, logs of every process) goes to a log file (--log, default
<artifacts>/run_example.log), shown in full when the demo fails. The server's log is
<artifacts>/sglang_serve.log.
Run it with: bash scripts/run_example.sh (which sets up the environment first); add --tp-size 2
to shard the model over two tensor-parallel ranks (one CPU core each).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import TextIO

PROMPT = "def main(self):"
LOGPROB_TOLERANCE = 1e-4  # float32 engine vs float32 transformers, same weights
#: A minimal chat template for the tiny tokenizer, which has none (see the docstring).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Write a docstring for main."}]


class Terminal:
    """The demo's own lines on the terminal; everything else this process and the processes it
    starts write to stdout and stderr (SGLang's warnings and progress bars, library logs) goes to
    ``log_path``: file descriptors 1 and 2 point at the log, the terminal keeps a duplicate."""

    def __init__(self, log_path: Path):
        log_path.parent.mkdir(parents=True, exist_ok=True)
        sys.stdout.flush()
        sys.stderr.flush()
        self.log_path = log_path
        self.out: TextIO = os.fdopen(os.dup(1), "w", buffering=1)
        with open(log_path, "w") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)

    def print(self, text: str) -> None:
        self.out.write(text + "\n")

    def show_log(self) -> None:
        """The log in full, on the terminal (after a failure)."""
        sys.stdout.flush()
        sys.stderr.flush()
        self.print(f"--- {self.log_path} (SGLang's and the libraries' own output), in full ---")
        self.out.write(self.log_path.read_text(errors="replace"))
        self.print(f"--- end of {self.log_path} ---")


class Progress:
    def __init__(self, terminal: Terminal, total: int):
        self.terminal, self.total, self.step, self.start = terminal, total, 0, time.monotonic()

    def __call__(self, message: str) -> None:
        self.step += 1
        self.terminal.print(f"[{self.step}/{self.total} +{time.monotonic() - self.start:5.1f}s] {message}")

    def note(self, message: str) -> None:
        self.terminal.print(f"           {message}")


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="run_example.sh", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--artifacts", type=Path, default=Path("artifacts"), help="where the model and adapters are built (default: artifacts)")
    parser.add_argument("--skip-server", action="store_true", help="skip the sglang serve part")
    parser.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks, one CPU core each (default: 1)")
    parser.add_argument("--log", type=Path, default=None, help="where SGLang's own output goes (default: <artifacts>/run_example.log)")
    args = parser.parse_args()

    # Imported after parsing, so that --help works without the environment.
    from sglang_cpu_devsupport import serving

    try:
        env = serving.cpu_env("torch", tp_size=args.tp_size)
    except ValueError as exc:
        parser.error(str(exc))
    terminal = Terminal(args.log or args.artifacts / "run_example.log")
    terminal.print(f"SGLang's own output (warnings, progress bars, logs) goes to {terminal.log_path}")
    try:
        failures = demo(args, env, terminal)
    except BaseException:  # noqa: BLE001 - shown with the log, then the demo fails
        traceback.print_exc()  # into the log
        failures = ["the demo raised (the traceback is at the end of the log)"]
    if failures:
        terminal.show_log()
        terminal.print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    terminal.print("OK: intel_xpu served every adapter and matched transformers + PEFT.")
    return 0


def demo(args: argparse.Namespace, env: dict, terminal: Terminal) -> list[str]:
    """The demo's steps (see the module docstring); returns the failed checks."""
    from sglang_cpu_devsupport import leftovers, serving, tiny_model

    max_new_tokens = serving.GREEDY_TOKENS
    os.environ.update(env)

    progress = Progress(terminal, total=5)
    progress("building the tiny model, tokenizer and adapters (reused when already built)")
    paths = tiny_model.build_all(args.artifacts, progress=progress.note)
    adapters = list(tiny_model.ADAPTER_NAMES)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(paths["base"])
    input_ids = tokenizer.encode(PROMPT)
    loras = [None, *adapters]

    progress(f"starting sglang.Engine with lora_backend='intel_xpu' (portable kernels) on CPU, tp_size={args.tp_size}")
    import sglang

    engine = sglang.Engine(**serving.engine_kwargs(paths, adapters, tp_size=args.tp_size))
    # SGLang's engine installs a SIGTERM handler that only flags a graceful exit; restore the
    # default so `timeout` or a CI cancel still stops this script (the finally blocks still run
    # for Ctrl-C, and the server is started in its own process group).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        progress(f"one mixed batch: base + {len(adapters)} adapters, {max_new_tokens} greedy tokens each")
        outputs = engine.generate(
            input_ids=[input_ids] * len(loras),
            lora_path=loras,
            sampling_params={"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
            return_logprob=True,
            top_logprobs_num=tiny_model.VOCAB_SIZE,
        )
    finally:
        leftovers.shutdown_engine(engine)  # also removes the files SGLang leaves behind
    engine_tokens = {lora: out["output_ids"] for lora, out in zip(loras, outputs)}

    failures = []
    for lora, out in zip(loras, outputs):
        label = lora or "base"
        ref_logprobs, ref_tokens = serving.hf_reference(
            paths["base"], paths[lora] if lora else None, input_ids, max_new_tokens
        )
        got = serving.first_token_logprobs(out["meta_info"], tiny_model.VOCAB_SIZE)
        delta = float((got - ref_logprobs).abs().max())
        same = out["output_ids"] == ref_tokens
        terminal.print(f"  {label:>8}: {PROMPT!r} -> {out['text']!r}")
        terminal.print(f"            max |Δ logprob| vs transformers+PEFT = {delta:.2e}; greedy tokens identical: {same}")
        if not (delta <= LOGPROB_TOLERANCE and same):
            failures.append(f"{label}: Δ={delta:.2e}, tokens identical={same}")

    if args.skip_server:
        progress("skipping sglang serve (--skip-server)")
    else:
        port = serving.free_port()
        progress(f"starting sglang serve on 127.0.0.1:{port}")
        chat_template = args.artifacts / "chat_template.jinja"
        chat_template.write_text(CHAT_TEMPLATE)
        argv = serving.server_argv(paths, adapters, port, tp_size=args.tp_size, chat_template=str(chat_template))
        log_path = args.artifacts / "sglang_serve.log"
        with serving.running_server(argv, port, env, log_path) as proc:
            progress.note(f"server ready (pid {proc.pid}); sending /generate, /v1/completions, /v1/chat/completions")
            base_url = f"http://127.0.0.1:{port}"
            params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
            generated = serving.post_json(
                f"{base_url}/generate",
                {"input_ids": [input_ids] * len(loras), "lora_path": loras, "sampling_params": params},
            )
            for lora, out in zip(loras, generated):
                ok = out["output_ids"] == engine_tokens[lora]
                terminal.print(f"  /generate        {lora or 'base':>8}: tokens equal the engine's: {ok}")
                if not ok:
                    failures.append(f"/generate {lora}: {out['output_ids']} != {engine_tokens[lora]}")
            for lora in adapters:
                completion = serving.post_json(
                    f"{base_url}/v1/completions",
                    {"model": f"tiny-llama:{lora}", "prompt": PROMPT, "max_tokens": max_new_tokens,
                     "temperature": 0.0, "ignore_eos": True},
                )
                expected = tokenizer.decode(engine_tokens[lora])
                ok = completion["choices"][0]["text"] == expected
                terminal.print(f"  /v1/completions  {lora:>8}: text equals the engine's tokens: {ok}")
                if not ok:
                    failures.append(f"/v1/completions {lora}: {completion['choices'][0]['text']!r} != {expected!r}")
            failures += check_chat(base_url, tokenizer, loras, params, terminal)
        progress.note(f"server (pid {proc.pid}) stopped with exit code {proc.returncode}")

    progress("summary")
    return failures


def check_chat(base_url: str, tokenizer, loras: list, params: dict, terminal: Terminal) -> list[str]:
    """The README's OpenAI-client chat example for each of ``loras`` (``None``: the base model),
    against ``/generate`` with the same adapter on the chat-templated prompt's token ids. Prints a
    line per adapter; returns the failures."""
    from openai import OpenAI

    from sglang_cpu_devsupport import serving

    chat_ids = tokenizer.apply_chat_template(
        MESSAGES, chat_template=CHAT_TEMPLATE, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    generated = serving.post_json(
        f"{base_url}/generate", {"input_ids": [chat_ids] * len(loras), "lora_path": loras, "sampling_params": params}
    )
    client = OpenAI(base_url=f"{base_url}/v1", api_key="EMPTY")
    failures = []
    for lora, out in zip(loras, generated):
        reply = client.chat.completions.create(
            model=f"tiny-llama:{lora}" if lora else "tiny-llama", messages=MESSAGES,
            max_tokens=params["max_new_tokens"], temperature=0, extra_body={"ignore_eos": True},
        )
        got, expected = reply.choices[0].message.content, tokenizer.decode(out["output_ids"])
        ok = got == expected and reply.usage.prompt_tokens == len(chat_ids)
        terminal.print(f"  /v1/chat/completions {lora or 'base':>8}: text equals /generate's on the templated prompt: {ok}")
        if not ok:
            failures.append(f"/v1/chat/completions {lora}: {got!r} != {expected!r} ({reply.usage.prompt_tokens} prompt ids)")
    return failures


if __name__ == "__main__":
    sys.exit(main())
