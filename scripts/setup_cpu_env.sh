#!/usr/bin/env bash
# Build the development/CI environment from scratch in ./.venv, or in $SGLANG_XPU_LORA_VENV
# (idempotent: a completed build is reused when none of the requirement files changed). Installs the
# host stack the product wheel never installs itself: torch, SGLang 0.5.23 (--no-deps: its metadata
# pins the CUDA sgl-kernel wheel) with the dependencies its CPU path needs, the dev-support shims,
# this package, and the test/reference stack (pytest, transformers, peft).
#
# Prints one line per step with its duration; pip's own output (including its expected notes about
# SGLang dependencies that are deliberately not installed) goes to $VENV/setup.log.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SGLANG_XPU_LORA_VENV:-.venv}
PY=${PYTHON:-python3.11}
TORCH_VERSION=2.14.1   # the torch SGLang 0.5.23 pins; a CUDA build that also runs on CPU
SGLANG_VERSION=0.5.23

stamp_inputs=$(cat requirements/*.txt pyproject.toml devsupport/pyproject.toml scripts/setup_cpu_env.sh | sha256sum | cut -c1-16)
if [ -f "$VENV/.setup-complete" ] && [ "$(cat "$VENV/.setup-complete")" = "$stamp_inputs" ]; then
  echo "[setup] $VENV is up to date"
  exit 0
fi

rm -rf "$VENV"
mkdir -p "$VENV"
LOG="$VENV/setup.log"
: >"$LOG"
setup_start=$SECONDS

# step LABEL COMMAND...: run COMMAND with its output in $LOG; one line with the step's duration, or
# the log's tail and path on failure.
step() {
  local label=$1 start=$SECONDS
  shift
  printf '[setup] %-62s' "$label"
  echo "=== $label: $*" >>"$LOG"
  if "$@" >>"$LOG" 2>&1; then
    printf '%4d s\n' $((SECONDS - start))
  else
    printf 'FAILED after %d s\n' $((SECONDS - start))
    echo "[setup] last lines of $LOG:" >&2
    tail -n 25 "$LOG" >&2
    echo "[setup] failed; the full output is in $LOG" >&2
    exit 1
  fi
}
pip() { PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off "$VENV/bin/python" -m pip "$@"; }
constraints="$VENV/constraints.txt"
echo "torch==$TORCH_VERSION" >"$constraints"

echo "[setup] building $VENV (pip output: $LOG)"
step "0/4 virtual environment ($PY)" "$PY" -m venv "$VENV"
step "1/4 torch $TORCH_VERSION" pip install "torch==$TORCH_VERSION"
step "2/4 sglang $SGLANG_VERSION (--no-deps)" pip install --no-deps "sglang==$SGLANG_VERSION"
step "    sglang's CPU-path dependencies" pip install -c "$constraints" -r requirements/sglang-0.5.23-cpu.txt
step "3/4 dev-support shims, sglang-xpu-lora (editable)" pip install -c "$constraints" -e devsupport -e .
step "4/4 test and reference stack" pip install -c "$constraints" -r requirements/test.txt
echo "$stamp_inputs" >"$VENV/.setup-complete"
versions=$("$VENV/bin/python" -c 'import torch, sglang, transformers, peft; print(f"torch {torch.__version__}, sglang {sglang.__version__}, transformers {transformers.__version__}, peft {peft.__version__}")')
echo "[setup] done in $((SECONDS - setup_start)) s: $versions"
