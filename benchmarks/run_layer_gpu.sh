#!/usr/bin/env bash
# Layer-benchmark runs as one device call: `LABEL=graph-fused bash benchmarks/run_layer_gpu.sh RUNS [ARGS]` runs
# `$PYTHON -m benchmarks.layer --device $DEVICE ARGS` RUNS times, each kept as
# <out>/layer-<device>-runs/layer-<device>-$LABEL-run<i>.json with `--order-offset i` (each run its own order of
# paths), i counting on from the runs of that label already there (carried from an earlier call), then merges every
# run of the label point by point (`--best-of`, keeping the points of the modes they did not measure from
# <out>/layer-<device>.json) into <out>/layer-<device>.{json,md,png}, and tars the label's runs and the merge into
# $OUT/layer-$LABEL.tar in the checkout's layout (untar it at the repository root). <out>: $LAYER_OUT, default
# benchmarks/results; DEVICE: default cuda; PYTHON: benchmarks/gpu_env.sh.
# Needs the carry of benchmarks/prepare_gpu_carry.sh (.carry and .whl).
set -euo pipefail
runs=${1:?number of runs}; shift
device=${DEVICE:-cuda} label=${LABEL:?LABEL names the runs (e.g. graph-fused)} out=${LAYER_OUT:-benchmarks/results}
source benchmarks/gpu_env.sh
work=$(mktemp -d) start=$(date +%s) kept_as=$out/layer-$device-runs/layer-$device-$label-run
mkdir -p "$out/layer-$device-runs"
shopt -s nullglob
earlier_runs=("$kept_as"*.json)
for i in $(seq $(( ${#earlier_runs[@]} + 1 )) $(( ${#earlier_runs[@]} + runs ))); do
  "$PYTHON" -m benchmarks.layer --device "$device" --order-offset "$i" --out "$work/run$i" "$@" 2>&1 | tail -n 3
  cp "$work/run$i"/layer-"$device"*.json "$kept_as$i.json"
  echo "[layer] run $i done at $(( $(date +%s) - start )) s"
done
kept=("$kept_as"*.json)
earlier=()
[[ -f $out/layer-$device.json ]] && earlier=(--keep-other-modes "$out/layer-$device.json")
"$PYTHON" -m benchmarks.layer --device "$device" --out "$out" --best-of "${kept[@]}" "${earlier[@]}"
tar -cf "${OUT:?OUT: the folder that comes back}/layer-$label.tar" "${kept[@]}" "$out/layer-$device".{json,md,png}
echo "[layer] ${#kept[@]} runs of $label merged into $out/layer-$device.json, tarred into $OUT/layer-$label.tar"
