#!/usr/bin/env bash
# Assemble .carry/site for a GPU machine that has torch and Triton but not SGLang: SGLang's Triton
# LoRA op files and LoRA backend classes from the local install (not committed) plus the stand-ins in
# benchmarks/gpu_standins.
set -euo pipefail
cd "$(dirname "$0")/.."
src=$(.venv/bin/python -c 'import sglang, os; print(os.path.dirname(sglang.__file__))')
rm -rf .carry/site && mkdir -p .carry/site
cp -r benchmarks/gpu_standins/sglang .carry/site/
cp -r "$src/kernels/ops/lora/dense" .carry/site/sglang/kernels/ops/lora/
# SGLang's LoRA backend classes (intel_xpu's parent and the triton peer) and their batch helpers,
# the real files, over the stand-ins for what they import.
cp "$src/srt/lora/utils.py" .carry/site/sglang/srt/lora/
mkdir -p .carry/site/sglang/srt/lora/backend
cp "$src/srt/lora/backend/"{base_backend,triton_backend,lmhead_mixing}.py .carry/site/sglang/srt/lora/backend/
mkdir -p .carry/site/sglang/srt/lora/torch_ops
echo '"""Stand-in package: only lora_ops (torch_native eager ops) is carried."""' >.carry/site/sglang/srt/lora/torch_ops/__init__.py
cp "$src/srt/lora/torch_ops/lora_ops.py" .carry/site/sglang/srt/lora/torch_ops/
find .carry/site -name __pycache__ -prune -exec rm -rf {} +
echo "[carry] $(du -sh .carry/site | cut -f1) in .carry/site"
