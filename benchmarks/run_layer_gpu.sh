#!/usr/bin/env bash
# Layer-benchmark runs as one device call: `LABEL=graph-fused bash benchmarks/run_layer_gpu.sh RUNS [ARGS]` runs
# `$PYTHON -m benchmarks.layer --device $DEVICE ARGS` RUNS times, each kept as
# <out>/layer-<device>-runs/layer-<device>-$LABEL-run<i>.json with `--order-offset i` (each run its own order of
# paths). The call is budgeted to CALL_SECONDS (default 540, under the device tool's 600 s a call): each run gets
# `--budget-seconds` of its share of what is left, less 30 s, and a hard stop at CALL_SECONDS; a run whose share
# is under 30 s is not started. Runs of the label already there (carried back from an earlier call) are an error
# unless CONTINUE=1, which numbers the new runs on from them. Then, if no run left points out, every run of the
# label is merged point by point (`--best-of`, keeping the points of the modes they did not measure from
# <out>/layer-<device>.json) into <out>/layer-<device>.{json,md,png} (the plot where matplotlib is installed).
# After each run and however the call ends, short of a kill, the label's runs and the merge are tarred into
# $OUT/layer-$LABEL.tar in the checkout's layout (untar it at the repository root), beside the runs' log
# ($OUT/layer-$LABEL.log). <out>: $LAYER_OUT, default benchmarks/results; DEVICE: default cuda; PYTHON:
# benchmarks/gpu_env.sh. Needs the carry of benchmarks/prepare_gpu_carry.sh (.carry and .whl).
set -euo pipefail
start=$(date +%s)
cd "$(dirname "$0")/.."
runs=${1:?number of runs}; shift
device=${DEVICE:-cuda} label=${LABEL:?LABEL names the runs (e.g. graph-fused)} out=${LAYER_OUT:-benchmarks/results}
: "${OUT:?OUT: the folder that comes back}"
[[ $label =~ ^[A-Za-z0-9._-]+$ ]] || { echo "[layer] LABEL is letters, digits, '.', '_' and '-' (a file name): $label" >&2; exit 2; }
kept_as=$out/layer-$device-runs/layer-$device-$label-run call=${CALL_SECONDS:-540}
shopt -s nullglob
earlier_runs=("$kept_as"*.json)
if (( ${#earlier_runs[@]} )) && [[ ${CONTINUE:-} != 1 ]]; then
  echo "[layer] ${#earlier_runs[@]} runs of $label are there already (${earlier_runs[0]}...): set CONTINUE=1 to add to" \
    "them, or name new runs with another LABEL" >&2
  exit 2
fi
source benchmarks/gpu_env.sh
mkdir -p "$out/layer-$device-runs"
work=$(mktemp -d)
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
  if (( budget < 30 )); then
    echo "[layer] runs $i-$last not started: $budget s each left of CALL_SECONDS=$call" >&2
    break
  fi
  timeout -k 10 $(( call - ($(date +%s) - start) )) "$PYTHON" -m benchmarks.layer --device "$device" "$@" \
    --order-offset "$i" --out "$work/run$i" --budget-seconds "$budget" 2>&1 | tee -a "$OUT/layer-$label.log" | tail -n 3
  cp "$work/run$i"/layer-"$device"*.json "$kept_as$i.json"
  bring_back  # each run in $OUT as it ends: a call killed later still brings it back
  echo "[layer] run $i done at $(( $(date +%s) - start )) s"
done
kept=("$kept_as"*.json)
(( ${#kept[@]} )) || { echo "[layer] no run of $label to merge" >&2; exit 1; }
cut=$("$PYTHON" -c 'import json, sys; print(sum(json.load(open(f))["points_not_run"] > 0 for f in sys.argv[1:]))' "${kept[@]}")
if (( cut )); then  # merged by mode, the earlier points the runs did not reach would be dropped
  echo "[layer] $cut runs of $label left points out: not merged (the runs are in the tar)" >&2
  exit 1
fi
earlier=()
[[ -f $out/layer-$device.json ]] && earlier=(--keep-other-modes "$out/layer-$device.json")
"$PYTHON" -m benchmarks.layer --device "$device" --out "$out" --best-of "${kept[@]}" "${earlier[@]}"
echo "[layer] ${#kept[@]} runs of $label merged into $out/layer-$device.json, tarred into $OUT/layer-$label.tar"
