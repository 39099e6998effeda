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
Run it with: bash scripts/run_example.sh (which sets up the environment first); add --tp-size 2
to shard the model over two tensor-parallel ranks (one CPU core each).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

PROMPT = "def main(self):"
LOGPROB_TOLERANCE = 1e-4  # float32 engine vs float32 transformers, same weights
#: A minimal chat template for the tiny tokenizer, which has none (see the docstring).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Write a docstring for main."}]


class Progress:
    def __init__(self, total: int):
        self.total, self.step, self.start = total, 0, time.monotonic()

    def __call__(self, message: str) -> None:
        self.step += 1
        print(f"[{self.step}/{self.total} +{time.monotonic() - self.start:5.1f}s] {message}", flush=True)

    def note(self, message: str) -> None:
        print(f"           {message}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="run_example.sh", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--artifacts", type=Path, default=Path("artifacts"), help="where the model and adapters are built (default: artifacts)")
    parser.add_argument("--skip-server", action="store_true", help="skip the sglang serve part")
    parser.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks, one CPU core each (default: 1)")
    args = parser.parse_args()

    # Imported after parsing, so that --help works without the environment.
    from sglang_cpu_devsupport import leftovers, serving, tiny_model

    max_new_tokens = serving.GREEDY_TOKENS
    try:
        env = serving.cpu_env("torch", tp_size=args.tp_size)
    except ValueError as exc:
        parser.error(str(exc))
    os.environ.update(env)

    progress = Progress(total=5)
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
        print(f"  {label:>8}: {PROMPT!r} -> {out['text']!r}")
        print(f"            max |Δ logprob| vs transformers+PEFT = {delta:.2e}; greedy tokens identical: {same}")
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
                print(f"  /generate        {lora or 'base':>8}: tokens equal the engine's: {ok}")
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
                print(f"  /v1/completions  {lora:>8}: text equals the engine's tokens: {ok}")
                if not ok:
                    failures.append(f"/v1/completions {lora}: {completion['choices'][0]['text']!r} != {expected!r}")
            failures += check_chat(base_url, tokenizer, loras, params)
        progress.note(f"server (pid {proc.pid}) stopped with exit code {proc.returncode}")

    progress("summary")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    print("OK: intel_xpu served every adapter and matched transformers + PEFT.")
    return 0


def check_chat(base_url: str, tokenizer, loras: list, params: dict) -> list[str]:
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
        print(f"  /v1/chat/completions {lora or 'base':>8}: text equals /generate's on the templated prompt: {ok}")
        if not ok:
            failures.append(f"/v1/chat/completions {lora}: {got!r} != {expected!r} ({reply.usage.prompt_tokens} prompt ids)")
    return failures


if __name__ == "__main__":
    sys.exit(main())
