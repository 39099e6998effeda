#!/usr/bin/env bash
# Build the development/CI environment from scratch in ./.venv (idempotent: a completed build is
# reused when none of the requirement files changed). Installs the host stack the product wheel
# never installs itself: torch, SGLang 0.5.23 (--no-deps: its metadata pins the CUDA sgl-kernel
# wheel) with the dependencies its CPU path needs, the dev-support shims, this package, and the
# test/reference stack (pytest, transformers, peft).
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

echo "[setup] creating $VENV with $PY"
rm -rf "$VENV"
"$PY" -m venv "$VENV"
# pip, minus this machine's notes about absent local index folders.
pip() { "$VENV/bin/python" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==$TORCH_VERSION" >"$constraints"

echo "[setup] 1/4 torch $TORCH_VERSION"
pip install -q "torch==$TORCH_VERSION"
echo "[setup] 2/4 sglang $SGLANG_VERSION (--no-deps) and its CPU-path dependencies"
pip install -q --no-deps "sglang==$SGLANG_VERSION"
pip install -q -c "$constraints" -r requirements/sglang-0.5.23-cpu.txt
echo "[setup] 3/4 dev-support shims, sglang-xpu-lora (editable)"
pip install -q -c "$constraints" -e devsupport -e .
echo "[setup] 4/4 test and reference stack"
pip install -q -c "$constraints" -r requirements/test.txt
echo "$stamp_inputs" >"$VENV/.setup-complete"
echo "[setup] done: $("$VENV/bin/python" -c 'import torch, sglang, transformers, peft; print(f"torch {torch.__version__}, sglang {sglang.__version__}, transformers {transformers.__version__}, peft {peft.__version__}")')"
