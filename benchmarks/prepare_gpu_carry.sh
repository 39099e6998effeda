#!/usr/bin/env bash
# Assemble .carry/site (or the folder given as the first argument) for a GPU machine that has torch and Triton but not SGLang: SGLang's LoRA op
# files and LoRA backend classes from the local install (not committed) plus the stand-ins in
# benchmarks/gpu_standins (checked against the real modules by tests/unit/test_gpu_standins.py).
# The dense LoRA runner of triton_v2 also needs pydantic and msgspec there: their cp312 wheels, at
# the CPU lock's versions, are downloaded into .whl (or the folder given as the second argument;
# "-" skips it), which benchmarks/gpu_env.sh installs there. SGLang is the one $PYTHON imports
# (default: .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
src=$("$python" -c 'import sglang, os; print(os.path.dirname(sglang.__file__))')
site=${1:-.carry/site}
rm -rf "$site" && mkdir -p "$site"
cp -r benchmarks/gpu_standins/sglang "$site/"
# Triton kernels: the legacy dense ops (triton, csgmv) and the common ops of the dense runner
# (triton_v2), with its plan tables.
cp -r "$src/kernels/ops/lora/dense" "$src/kernels/ops/lora/common" "$site/sglang/kernels/ops/lora/"
rm -rf "$site/sglang/kernels/ops/lora/dense/trtllm_lora_temp"  # TRT-LLM's ops: no backend measured uses them
# SGLang's LoRA backend classes (intel_xpu's parent and the four peers) and what they run, the real
# files, over the stand-ins for what they import.
cp "$src/srt/lora/"{utils,workspace}.py "$site/sglang/srt/lora/"
cp -r "$src/srt/lora/dense" "$src/srt/lora/torch_ops" "$site/sglang/srt/lora/"
mkdir -p "$site/sglang/srt/lora/backend"
cp "$src/srt/lora/backend/"{base_backend,triton_backend,chunked_backend,triton_v2_backend,torch_backend,lmhead_mixing}.py \
  "$site/sglang/srt/lora/backend/"
find "$site" -name __pycache__ -prune -exec rm -rf {} +
echo "[carry] $(du -sh "$site" | cut -f1) in $site"
wheels=${2:-.whl}
if [[ $wheels != - ]]; then
  mkdir -p "$wheels" && rm -f "$wheels"/*.whl  # one version of each: pip refuses two
  mapfile -t pins < <(grep -E '^(pydantic|pydantic-core|annotated-types|typing-inspection|msgspec)==' requirements/lock-sglang-0.5.23-cpu.txt)
  "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d "$wheels" "${pins[@]}"
  echo "[carry] ${pins[*]} in $wheels"
fi
