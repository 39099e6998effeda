#!/usr/bin/env bash
# The README's main job: set up .venv from scratch if needed, then serve LoRA adapters through
# intel_xpu with a real SGLang engine and server on CPU (examples/serve_lora_cpu.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu_env.sh
exec .venv/bin/python examples/serve_lora_cpu.py "$@"
