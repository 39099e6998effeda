"""Whether SGLang's classes and models still have the attributes the plugin uses
(:data:`~sglang_xpu_lora.upstream.targets.REQUIRED_ATTRIBUTES`,
:data:`~sglang_xpu_lora.upstream.targets.MODEL_ATTRIBUTES`), for the guard in :mod:`.compat`.

Instance attributes exist only once ``__init__`` ran, so they are read from the bytecode of the
classes' methods (no source is parsed at plugin load); model attributes from the text of a model
module, which is too heavy to import for a check.
"""

from __future__ import annotations

import dis
import importlib.util
import inspect
import re
import types
from typing import Any, Iterable


def missing_attributes(cls: type, names: Iterable[str]) -> list[str]:
    """Those of ``names`` that instances of ``cls`` do not have: not a class attribute, method,
    dataclass or struct field of ``cls`` or its bases, nor assigned to ``self`` by a method of one of
    its SGLang bases (instance attributes exist only once ``__init__`` ran; read from the methods'
    bytecode, so no source is parsed)."""
    declared = set(dir(cls)) | {name for klass in cls.__mro__ for name in getattr(klass, "__annotations__", {})}
    missing = [name for name in names if name not in declared]
    if not missing:
        return []
    assigned: set[str] = set()
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] == "sglang":
            for member in vars(klass).values():
                assigned |= _stored_attributes(member)
    return [name for name in missing if name not in assigned]


def _stored_attributes(member: Any) -> set[str]:
    """Attribute names a class member's code stores (``x.name = ...``, ``setattr(x, "name", ...)``,
    ``object.__setattr__(x, "name", ...)``), its nested functions included; SGLang's own code when
    the member is wrapped (``HookRegistry`` hooks, ``functools.wraps``)."""
    function = getattr(member, "__func__", None) or getattr(member, "fget", None) or member
    if callable(function):
        function = inspect.unwrap(function)
    code = getattr(function, "__code__", None)
    stored: set[str] = set()
    pending = [code] if code is not None else []
    while pending:
        code = pending.pop()
        stored |= {i.argval for i in dis.get_instructions(code) if i.opname == "STORE_ATTR"}
        if {"setattr", "__setattr__"} & set(code.co_names):
            stored |= {c for c in code.co_consts if isinstance(c, str) and c.isidentifier()}
        pending += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return stored


def module_assigns(module: str, name: str) -> bool:
    """Whether ``module``'s source assigns ``self.<name>``, read without importing the module."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return False
    with open(spec.origin, encoding="utf-8") as source:
        text = source.read()
    return re.search(rf"\bself\.{re.escape(name)}\s*(?::[^=\n]*)?=(?!=)", text) is not None
