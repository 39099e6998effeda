"""The package's layers (CONTRIBUTING.md, "Layers"): no module imports from a layer above its own,
and the ``sglang.lora_backends`` entry-point target imports neither torch nor SGLang.

Imports are read from the source (every ``import`` statement, those inside functions included), so
a lazy import that climbs a layer is caught as well as a module-level one.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PACKAGE = "sglang_xpu_lora"
SOURCE = Path(__file__).resolve().parents[2] / "src" / PACKAGE

#: Bottom to top; a module may import its own layer and the layers below it.
LAYERS = (
    # leaves: what SGLang offers (the symbol table and its guard), the backend registry, the
    # environment variables' names; none imports torch or SGLang at import time
    ("upstream", "registry", "settings", "__init__"),
    # the math and the adapter checks: LoRA ops and their selection, the dense tier, PEFT adapters
    ("providers", "adapters", "dense"),
    # the changes to SGLang (the patch ledger and its hooks)
    ("patches",),
    # the backend SGLang instantiates, and its entry-point declaration
    ("backend",),
    # the entry points that tie it together: SGLang's plugin hook and the doctor CLI
    ("plugin", "doctor"),
)
LAYER_OF = {part: level for level, parts in enumerate(LAYERS) for part in parts}


def top_part(module: str) -> str:
    """``sglang_xpu_lora.patches.mem_pool`` -> ``patches``; the package itself -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path, source: Path = SOURCE) -> str:
    relative = path.relative_to(source.parent).with_suffix("")
    parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
    return ".".join(parts)


def package_imports(path: Path, source: Path = SOURCE) -> set[str]:
    """Every ``sglang_xpu_lora`` module ``path`` imports, relative imports resolved."""
    this = module_name(path, source)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return {name for name in found if name == PACKAGE or name.startswith(PACKAGE + ".")}


def upward_imports(source: Path) -> list[str]:
    problems = []
    for path in sorted(source.rglob("*.py")):
        importer = module_name(path, source)
        importer_level = LAYER_OF[top_part(importer)]
        for imported in sorted(package_imports(path, source)):
            part = top_part(imported)
            if part in LAYER_OF and LAYER_OF[part] > importer_level:
                problems.append(f"{importer} (layer {importer_level}) imports {imported} (layer {LAYER_OF[part]})")
    return problems


def test_every_module_has_a_layer():
    parts = {top_part(module_name(path)) for path in SOURCE.rglob("*.py")}
    assert parts - set(LAYER_OF) == set(), "place the new module or package in LAYERS (and CONTRIBUTING.md)"


def test_no_module_imports_from_a_higher_layer():
    assert upward_imports(SOURCE) == []


def test_an_upward_import_is_caught(tmp_path):
    """The check itself: a provider that reaches up into the patches is reported (as the triton
    provider did when the symbol table lived in ``patches/``)."""
    fake = tmp_path / PACKAGE
    (fake / "providers").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "providers" / "__init__.py").write_text("")
    (fake / "providers" / "triton_ops.py").write_text("def f():\n    from sglang_xpu_lora.patches import targets\n")
    (fake / "providers" / "relative.py").write_text("from ..backend import xpu\n")
    assert upward_imports(fake) == [
        f"{PACKAGE}.providers.relative (layer 1) imports {PACKAGE}.backend (layer 3)",
        f"{PACKAGE}.providers.relative (layer 1) imports {PACKAGE}.backend.xpu (layer 3)",
        f"{PACKAGE}.providers.triton_ops (layer 1) imports {PACKAGE}.patches (layer 2)",
        f"{PACKAGE}.providers.triton_ops (layer 1) imports {PACKAGE}.patches.targets (layer 2)",
    ]


#: Runs in a fresh interpreter where importing torch, SGLang or Triton raises.
BLOCKED_IMPORT = textwrap.dedent(
    """
    import importlib.abc, importlib.metadata, sys

    BLOCKED = ("torch", "sglang", "triton")

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"blocked import of {name}")
            return None

    sys.meta_path.insert(0, Blocker())
    {body}
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not heavy, heavy
    print("OK")
    """
)


def run_blocked(body: str) -> subprocess.CompletedProcess:
    script = BLOCKED_IMPORT.replace("{body}", textwrap.dedent(body).strip())
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)


def test_entry_point_target_imports_without_torch_or_sglang():
    """What SGLang's plugin loading imports for ``sglang.lora_backends`` (the rule in
    ``registry/hookspecs.py``): the target module and its hook run with torch and SGLang blocked."""
    result = run_blocked(
        """
        (entry_point,) = [ep for ep in importlib.metadata.entry_points(group="sglang.lora_backends") if ep.name == "intel_xpu"]
        target = entry_point.load()
        (spec,) = target.sglang_lora_backends()
        assert spec.name == "intel_xpu" and spec.device_error("xpu") is None, spec
        """
    )
    assert result.returncode == 0 and result.stdout.strip() == "OK", result.stderr[-3000:]


@pytest.mark.parametrize(
    "module",
    [
        "sglang_xpu_lora.upstream.targets", "sglang_xpu_lora.upstream.compat", "sglang_xpu_lora.upstream.attributes",
        "sglang_xpu_lora.upstream.devices", "sglang_xpu_lora.settings",
        "sglang_xpu_lora.plugin",  # the sglang.srt.plugins entry point: heavy imports happen in load()
    ],
)
def test_leaves_import_without_torch_or_sglang(module):
    result = run_blocked(f"import {module}")
    assert result.returncode == 0 and result.stdout.strip() == "OK", result.stderr[-3000:]


def test_the_blocker_catches_a_torch_import():
    """The check itself: a module that imports torch fails under the blocker."""
    result = run_blocked("import sglang_xpu_lora.providers")
    assert result.returncode != 0 and "blocked import of torch" in result.stderr
