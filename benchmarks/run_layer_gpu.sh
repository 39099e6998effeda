#!/usr/bin/env bash
# Layer-benchmark runs as one device call: `LABEL=graph-fused bash benchmarks/run_layer_gpu.sh RUNS [ARGS]` runs
# `$PYTHON -m benchmarks.layer --device $DEVICE ARGS` RUNS times, each kept as
# <out>/layer-<device>-runs/layer-<device>-$LABEL-run<i>.json with `--order-offset i` (each run its own order of
# paths) and a `--budget-seconds` of its share of what is left of CALL_SECONDS (default 540, under the device tool's
# 600 s a call; overrides one in ARGS). Runs of the label already there (carried back from an earlier call) are
# an error unless CONTINUE=1, which numbers the new runs on from them. Then every run of the label is merged point
# by point (`--best-of`, keeping the points of the modes they did not measure from <out>/layer-<device>.json) into
# <out>/layer-<device>.{json,md,png} (the plot where matplotlib is installed). After each run and however the call
# ends, the label's runs and the merge are tarred into $OUT/layer-$LABEL.tar in the checkout's layout (untar it at
# the repository root). <out>: $LAYER_OUT, default benchmarks/results; DEVICE: default cuda; PYTHON: benchmarks/gpu_env.sh.
# Needs the carry of benchmarks/prepare_gpu_carry.sh (.carry and .whl).
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:?number of runs}; shift
device=${DEVICE:-cuda} label=${LABEL:?LABEL names the runs (e.g. graph-fused)} out=${LAYER_OUT:-benchmarks/results}
: "${OUT:?OUT: the folder that comes back}"
source benchmarks/gpu_env.sh
kept_as=$out/layer-$device-runs/layer-$device-$label-run call=${CALL_SECONDS:-540} start=$(date +%s) work=$(mktemp -d)
shopt -s nullglob
earlier_runs=("$kept_as"*.json)
if (( ${#earlier_runs[@]} )) && [[ ${CONTINUE:-} != 1 ]]; then
  echo "[layer] ${#earlier_runs[@]} runs of $label are there already (${earlier_runs[0]}...): set CONTINUE=1 to add to" \
    "them, or name new runs with another LABEL" >&2
  exit 2
fi
mkdir -p "$out/layer-$device-runs"
bring_back() {
  local files=() file
  for file in "$kept_as"*.json "$out/layer-$device".{json,md,png}; do
    if [[ -e $file ]]; then files+=("$file"); fi
  done
  if (( ${#files[@]} )); then tar -cf "$OUT/layer-$label.tar" "${files[@]}"; fi
}
trap 'bring_back; rm -rf "$work"' EXIT
first=$(( ${#earlier_runs[@]} + 1 )) last=$(( ${#earlier_runs[@]} + runs ))
for i in $(seq "$first" "$last"); do
  budget=$(( (call - ($(date +%s) - start)) / (last - i + 1) - 30 ))
  "$PYTHON" -m benchmarks.layer --device "$device" --order-offset "$i" --out "$work/run$i" "$@" --budget-seconds "$budget" \
    2>&1 | tail -n 3
  cp "$work/run$i"/layer-"$device"*.json "$kept_as$i.json"
  bring_back  # each run in $OUT as it ends: a call killed later still brings it back
  echo "[layer] run $i done at $(( $(date +%s) - start )) s"
done
kept=("$kept_as"*.json)
earlier=()
[[ -f $out/layer-$device.json ]] && earlier=(--keep-other-modes "$out/layer-$device.json")
"$PYTHON" -m benchmarks.layer --device "$device" --out "$out" --best-of "${kept[@]}" "${earlier[@]}"
echo "[layer] ${#kept[@]} runs of $label merged into $out/layer-$device.json, tarred into $OUT/layer-$label.tar"
