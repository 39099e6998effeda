"""``sglang-xpu-lora doctor`` for a full, a partial and no kernel build (fresh processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sglang_cpu_devsupport import kernel_emulator
from sglang_xpu_lora.providers.base import OP_NAMES


def doctor(*args, **env):
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_XPU_LORA")}
    child_env.update({"SGLANG_USE_CPU_ENGINE": "1", **env})
    return subprocess.run(
        [sys.executable, "-m", "sglang_xpu_lora.doctor", "doctor", *args],
        env=child_env, capture_output=True, text=True, timeout=300,
    )


def providers_of(report):
    return {op["op"]: (op["provider"], op["graph_provider"], op["capture_safe"]) for op in report["ops"]}


def test_full_build():
    result = doctor("--json", **{kernel_emulator.BUILD_ENV: "full"})
    report = json.loads(result.stdout)
    assert result.returncode == 0 and report["can_serve"], report["problems"]
    ops = providers_of(report)
    assert set(ops) == set(OP_NAMES)
    assert ops["embedding_lora_a_fwd"] == ("native", "native", True)
    assert all(ops[op] == ("native", "torch", False) for op in OP_NAMES if op != "embedding_lora_a_fwd")
    assert all(p["found"] for p in report["patch_points"]) and len(report["patch_points"]) > 10
    assert report["sglang"] == "0.5.23" and report["xpu_visible"] is False


def test_partial_build_in_auto_and_native_mode():
    auto = doctor("--json", **{kernel_emulator.BUILD_ENV: "v0.1.0"})
    report = json.loads(auto.stdout)
    assert auto.returncode == 0
    native = {op for op, (provider, _, _) in providers_of(report).items() if provider == "native"}
    assert native == {"embedding_lora_a_fwd", "sgemm_lora_a_fwd"}
    reason = {op["op"]: op["reason"] for op in report["ops"]}["qkv_lora_b_fwd"]
    assert "native op missing: not in the installed build (first in an sgl-kernel-xpu build with PR #393" in reason

    strict = doctor(**{kernel_emulator.BUILD_ENV: "v0.1.0", "SGLANG_XPU_LORA_KERNELS": "native"})
    assert strict.returncode == 1
    assert "CANNOT SERVE --lora-backend intel_xpu:" in strict.stdout
    assert "sgl-kernel-xpu op sgemm_lora_b_fwd is unavailable" in strict.stdout


@pytest.mark.parametrize("kernels, status", [("auto", 1), ("torch", 0)])
def test_no_build(kernels, status):
    result = doctor(SGLANG_XPU_LORA_KERNELS=kernels)
    assert result.returncode == status, result.stdout + result.stderr[-2000:]
    assert "kernel build  sgl_kernel 0.0.0+cpu-devsupport-stub" in result.stdout
    assert "SGLang patch points: " in result.stdout and " found" in result.stdout
    if status:
        assert "--lora-backend intel_xpu requires --device xpu, got --device cpu" in result.stdout
    else:
        assert "OK: --lora-backend intel_xpu can serve on this machine." in result.stdout
        assert result.stdout.count("  torch / torch ") == len(OP_NAMES)
