#!/usr/bin/env bash
# Serve one base model with several LoRA adapters through --lora-backend intel_xpu on an Intel GPU,
# in the foreground (Ctrl-C stops it). Checks the machine with `sglang-xpu-lora doctor` first.
#
#   MODEL=meta-llama/Llama-3.1-8B-Instruct ADAPTERS="sql=/adapters/sql doc=/adapters/doc" \
#       bash examples/xpu/serve_multi_lora.sh
#
# Then pick an adapter per request, e.g. "model": "meta-llama/Llama-3.1-8B-Instruct:sql" on
# /v1/completions or "lora_path": "sql" on /generate (README, Quick start).
#
# Settings, from the environment (the defaults are for an Intel GPU):
#   MODEL                    base model: a path or a hub id (required)
#   ADAPTERS                 "name=path name=path ...": PEFT LoRA adapters (required)
#   DEVICE=xpu               SGLang's --device
#   LORA_BACKEND=intel_xpu   --lora-backend (another one to compare, e.g. triton)
#   SGLANG_XPU_LORA_KERNELS  which kernels intel_xpu uses: auto (default), native, triton or torch
#   MAX_LORA_RANK=64         at least the largest adapter rank
#   MAX_LORAS_PER_BATCH      adapters one batch may use; default: the number of adapters + 1
#   TP_SIZE=1                GPUs to shard the model over (tensor parallelism)
#   HOST=127.0.0.1 PORT=30000
#   EXTRA_ARGS               more `sglang serve` arguments, e.g. for a test run on CPU:
#                            "--attention-backend torch_native --max-total-tokens 4096";
#                            "--cuda-graph-backend-decode full" turns XPU decode graphs on
#                            (off by default in SGLang 0.5.23 on XPU)
#   SGLANG=sglang            the sglang command
#
# SGLang 0.5.23 leaves a small /dev/shm/sglang_loads_*.shm file and IPC socket files in $TMPDIR
# after every server; they can be deleted once the server has stopped (bench_serving.sh does).
set -euo pipefail
MODEL=${MODEL:?set MODEL to the base model path or hub id}
ADAPTERS=${ADAPTERS:?set ADAPTERS to "name=path ..."}
DEVICE=${DEVICE:-xpu}
LORA_BACKEND=${LORA_BACKEND:-intel_xpu}
MAX_LORA_RANK=${MAX_LORA_RANK:-64}
TP_SIZE=${TP_SIZE:-1}
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-30000}
SGLANG=${SGLANG:-sglang}
read -r -a adapter_list <<<"$ADAPTERS"
read -r -a extra_args <<<"${EXTRA_ARGS:-}"
MAX_LORAS_PER_BATCH=${MAX_LORAS_PER_BATCH:-$((${#adapter_list[@]} + 1))}

if [ "$LORA_BACKEND" = intel_xpu ]; then
  sglang-xpu-lora doctor --device "$DEVICE" || { echo "sglang-xpu-lora doctor says intel_xpu cannot serve on $DEVICE here; fix that first" >&2; exit 1; }
fi
exec "$SGLANG" serve --model-path "$MODEL" --device "$DEVICE" --host "$HOST" --port "$PORT" \
    --enable-lora --lora-paths "${adapter_list[@]}" --max-lora-rank "$MAX_LORA_RANK" \
    --max-loras-per-batch "$MAX_LORAS_PER_BATCH" --lora-backend "$LORA_BACKEND" --tp-size "$TP_SIZE" \
    "${extra_args[@]}"
