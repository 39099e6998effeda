#!/usr/bin/env bash
# The H200 plan sweep or refinement as one device call: `bash benchmarks/run_plan_gpu.sh plan_sweep|plan_refine [ARGS]`
# (benchmarks/plan_sweep.py, benchmarks/plan_refine.py). The call is budgeted to CALL_SECONDS (default 540, under
# the device tool's 600 s a call) less MARGIN (default 90: the last point or group started finishes): Triton's
# cache is filled by 8 compile-only shards in parallel for at most half of that, then the timed run has the GPU
# alone, with `--budget-seconds` what is left (overriding one in ARGS; no timed run when under 30 s) and a hard
# stop at CALL_SECONDS. ARGS pass to every run. However the call ends, short of a kill, the plan tables and the
# module's results (`<module>-cuda*.json` under benchmarks/results) are tarred into $OUT/<module>.tar in the
# checkout's layout (untar it at the repository root before the next call, which carries them), beside the timed
# run's log ($OUT/<module>.log). Exits with the timed run's status.
# Needs the carry of benchmarks/prepare_gpu_carry.sh (.carry and .whl).
set -uo pipefail
start=$(date +%s)
cd "$(dirname "$0")/.."
module=${1:?plan_sweep or plan_refine}; shift
case $module in plan_sweep|plan_refine) ;; *) echo "unknown module $module (plan_sweep or plan_refine)" >&2; exit 2 ;; esac
: "${OUT:?OUT: the folder that comes back}"
call=${CALL_SECONDS:-540} margin=${MARGIN:-90}
source benchmarks/gpu_env.sh || exit 1
trap 'tar -cf "$OUT/$module.tar" src/sglang_xpu_lora/dense/configs benchmarks/results/${module//_/-}-cuda*.json' EXIT
for i in 0 1 2 3 4 5 6 7; do
  timeout $(( (call - margin) / 2 )) "$PYTHON" -m "benchmarks.$module" --device cuda --compile-only --shard $i/8 "$@" \
    > /tmp/compile-$i.log 2>&1 &
done
wait
echo "[$module] compiled in $(( $(date +%s) - start )) s"; tail -n 2 /tmp/compile-*.log
budget=$(( call - margin - ($(date +%s) - start) ))
if (( budget < 30 )); then
  echo "[$module] $budget s left of CALL_SECONDS=$call: no timed run" >&2
  exit 1
fi
timeout -k 10 $(( call - ($(date +%s) - start) )) "$PYTHON" -m "benchmarks.$module" --device cuda "$@" --budget-seconds "$budget" \
  2>&1 | tee "$OUT/$module.log" | tail -n 40
status=${PIPESTATUS[0]}
echo "[$module] done in $(( $(date +%s) - start )) s (exit $status)"
exit "$status"
