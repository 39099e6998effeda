# Sourced by the device-run scripts (benchmarks/run_plan_gpu.sh, benchmarks/run_layer_gpu.sh) on a GPU
# machine with torch and Triton but no SGLang: the cp312 wheels in $WHEELS, default .whl (pydantic, msgspec: docs/performance.md,
# "Reproducing") installed into /tmp/site (offline, replacing what an earlier call installed), then the carry of
# benchmarks/prepare_gpu_carry.sh, this checkout's package, its dev-support shims and the benchmarks on
# PYTHONPATH, one Triton cache in the checkout, and $PYTHON (default python3) the interpreter the scripts run.
# Returns non-zero when the install fails, or without wheels (triton_v2, the peer every figure is measured
# against, would not run) unless NO_WHEELS_OK=1.
export PYTHON=${PYTHON:-python3}
wheels=${WHEELS:-.whl}
if compgen -G "$wheels/*.whl" > /dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --upgrade --target /tmp/site "$wheels"/*.whl || return 1
elif [[ ${NO_WHEELS_OK:-} != 1 ]]; then
  echo "[gpu_env] no wheels in $wheels: triton_v2 would not run (benchmarks/prepare_gpu_carry.sh downloads them; carry .whl)," \
    "or set NO_WHEELS_OK=1" >&2
  return 1
fi
export PYTHONPATH=.carry/site:src:devsupport/src:.:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton-cache}
mkdir -p "$TRITON_CACHE_DIR"
