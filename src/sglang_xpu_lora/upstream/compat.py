"""Host compatibility: the SGLang versions this plugin is tested with and every symbol it touches.

All version forks go through this module. Every reason :func:`check_host` gives is the root cause,
once: an SGLang module that exists but cannot be imported (a broken kernel install, a missing
library) is named with the import error, not as the dozens of symbols it would have defined; a
function that another plugin replaced without keeping SGLang's code reachable is named with the
replacement, not as a changed SGLang.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
import os
import pkgutil
from typing import Any, Optional

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from sglang_xpu_lora.upstream import targets
from sglang_xpu_lora.upstream.attributes import missing_attributes, module_assigns

#: SGLang releases this plugin is tested against (CI pins 0.5.23), written lower bound first
#: (``str(SpecifierSet)`` would sort it as ``<0.5.24,>=0.5.23``).
SUPPORTED_SGLANG_RANGE = ">=0.5.23,<0.5.24"
SUPPORTED_SGLANG = SpecifierSet(SUPPORTED_SGLANG_RANGE)
#: The release the messages tell users to install: the range's lower bound.
TESTED_SGLANG = SUPPORTED_SGLANG_RANGE.split(",")[0].removeprefix(">=")


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


@dataclasses.dataclass(frozen=True)
class ImportFailure:
    """An SGLang module that exists but raised while being imported."""

    module: str  #: the SGLang module whose import failed (``sglang.srt.lora.lora_manager``)
    error: str  #: ``"ModuleNotFoundError: No module named 'sgl_kernel'"``
    culprit: Optional[str]  #: the top-level package the error came from (``sgl_kernel``), if known

    def explain(self, symbols: int) -> str:
        """One actionable sentence: what failed, how many of the plugin's ``symbols`` it hides,
        where it came from and what to do."""
        if self.culprit == "sgl_kernel":
            fix = (
                "SGLang imports the kernel package sgl_kernel: install the sgl-kernel-xpu build for your SGLang "
                "(README, Prerequisites) or repair its libraries; on a CPU-only development machine the "
                "devsupport shims provide it (CONTRIBUTING.md)"
            )
        elif self.culprit in (None, "sglang"):
            fix = f"SGLang's own modules do not import: reinstall SGLang {TESTED_SGLANG} into this environment"
        else:
            fix = f"install or repair {self.culprit} in this Python environment"
        return (
            f"importing {self.module} failed: {self.error}. A broken install, not an SGLang version mismatch "
            f"({symbols} SGLang symbols the plugin uses are behind this import): {fix}; "
            f"`python -c 'import {self.module}'` shows the whole traceback"
        )


def import_failure(target: str) -> Optional[ImportFailure]:
    """Why ``target`` does not resolve when the reason is a failed import, else None.

    ``pkgutil.resolve_name`` (what :func:`resolve` and SGLang's ``HookRegistry`` use) treats a
    module that raises ``ImportError`` while importing as a missing attribute, so a broken
    ``sgl_kernel`` reads as "module 'sglang.srt.lora' has no attribute 'lora_manager'". This walks
    the dotted path as it does and returns the first module that exists but failed to import.
    """
    parts = target.split(".")
    for end in range(1, len(parts) + 1):
        module = ".".join(parts[:end])
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name == module or (exc.name and module.startswith(exc.name + ".")):
                return None  # not a module: the rest of the path are attributes
            return ImportFailure(module, f"{type(exc).__name__}: {exc}", exc.name.split(".")[0] if exc.name else None)
        except Exception as exc:  # noqa: BLE001 - any error while importing an existing module
            return ImportFailure(module, f"{type(exc).__name__}: {exc}", _raised_in(exc))
    return None


def _raised_in(exc: BaseException) -> Optional[str]:
    """The top-level package whose code raised ``exc`` (its ``name`` for an ``ImportError`` that
    names a module, else the innermost frame outside the import machinery)."""
    name = getattr(exc, "name", None)
    if name:
        return name.split(".")[0]
    culprit, tb = None, exc.__traceback__
    while tb is not None:
        if not tb.tb_frame.f_code.co_filename.startswith("<frozen"):
            culprit = tb.tb_frame.f_globals.get("__name__", culprit)
        tb = tb.tb_next
    return culprit.split(".")[0] if culprit else None


def unresolved_targets(names: Optional[tuple[str, ...]] = None) -> dict[str, str]:
    """Each of ``names`` (default: :data:`sglang_xpu_lora.upstream.targets.ALL`) that does not
    resolve, with the error."""
    missing = {}
    for target in targets.ALL if names is None else names:
        try:
            resolve(target)
        except Exception as exc:  # noqa: BLE001 - any failure means the symbol is unusable
            missing[target] = f"{type(exc).__name__}: {exc}"
    return missing


def replaced_by(target: str) -> Optional[str]:
    """Who replaced SGLang's function ``target`` so that its code cannot be checked, or None.

    A wrapper that keeps the function it wraps as ``__wrapped__`` (``functools.wraps``, as every
    ``HookRegistry`` hook, this plugin's included, does) is accepted: the checks read the function
    at the end of the ``__wrapped__`` chain (``inspect.unwrap``), which is SGLang's, and the
    wrapper declares that it calls it. A callable whose unwrapped code lies outside the SGLang
    package hides SGLang's function: it is named as ``module.qualname`` with the distribution that
    ships it, since checking its source or parameters would report a change SGLang never made.
    """
    function = inspect.unwrap(resolve(target))
    code = getattr(function, "__code__", None)
    if code is None or _in_sglang(code.co_filename):
        return None
    module = getattr(function, "__module__", None) or "an unknown module"
    owner = f"{module}.{getattr(function, '__qualname__', '?')}"
    dists = importlib.metadata.packages_distributions().get(module.split(".")[0], [])
    return f"{owner} (distribution {', '.join(sorted(set(dists)))})" if dists else owner


def _in_sglang(filename: str) -> bool:
    import sglang

    return os.path.abspath(filename).startswith(os.path.dirname(os.path.abspath(sglang.__file__)) + os.sep)


def check_host() -> list[str]:
    """Every reason this host cannot take the plugin, as actionable sentences; empty when it can.

    Checks the SGLang version against :data:`SUPPORTED_SGLANG`, then resolves each symbol of
    :mod:`sglang_xpu_lora.upstream.targets`, its required parameters, the attributes of its classes
    and of SGLang's models, and its source anchors. A module that fails to import is reported once,
    with the import error (:func:`import_failure`), for all the symbols it holds; a function that
    another plugin replaced without ``__wrapped__`` is reported with the replacement
    (:func:`replaced_by`) instead of its parameters and source.
    """
    version = sglang_version()
    if version is None:
        return [f"SGLang is not installed: install sglang ({TESTED_SGLANG}) before sglang-xpu-lora"]
    if version not in SUPPORTED_SGLANG:
        return [
            f"SGLang {version} is outside the tested range {SUPPORTED_SGLANG_RANGE}: install sglang=={TESTED_SGLANG} "
            "or a sglang-xpu-lora release that supports this SGLang"
        ]
    source_targets = tuple(target for target, _, _ in targets.REQUIRED_SOURCE)
    checked = tuple(dict.fromkeys((
        *targets.ALL, *targets.REQUIRED_PARAMETERS, *targets.REQUIRED_KERNEL_ARGUMENTS, *targets.REQUIRED_ATTRIBUTES,
        *source_targets,
    )))
    unresolved = unresolved_targets(checked)
    problems, failures = [], {}
    for target, error in unresolved.items():
        failure = import_failure(target)
        if failure is None:
            problems.append(f"SGLang {version} has no {target} ({error})")
        else:
            failures.setdefault(failure.error, (failure, []))[1].append(target)
    problems[:0] = [failure.explain(len(names)) for failure, names in failures.values()]
    replaced = {}
    for target in dict.fromkeys((*targets.REQUIRED_PARAMETERS, *source_targets)):
        if target not in unresolved and (who := replaced_by(target)):
            replaced[target] = who
            problems.append(
                f"SGLang {version}: {target} is replaced by {who}, which does not keep SGLang's function as "
                "__wrapped__, so its parameters and source cannot be checked; wrap it with functools.wraps "
                "(or a HookRegistry hook) in that plugin, or leave that plugin out (SGLANG_PLUGINS)"
            )
    for target, names in targets.REQUIRED_PARAMETERS.items():
        if target in unresolved or target in replaced:
            continue
        params = inspect.signature(resolve(target)).parameters
        missing = [n for n in names if n not in params]
        if missing:
            problems.append(f"SGLang {version}: {target} lacks parameter(s) {', '.join(missing)}")
    for target, names in targets.REQUIRED_KERNEL_ARGUMENTS.items():
        if target in unresolved:
            continue
        found = tuple(getattr(resolve(target), "arg_names", ()))
        if found != names:
            problems.append(
                f"SGLang {version}: the Triton kernel {target} takes ({', '.join(found)}), "
                f"not ({', '.join(names)}) as the plugin launches it"
            )
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
        if target in unresolved or target in replaced:
            continue
        try:
            source = inspect.getsource(inspect.unwrap(resolve(target)))
        except (OSError, TypeError) as exc:
            problems.append(f"SGLang {version}: cannot read the source of {target} to check {why} ({exc})")
            continue
        if anchor not in source:
            problems.append(f"SGLang {version}: {target} no longer contains {anchor!r} ({why})")
    return problems
