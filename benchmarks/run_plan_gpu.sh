#!/usr/bin/env bash
# The H200 plan sweep or refinement as one device run: `bash benchmarks/run_plan_gpu.sh plan_sweep|plan_refine [ARGS]`
# (benchmarks/plan_sweep.py, benchmarks/plan_refine.py). Triton's cache is filled by 8 compile-only
# shards in parallel, then the timed run has the GPU alone, then the table and the results are
# tarred into $OUT (<module>.tar). ARGS pass to every run.
# Needs the carry of benchmarks/prepare_gpu_carry.sh (.carry and .whl).
set -uo pipefail
module=${1:?plan_sweep or plan_refine}; shift
case $module in plan_sweep|plan_refine) ;; *) echo "unknown module $module (plan_sweep or plan_refine)" >&2; exit 2 ;; esac
source benchmarks/gpu_env.sh
start=$(date +%s)
for i in 0 1 2 3 4 5 6 7; do
  "$PYTHON" -m "benchmarks.$module" --device cuda --compile-only --shard $i/8 "$@" > /tmp/compile-$i.log 2>&1 &
done
wait
echo "[$module] compiled in $(( $(date +%s) - start )) s"; tail -n 2 /tmp/compile-*.log
"$PYTHON" -m "benchmarks.$module" --device cuda "$@" 2>&1 | tail -n 40
echo "[$module] done in $(( $(date +%s) - start )) s"
tar -cf "$OUT/$module.tar" src/sglang_xpu_lora/dense/configs benchmarks/results/${module//_/-}-cuda*.json
