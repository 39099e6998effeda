#!/usr/bin/env bash
# Layer-benchmark runs as one device call: `LABEL=graph-fused bash benchmarks/run_layer_gpu.sh RUNS [ARGS]` runs
# `$PYTHON -m benchmarks.layer --device $DEVICE ARGS` RUNS times, run i with `--order-offset i` (each run its own
# order of paths), keeps each as <out>/layer-<device>-runs/layer-<device>-$LABEL-run<i>.json, merges them point by
# point (`--best-of`, keeping the points of the modes the runs did not measure from <out>/layer-<device>.json)
# into <out>/layer-<device>.{json,md,png}, and tars what it wrote into $OUT/layer-$LABEL.tar, in the checkout's
# layout (untar it at the repository root). <out>: $LAYER_OUT, default benchmarks/results; DEVICE: default cuda;
# PYTHON: benchmarks/gpu_env.sh.
# Needs the carry of benchmarks/prepare_gpu_carry.sh and cp312 wheels in .whl (benchmarks/gpu_env.sh).
set -euo pipefail
runs=${1:?number of runs}; shift
device=${DEVICE:-cuda} label=${LABEL:?LABEL names the runs (e.g. graph-fused)} out=${LAYER_OUT:-benchmarks/results}
source benchmarks/gpu_env.sh
work=$(mktemp -d) start=$(date +%s) kept=()
mkdir -p "$out/layer-$device-runs"
for i in $(seq 1 "$runs"); do
  "$PYTHON" -m benchmarks.layer --device "$device" --order-offset "$i" --out "$work/run$i" "$@" 2>&1 | tail -n 3
  result=$(ls "$work/run$i"/layer-"$device"*.json)
  kept+=("$out/layer-$device-runs/layer-$device-$label-run$i.json")
  cp "$result" "${kept[-1]}"
  echo "[layer] run $i of $runs done at $(( $(date +%s) - start )) s"
done
earlier=()
[[ -f $out/layer-$device.json ]] && earlier=(--keep-other-modes "$out/layer-$device.json")
"$PYTHON" -m benchmarks.layer --device "$device" --out "$out" --best-of "${kept[@]}" "${earlier[@]}"
tar -cf "${OUT:?OUT: the folder that comes back}/layer-$label.tar" "${kept[@]}" "$out/layer-$device".{json,md,png}
echo "[layer] $runs runs merged into $out/layer-$device.json, tarred into $OUT/layer-$label.tar"
