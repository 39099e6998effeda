#!/usr/bin/env bash
# The README's test command: set up .venv from scratch if needed, then run the whole suite
# (unit, integration against the pinned SGLang, end to end through a real engine and server on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu_env.sh
exec .venv/bin/python -m pytest "$@"
