#!/usr/bin/env bash
# Build the development/CI environment from scratch in ./.venv, or in $SGLANG_XPU_LORA_VENV
# (idempotent: a completed build is reused when none of the requirement files changed). Installs the
# host stack the product wheel never installs itself, from the lock
# requirements/lock-sglang-0.5.23-cpu.txt (every package pinned; scripts/lock_cpu_env.sh regenerates
# it): torch 2.14.1, SGLang 0.5.23 with the dependencies its CPU path needs, pytest, transformers and
# peft; then the dev-support shims and this package (editable). All with --no-deps: SGLang's
# metadata also names CUDA kernels (the sgl-kernel wheel among them) that the CPU path never loads,
# listed in requirements/sglang-0.5.23-cpu-absent.txt. The last step, scripts/check_cpu_env.py,
# fails unless `pip check` finds every pin kept but for exactly those.
#
# Prints one line per step with its duration; pip's own output goes to $VENV/setup.log.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SGLANG_XPU_LORA_VENV:-.venv}
PY=${PYTHON:-python3.11}
LOCK=requirements/lock-sglang-0.5.23-cpu.txt

stamp_inputs=$(cat requirements/* pyproject.toml devsupport/pyproject.toml scripts/setup_cpu_env.sh scripts/check_cpu_env.py | sha256sum | cut -c1-16)
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

echo "[setup] building $VENV (pip output: $LOG)"
step "0/3 virtual environment ($PY)" "$PY" -m venv "$VENV"
step "1/3 torch, sglang, CPU-path and test deps (the lock)" pip install --no-deps -r "$LOCK"
step "2/3 dev-support shims, sglang-xpu-lora (editable)" pip install --no-deps -e devsupport -e .
step "3/3 pip check, but for SGLang's deps left out on purpose" "$VENV/bin/python" scripts/check_cpu_env.py
echo "$stamp_inputs" >"$VENV/.setup-complete"
versions=$("$VENV/bin/python" -c 'import torch, sglang, transformers, peft; print(f"torch {torch.__version__}, sglang {sglang.__version__}, transformers {transformers.__version__}, peft {peft.__version__}")')
echo "[setup] done in $((SECONDS - setup_start)) s: $versions"
