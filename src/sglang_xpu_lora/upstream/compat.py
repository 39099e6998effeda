"""Host compatibility: the SGLang versions this plugin is tested with and every symbol it touches.

All version forks go through this module.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import pkgutil
from typing import Any

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
    from sglang_xpu_lora.upstream.attributes import missing_attributes, module_assigns

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
        if not module_assigns(module, name):
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
