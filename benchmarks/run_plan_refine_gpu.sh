#!/usr/bin/env bash
# The H200 plan refinement as one device run (benchmarks/plan_refine.py): Triton's cache filled by 8
# compile-only shards in parallel, then the timed refinement alone on the GPU, then the table and
# results tarred into $OUT (refine.tar). Arguments pass to the timed run.
# Needs the carry of benchmarks/prepare_gpu_carry.sh and cp312 wheels in .whl (docs/performance.md).
set -uo pipefail
pip install -q --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=.carry/site:src:devsupport/src:.:/tmp/site TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton-cache}
mkdir -p "$TRITON_CACHE_DIR"
start=$(date +%s)
for i in 0 1 2 3 4 5 6 7; do
  python3 -m benchmarks.plan_refine --device cuda --compile-only --shard $i/8 > /tmp/compile-$i.log 2>&1 &
done
wait
echo "[refine] compiled in $(( $(date +%s) - start )) s"; tail -n 2 /tmp/compile-*.log
python3 -m benchmarks.plan_refine --device cuda "$@" 2>&1 | tail -n 40
echo "[refine] done in $(( $(date +%s) - start )) s"
tar -cf "$OUT/refine.tar" src/sglang_xpu_lora/dense/configs benchmarks/results/plan-refine-cuda.json
