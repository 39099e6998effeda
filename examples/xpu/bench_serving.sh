#!/usr/bin/env bash
# SGLang's serving benchmark (python -m sglang.benchmark.serving) against a multi-adapter server,
# once per LoRA backend and decode mode, on an Intel GPU: by default --lora-backend intel_xpu, triton
# and csgmv, each eager (SGLang 0.5.23's default on XPU: decode graphs are opt-in there) and with XPU
# decode graphs (NAME+graphs: --cuda-graph-backend-decode full), with random prompts for a
# prefill-heavy and a decode-heavy scenario, each request picking one of the adapters at random. Each server is started with serve_multi_lora.sh (all its settings apply:
# DEVICE, MAX_LORA_RANK, TP_SIZE, EXTRA_ARGS, SGLANG_XPU_LORA_KERNELS, ...), stopped afterwards,
# and leaves nothing behind.
#
#   MODEL=meta-llama/Llama-3.1-8B-Instruct ADAPTERS="a=/path/a b=/path/b c=/path/c d=/path/d" \
#       bash examples/xpu/bench_serving.sh
#
# More settings, from the environment:
#   BACKENDS="intel_xpu intel_xpu+graphs triton triton+graphs csgmv csgmv+graphs"
#                            the --lora-backend values to compare; NAME+graphs runs NAME with
#                            --cuda-graph-backend-decode full (decode steps captured in XPU graphs)
#   SCENARIOS="prefill 512 8 8 256; decode 16 64 128 1024"
#                            "name input-tokens output-tokens concurrency prompts; ..."
#   PORT=30000  OUT=results  PYTHON=python  READY_TIMEOUT=1200 (seconds to wait for a server)
#
# Writes $OUT/<backend>-<scenario>.jsonl (the benchmark's output), $OUT/<backend>-server.log, and
# prints a summary table.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
MODEL=${MODEL:?set MODEL to the base model path or hub id}
ADAPTERS=${ADAPTERS:?set ADAPTERS to "name=path ..." (4 to 8 adapters)}
BACKENDS=${BACKENDS:-"intel_xpu intel_xpu+graphs triton triton+graphs csgmv csgmv+graphs"}
SCENARIOS=${SCENARIOS:-"prefill 512 8 8 256; decode 16 64 128 1024"}
PORT=${PORT:-30000}
OUT=${OUT:-results}
PYTHON=${PYTHON:-python}
READY_TIMEOUT=${READY_TIMEOUT:-1200}
export MODEL ADAPTERS PORT
mkdir -p "$OUT"
read -r -a adapter_list <<<"$ADAPTERS"
names=()
for adapter in "${adapter_list[@]}"; do names+=("${adapter%%=*}"); done

server=""
server_tmp=""
# The server runs in its own session (so its whole process group can be stopped) with its own
# $TMPDIR (its IPC sockets); SGLang never removes its /dev/shm load-snapshot file, so the files its
# processes map are noted while it runs and removed after it stopped.
start_server() {
  local backend=${1%+graphs} extra=${EXTRA_ARGS:-}
  [ "$backend" = "$1" ] || extra="$extra --cuda-graph-backend-decode full"
  server_tmp=$(mktemp -d)
  LORA_BACKEND=$backend EXTRA_ARGS=$extra HOST=127.0.0.1 TMPDIR=$server_tmp setsid bash "$here/serve_multi_lora.sh" >"$OUT/$1-server.log" 2>&1 &
  server=$!
  local waited=0
  until curl -sf "http://127.0.0.1:$PORT/health_generate" >/dev/null; do
    if ! kill -0 "$server" 2>/dev/null || [ "$waited" -ge "$READY_TIMEOUT" ]; then
      echo "the $1 server did not come up; last lines of $OUT/$1-server.log:" >&2
      tail -n 20 "$OUT/$1-server.log" >&2
      exit 1
    fi
    sleep 2
    waited=$((waited + 2))
  done
}
stop_server() {
  [ -n "$server" ] || return 0
  local shm_files pid waited=0
  shm_files=$(for pid in $(pgrep -s "$server"); do cat "/proc/$pid/maps" 2>/dev/null || true; done |
              grep -o '/dev/shm/sglang_[^ ]*' | sort -u || true)
  kill -TERM -- "-$server" 2>/dev/null || true
  while pgrep -s "$server" >/dev/null && [ "$waited" -lt 30 ]; do sleep 1; waited=$((waited + 1)); done
  kill -KILL -- "-$server" 2>/dev/null || true
  wait "$server" 2>/dev/null || true
  [ -z "$shm_files" ] || rm -f $shm_files
  rm -rf "$server_tmp"
  server=""
}
trap stop_server EXIT

for backend in $BACKENDS; do
  echo "== --lora-backend $backend"
  start_server "$backend"
  IFS=';' read -r -a scenarios <<<"$SCENARIOS"
  for scenario in "${scenarios[@]}"; do
    read -r name input output concurrency prompts <<<"$scenario"
    rm -f "$OUT/$backend-$name.jsonl"
    # random-ids: random token ids, nothing to download; every adapter name is its own argument.
    "$PYTHON" -m sglang.benchmark.serving --backend sglang --host 127.0.0.1 --port "$PORT" --model "$MODEL" \
        --dataset-name random-ids --random-input-len "$input" --random-output-len "$output" --random-range-ratio 1 \
        --num-prompts "$prompts" --max-concurrency "$concurrency" --lora-name "${names[@]}" --seed 1 \
        --disable-tqdm --output-file "$OUT/$backend-$name.jsonl"
  done
  stop_server
done
"$PYTHON" - "$OUT" $BACKENDS <<'PY'
import json, pathlib, sys
out, backends = pathlib.Path(sys.argv[1]), sys.argv[2:]
print("| backend | scenario | requests completed | output tok/s | median TTFT ms | median ITL ms |")
print("|---|---|---|---|---|---|")
for backend in backends:
    for f in sorted(out.glob(f"{backend}-*.jsonl")):
        r = json.loads(f.read_text().splitlines()[-1])
        scenario = f.stem[len(backend) + 1:]
        print(f"| {backend} | {scenario} | {r['completed']} | {r['output_throughput']:.0f} | {r['median_ttft_ms']:.1f} | {r['median_itl_ms']:.2f} |")
PY
