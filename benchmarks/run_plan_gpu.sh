#!/usr/bin/env bash
# The H200 plan sweep or refinement as one device call: `bash benchmarks/run_plan_gpu.sh plan_sweep|plan_refine [ARGS]`
# (benchmarks/plan_sweep.py, benchmarks/plan_refine.py). Triton's cache is filled by 8 compile-only shards in
# parallel (for at most half of the call), then the timed run has the GPU alone, with `--budget-seconds` what is
# left of CALL_SECONDS (default 540, under the device tool's 600 s a call) less MARGIN (default 90: the last point
# or group started finishes), which overrides one given in ARGS. ARGS pass to every run. However the call ends,
# the plan tables and the module's results are tarred into $OUT/<module>.tar in the checkout's layout (untar it at
# the repository root before the next call, which carries them). Exits non-zero when the timed run failed.
# Needs the carry of benchmarks/prepare_gpu_carry.sh (.carry and .whl).
set -uo pipefail
cd "$(dirname "$0")/.."
module=${1:?plan_sweep or plan_refine}; shift
case $module in plan_sweep|plan_refine) ;; *) echo "unknown module $module (plan_sweep or plan_refine)" >&2; exit 2 ;; esac
source benchmarks/gpu_env.sh || exit 1
call=${CALL_SECONDS:-540} margin=${MARGIN:-90} start=$(date +%s)
trap 'tar -cf "$OUT/$module.tar" src/sglang_xpu_lora/dense/configs benchmarks/results/${module//_/-}-cuda*.json' EXIT
for i in 0 1 2 3 4 5 6 7; do
  timeout $(( call / 2 )) "$PYTHON" -m "benchmarks.$module" --device cuda --compile-only --shard $i/8 "$@" > /tmp/compile-$i.log 2>&1 &
done
wait
echo "[$module] compiled in $(( $(date +%s) - start )) s"; tail -n 2 /tmp/compile-*.log
budget=$(( call - margin - ($(date +%s) - start) ))
"$PYTHON" -m "benchmarks.$module" --device cuda "$@" --budget-seconds "$budget" 2>&1 | tail -n 40
status=${PIPESTATUS[0]}
echo "[$module] done in $(( $(date +%s) - start )) s (exit $status)"
exit "$status"
