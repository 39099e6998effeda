#!/usr/bin/env bash
# Upstream LoRA serving scenarios on a real Intel XPU machine (not run in CI): Llama-3.1-8B-Instruct
# with 4-8 adapters, sglang.bench_serving random workloads, comparing --lora-backend intel_xpu,
# triton and csgmv in one run. Needs SGLang built for XPU, sgl-kernel-xpu (sgl_kernel) with the
# LoRA ops, and sglang-xpu-lora installed; check first with `sglang-xpu-lora doctor`.
#
#   MODEL=meta-llama/Llama-3.1-8B-Instruct ADAPTERS="a=/path/a b=/path/b c=/path/c d=/path/d" \
#       bash examples/xpu/bench_serving.sh
#
# Writes results/<backend>-<scenario>.jsonl (bench_serving's output) and a summary table.
set -euo pipefail
MODEL=${MODEL:?set MODEL to the base model path or hub id}
ADAPTERS=${ADAPTERS:?set ADAPTERS to "name=path ..." (4 to 8 adapters)}
BACKENDS=${BACKENDS:-"intel_xpu triton csgmv"}
PORT=${PORT:-30000}
MAX_RANK=${MAX_RANK:-64}
OUT=${OUT:-results}
mkdir -p "$OUT"
read -r -a adapter_list <<<"$ADAPTERS"
names=$(printf '%s\n' "${adapter_list[@]}" | cut -d= -f1 | paste -sd, -)

sglang-xpu-lora doctor || { echo "doctor says intel_xpu cannot serve here; fix that first" >&2; exit 1; }

for backend in $BACKENDS; do
  python -m sglang.launch_server --model-path "$MODEL" --device xpu --host 127.0.0.1 --port "$PORT" \
      --enable-lora --lora-paths "${adapter_list[@]}" --max-lora-rank "$MAX_RANK" \
      --max-loras-per-batch "${#adapter_list[@]}" --lora-backend "$backend" &
  server=$!
  trap 'kill $server 2>/dev/null || true' EXIT
  until curl -sf "http://127.0.0.1:$PORT/health_generate" >/dev/null; do
    kill -0 $server 2>/dev/null || { echo "server for $backend exited" >&2; exit 1; }
    sleep 5
  done
  # prefill: random 512-in / 8-out at concurrency 8; decode: 16-in / 64-out at concurrency 128.
  for scenario in "prefill 512 8 8 256" "decode 16 64 128 1024"; do
    read -r name input output concurrency prompts <<<"$scenario"
    python -m sglang.bench_serving --backend sglang --host 127.0.0.1 --port "$PORT" \
        --dataset-name random --random-input-len "$input" --random-output-len "$output" --random-range-ratio 1 \
        --num-prompts "$prompts" --max-concurrency "$concurrency" --lora-name "${names//,/ }" --seed 1 \
        --output-file "$OUT/$backend-$name.jsonl"
  done
  kill $server; wait $server 2>/dev/null || true
  trap - EXIT
done
python - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("| backend | scenario | output tok/s | median TTFT ms | median ITL ms |\n|---|---|---|---|---|")
for f in sorted(out.glob("*.jsonl")):
    r = json.loads(f.read_text().splitlines()[-1])
    backend, scenario = f.stem.rsplit("-", 1)
    print(f"| {backend} | {scenario} | {r['output_throughput']:.0f} | {r['median_ttft_ms']:.1f} | {r['median_itl_ms']:.2f} |")
PY
