#!/usr/bin/env bash
# Check and measure --lora-backend intel_xpu on this machine (an Intel GPU by default) and write one
# report to attach to an issue: doctor, the capture probe, the op benchmark (intel_xpu against
# SGLang's triton and csgmv kernels, eager and in XPU graphs, adapter ranks below and at
# --max-lora-rank), the layer benchmark (one decoder layer with its base GEMMs through every SGLang
# LoRA backend, triton_v2 included, and intel_xpu), the plan sweep (every candidate plan of the
# dense tier timed per linear on this GPU, written as a plan table), the layer benchmark again with
# that table (intel_xpu with it against SGLang's default table, point by point), the host-sync
# cost, the scale benchmark (8 then 1,000 adapters over 64 slots, one server of a tiny Llama per LoRA
# backend that runs on the device: time to first token and tokens/s against the adapter count) and
# SGLang's serving benchmark (with MODEL and ADAPTERS).
# A failing step is recorded in the report; the others still run. Run it from a checkout of this
# repository, in the Python environment that serves (torch XPU, SGLang, sglang-xpu-lora):
#
#   bash examples/xpu/measure.sh                      # -> sglang-xpu-lora-report/sglang-xpu-lora-report.md
#   MODEL=meta-llama/Llama-3.1-8B-Instruct ADAPTERS="a=/path/a b=/path/b c=/path/c d=/path/d" \
#       bash examples/xpu/measure.sh
#   bash examples/xpu/measure.sh --skip plan_sweep,layer_tuned    # without the sweep (its longest step)
#   bash examples/xpu/measure.sh --steps scale        # only the scale benchmark (-> scale-xpu.json)
#   bash examples/xpu/measure.sh --dry-run            # the steps' commands, nothing run
#
# The plan table lands in the report folder (sglang-xpu-lora-report/xpu.plans.json); serve with it:
#
#   SGLANG_XPU_LORA_PLANS=$PWD/sglang-xpu-lora-report/xpu.plans.json sglang serve ... --lora-backend intel_xpu
#
# Settings, from the environment: OUT=sglang-xpu-lora-report (the folder), DEVICE=xpu,
# MODEL, ADAPTERS, QUICK=1 (the smallest sizes: a first look in minutes), PYTHON=python;
# bench_serving.sh's own (BACKENDS, SCENARIOS, PORT, MAX_LORA_RANK, EXTRA_ARGS, ...) apply to the
# serving step. More options (--steps, --skip, --step-timeout, --sweep-compile-jobs, --dry-run):
# python -m benchmarks.kit --help; any given here are passed on.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
args=(--device "${DEVICE:-xpu}" --out "$(realpath -m "${OUT:-sglang-xpu-lora-report}")")
[ -z "${MODEL:-}" ] || args+=(--model "$MODEL")
[ -z "${ADAPTERS:-}" ] || args+=(--adapters "$ADAPTERS")
[ -z "${QUICK:-}" ] || args+=(--quick)
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python}" -m benchmarks.kit "${args[@]}" "$@"
