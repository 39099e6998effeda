#!/usr/bin/env bash
# Regenerate requirements/lock-sglang-0.5.23-cpu.txt, the fully pinned CPU development/CI
# environment that scripts/setup_cpu_env.sh installs, with uv's resolver from:
# - requirements/sglang-0.5.23-cpu.in (SGLang and torch) and SGLang's own metadata, so every pin
#   of SGLang holds (tokenizers, python-dateutil, transformers, ...);
# - requirements/sglang-0.5.23-cpu-absent.txt as overrides: SGLang dependencies left out on purpose;
# - requirements/test.in and the dependencies in pyproject.toml and devsupport/pyproject.toml.
# The lock's current pins are kept where they still resolve; pass uv's --upgrade or
# --upgrade-package NAME to move them. Needs PyPI; uv is installed into a throwaway environment
# unless $UV names a uv binary.
set -euo pipefail
cd "$(dirname "$0")/.."
UV_VERSION=0.13.9
LOCK=requirements/lock-sglang-0.5.23-cpu.txt

if [ -z "${UV:-}" ]; then
  tool=$(mktemp -d)
  trap 'rm -rf "$tool"' EXIT
  "${PYTHON:-python3.11}" -m venv "$tool"
  "$tool/bin/python" -m pip install -q --disable-pip-version-check "uv==$UV_VERSION"
  UV=$tool/bin/uv
fi
"$UV" pip compile --quiet --python-version 3.11 --python-platform x86_64-manylinux_2_34 \
  --override requirements/sglang-0.5.23-cpu-absent.txt \
  --custom-compile-command "bash scripts/lock_cpu_env.sh" \
  --output-file "$LOCK" "$@" \
  requirements/sglang-0.5.23-cpu.in requirements/test.in pyproject.toml devsupport/pyproject.toml
echo "[lock] wrote $LOCK ($(grep -c '^[a-z0-9]' "$LOCK") packages)"
