"""Host compatibility: the SGLang versions this plugin is tested with and every symbol it touches.

All version forks go through this module.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import inspect
import pkgutil
import textwrap
from typing import Any, Iterable

from packaging.specifiers import SpecifierSet
from packaging.version import Version

#: SGLang releases this plugin is tested against (CI pins 0.5.23), written lower bound first
#: (``str(SpecifierSet)`` would sort it as ``<0.5.24,>=0.5.23``).
SUPPORTED_SGLANG_RANGE = ">=0.5.23,<0.5.24"
SUPPORTED_SGLANG = SpecifierSet(SUPPORTED_SGLANG_RANGE)


def resolve(target: str) -> Any:
    """Import a dotted path as ``HookRegistry`` does (``module.attr[.attr...]``).

    Raises:
        ImportError / AttributeError: if the symbol does not exist in the installed SGLang.
    """
    return pkgutil.resolve_name(target)


def sglang_version() -> Version | None:
    """The installed SGLang distribution version, or None when SGLang is not installed."""
    try:
        return Version(importlib.metadata.version("sglang"))
    except importlib.metadata.PackageNotFoundError:
        return None


def unresolved_targets() -> dict[str, str]:
    """Each symbol of :mod:`sglang_xpu_lora.upstream.targets` that does not resolve, with the error."""
    from sglang_xpu_lora.upstream import targets

    missing = {}
    for target in targets.ALL:
        try:
            resolve(target)
        except Exception as exc:  # noqa: BLE001 - any failure means the symbol is unusable
            missing[target] = f"{type(exc).__name__}: {exc}"
    return missing


def check_host() -> list[str]:
    """Every reason this host cannot take the plugin, as actionable sentences; empty when it can.

    Checks the SGLang version against :data:`SUPPORTED_SGLANG`, then resolves each symbol of
    :mod:`sglang_xpu_lora.upstream.targets`, its required parameters, the attributes of its classes
    and of SGLang's models, and its source anchors.
    """
    from sglang_xpu_lora.upstream import targets

    version = sglang_version()
    if version is None:
        return ["SGLang is not installed: install sglang (0.5.23) before sglang-xpu-lora"]
    if version not in SUPPORTED_SGLANG:
        return [
            f"SGLang {version} is outside the tested range {SUPPORTED_SGLANG_RANGE}: install sglang==0.5.23 "
            "or a sglang-xpu-lora release that supports this SGLang"
        ]
    unresolved = unresolved_targets()
    problems = [f"SGLang {version} has no {target} ({error})" for target, error in unresolved.items()]
    for target, names in targets.REQUIRED_PARAMETERS.items():
        if target in unresolved:
            continue
        params = inspect.signature(resolve(target)).parameters
        missing = [n for n in names if n not in params]
        if missing:
            problems.append(f"SGLang {version}: {target} lacks parameter(s) {', '.join(missing)}")
    for target, names in targets.REQUIRED_ATTRIBUTES.items():
        if target in unresolved:
            continue
        missing = missing_attributes(resolve(target), names)
        if missing:
            problems.append(f"SGLang {version}: {target} has no attribute(s) {', '.join(missing)}")
    for name, module in targets.MODEL_ATTRIBUTES.items():
        if name not in _module_self_assignments(module):
            problems.append(f"SGLang {version}: {module} no longer assigns self.{name}")
    for target, anchor, why in targets.REQUIRED_SOURCE:
        if target in unresolved:
            continue
        try:
            source = inspect.getsource(resolve(target))
        except (OSError, TypeError) as exc:
            problems.append(f"SGLang {version}: cannot read the source of {target} to check {why} ({exc})")
            continue
        if anchor not in source:
            problems.append(f"SGLang {version}: {target} no longer contains {anchor!r} ({why})")
    return problems


def missing_attributes(cls: type, names: Iterable[str]) -> list[str]:
    """Those of ``names`` that instances of ``cls`` do not have: not a class attribute, method,
    dataclass or struct field of ``cls`` or its bases, nor assigned to ``self`` in the source of
    one of its SGLang bases (instance attributes exist only once ``__init__`` ran)."""
    declared = set(dir(cls)) | {name for klass in cls.__mro__ for name in getattr(klass, "__annotations__", {})}
    missing = [name for name in names if name not in declared]
    if not missing:
        return []
    assigned: set[str] = set()
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] != "sglang":
            continue
        try:
            assigned |= _self_assignments(ast.parse(textwrap.dedent(inspect.getsource(klass))))
        except (OSError, TypeError, SyntaxError):
            continue
    return [name for name in missing if name not in assigned]


def _module_self_assignments(module: str) -> set[str]:
    """The attributes assigned to ``self`` anywhere in ``module``'s source, read without importing
    it (empty when the module is not found)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return set()
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return set()
    with open(spec.origin, encoding="utf-8") as source:
        return _self_assignments(ast.parse(source.read()))


def _self_assignments(tree: ast.AST) -> set[str]:
    """Names ``x`` of every ``self.x = ...`` (also annotated, augmented and tuple targets) and
    ``setattr(self, "x", ...)`` / ``object.__setattr__(self, "x", ...)`` in ``tree``."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _is_setattr_on_self(node):
            found.add(node.args[1].value)
            continue
        if isinstance(node, ast.Assign):
            assigned = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            assigned = [node.target]
        else:
            continue
        for target in assigned:
            for element in target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]:
                if isinstance(element, ast.Attribute) and isinstance(element.value, ast.Name) and element.value.id == "self":
                    found.add(element.attr)
    return found


def _is_setattr_on_self(call: ast.Call) -> bool:
    func = call.func
    named = (isinstance(func, ast.Name) and func.id == "setattr") or (
        isinstance(func, ast.Attribute) and func.attr == "__setattr__"
    )
    return (
        named
        and len(call.args) >= 2
        and isinstance(call.args[0], ast.Name)
        and call.args[0].id == "self"
        and isinstance(call.args[1], ast.Constant)
        and isinstance(call.args[1].value, str)
    )
