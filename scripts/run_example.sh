#!/usr/bin/env bash
# The CPU demo: set up the environment ($SGLANG_XPU_LORA_VENV, default .venv) from scratch if
# needed, then serve LoRA adapters through intel_xpu with a real SGLang engine and server on CPU
# (examples/serve_lora_cpu.py; its options pass through, --help prints them without a set-up).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SGLANG_XPU_LORA_VENV:-.venv}
for arg in "$@"; do
  if [ "$arg" = "-h" ] || [ "$arg" = "--help" ]; then
    python=$VENV/bin/python
    [ -x "$python" ] || python=${PYTHON:-python3}
    exec "$python" examples/serve_lora_cpu.py --help
  fi
done
bash scripts/setup_cpu_env.sh
exec "$VENV/bin/python" examples/serve_lora_cpu.py "$@"
