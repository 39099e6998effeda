"""The GPU carry of the benchmarks (benchmarks/prepare_gpu_carry.sh): SGLang's real LoRA files over
the stand-ins of benchmarks/gpu_standins, for a GPU machine with torch and Triton but no SGLang.
Checked here against the real modules: the carry imports every backend the benchmarks build, each
name a carried real file imports at module level exists in the carry, and each stand-in's names
exist in the real module (``ForwardMode``'s predicates answering as the real ones)."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STANDINS = REPO / "benchmarks" / "gpu_standins"


@pytest.fixture(scope="module")
def carry(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("carry") / "site"
    subprocess.run(
        ["bash", "benchmarks/prepare_gpu_carry.sh", str(site), "-"],  # no wheels: offline
        cwd=REPO,
        env={**os.environ, "PYTHON": sys.executable},  # this SGLang (the sdist's tests have no .venv)
        check=True,
        capture_output=True,
    )
    return site


def test_the_carry_imports_every_backend(carry):
    code = (
        "import sglang, sys\n"
        f"assert sglang.__file__.startswith({str(carry)!r}), sglang.__file__\n"
        "from sglang.srt.lora.backend.triton_backend import TritonLoRABackend\n"
        "from sglang.srt.lora.backend.chunked_backend import ChunkedSgmvLoRABackend\n"
        "from sglang.srt.lora.backend.triton_v2_backend import TritonV2LoRABackend\n"
        "from sglang.srt.lora.backend.torch_backend import TorchNativeLoRABackend\n"
        "import torch\n"
        "TritonV2LoRABackend(8, torch.device('cpu'))  # reads the plan tables\n"
        "from sglang_xpu_lora.backend.xpu import IntelXpuLoRABackend\n"
        "import benchmarks.layer, benchmarks.triton_peers, benchmarks.plan_sweep, benchmarks.plan_refine\n"
        "import benchmarks.launch_tiles\n"
        "from sglang.kernels.jit.utils import is_arch_support_pdl\n"
        "from sglang_xpu_lora.dense.runner import DeviceDenseRunner\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(carry), str(REPO / "src"), str(REPO)])}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]


def _module_file(root: Path, module: str):
    path = root.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def _top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def test_every_module_level_import_of_the_carried_files_resolves_in_the_carry(carry):
    missing = []
    for path in sorted(carry.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if not (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.level == 0
                and node.module.startswith("sglang.")
            ):
                continue
            target = _module_file(carry, node.module)
            if target is None:
                missing.append(f"{path.relative_to(carry)}: module {node.module}")
                continue
            defined = _top_level_names(target)
            for alias in node.names:
                if (
                    alias.name not in defined
                    and _module_file(carry, f"{node.module}.{alias.name}") is None
                ):
                    missing.append(f"{path.relative_to(carry)}: {node.module}.{alias.name}")
    assert not missing, missing


def _standin_modules() -> list[str]:
    return sorted(
        ".".join(p.relative_to(STANDINS).with_suffix("").parts)
        for p in STANDINS.rglob("*.py")
        if p.name != "__init__.py"
    )


@pytest.mark.parametrize("module", _standin_modules())
def test_stand_in_names_exist_in_the_real_module(module):
    real = importlib.import_module(module)
    names = _top_level_names(STANDINS.joinpath(*module.split(".")).with_suffix(".py"))
    public = {n for n in names if not n.startswith("_")}
    stand_in_only = {"enum", "types", "torch", "annotations"}  # the stand-ins' own imports
    assert not [n for n in public - stand_in_only if not hasattr(real, n)]


def test_forward_mode_stand_in_answers_as_sglangs(tmp_path):
    """Each predicate of the stand-in ``ForwardMode`` gives the real one's answer for each mode."""
    from sglang.srt.model_executor import forward_batch_info as real

    spec = importlib.util.spec_from_file_location(
        "forward_batch_info_standin", STANDINS / "sglang/srt/model_executor/forward_batch_info.py"
    )
    standin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(standin)
    predicates = [n for n in vars(standin.ForwardMode) if n.startswith("is_")]
    assert len(predicates) >= 7
    for mode in standin.ForwardMode:
        for name in predicates:
            assert getattr(mode, name)() == getattr(real.ForwardMode[mode.name], name)(), (
                mode,
                name,
            )
