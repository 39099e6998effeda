#!/usr/bin/env bash
# The README's test command: set up the environment ($SGLANG_XPU_LORA_VENV, default .venv) from
# scratch if needed, then run the whole suite (unit, integration against the pinned SGLang, end to
# end through a real engine and server on CPU, and the packaging check of the sdist and wheel).
# Any arguments are passed to pytest, e.g. -m "not e2e".
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SGLANG_XPU_LORA_VENV:-.venv}
bash scripts/setup_cpu_env.sh
exec "$VENV/bin/python" -m pytest "$@"
