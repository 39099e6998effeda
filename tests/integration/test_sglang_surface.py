"""Every SGLang name and attribute the plugin's source uses is in the symbol table
(:mod:`sglang_xpu_lora.upstream.targets`), which the compat guard checks before registering.

Read from the source (AST), not from a run:

* imports from ``sglang`` and string literals that are SGLang dotted paths;
* ``resolve(targets.X)`` results, names imported from SGLang, and the receivers listed in
  :data:`RECEIVERS` (how each module names the SGLang objects it is handed): every attribute read,
  set, or named in ``getattr``/``hasattr``/``setattr`` on them;
* classes that derive from an SGLang class: inherited attributes read on ``self``, ``super()``
  calls, and every attribute they override, with the parameters the overrides name.

A module that starts handling another SGLang object names it in :data:`RECEIVERS`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Iterator

import pytest
import torch

from sglang_xpu_lora.upstream import attributes, compat, targets

SOURCE = Path(__file__).resolve().parents[2] / "src" / "sglang_xpu_lora"
#: Attributes of SGLang models, which no class stands for (:data:`targets.MODEL_ATTRIBUTES`).
MODEL = "an SGLang model"
#: Entry-point groups: dotted, but not Python names.
ENTRY_POINT_GROUPS = {"sglang.srt.plugins", "sglang.lora_backends"}

#: Per module: the expressions that hold SGLang objects, and their class(es); ``function:expr``
#: where the name means an SGLang object only inside that function.
RECEIVERS = {
    "patches/mem_pool.py": {
        "manager": targets.LORA_MANAGER,
        "manager.lora_backend": targets.TRITON_BACKEND,
        "pool": targets.LORA_MEMORY_POOL,
        "lora_adapter": targets.LORA_ADAPTER,
        "lora_adapter.config": targets.LORA_CONFIG,
    },
    "patches/adapter_checks.py": {
        "cfg": targets.SERVER_ARGS,
        "ref": targets.LORA_REF,
        "lora_ref": targets.LORA_REF,
        "manager": targets.LORA_MANAGER,
        "manager.lora_backend": targets.TRITON_BACKEND,
        "pool": targets.LORA_MEMORY_POOL,
        "lora_config": targets.LORA_CONFIG,
        "adapter": targets.LORA_ADAPTER,
        "adapter.config": targets.LORA_CONFIG,
        "layer": targets.LORA_LAYER,
        "result": targets.LORA_UPDATE_OUTPUT,
    },
    "patches/validation.py": {"cfg": targets.SERVER_ARGS, "server_args": targets.SERVER_ARGS},
    "patches/refusal.py": {"server_args": targets.SERVER_ARGS},
    "patches/startup_failure.py": {"cfg": targets.SERVER_ARGS},
    "patches/embedding_logits.py": {
        "lm_head": targets.VOCAB_PARALLEL_EMBEDDING_WITH_LORA,
        "lm_head.lora_backend": targets.TRITON_BACKEND,
    },
    "patches/unload_final.py": {
        "lora": targets.SERVER_ARGS,
        "manager": targets.TOKENIZER_MANAGER,
        "manager.lora_registry": targets.LORA_REGISTRY,
        "obj": targets.UNLOAD_LORA_ADAPTER_REQ_INPUT,
        "result": targets.LORA_UPDATE_OUTPUT,
        "ref": targets.LORA_REF,
    },
    "patches/request_checks.py": {
        "obj": (targets.GENERATE_REQ_INPUT, targets.EMBEDDING_REQ_INPUT),
        "manager": targets.TOKENIZER_MANAGER,
        "manager.lora_registry": targets.LORA_REGISTRY,
    },
    "patches/cli_choices.py": {"arg": targets.SERVER_ARGS_FIELD_ARG},
    "backend/xpu.py": {"info": targets.LORA_BATCH_INFO},
    "backend/batch_routes.py": {"info": targets.LORA_BATCH_INFO, "self.info": targets.LORA_BATCH_INFO},
    "backend/outside_lora_math.py": {"m": MODEL},
    "adapters/tensor_checks.py": {
        "sglang_module_dims:base_model": MODEL,
        "sglang_module_dims:module": targets.BASE_LAYER_WITH_LORA,
        "sglang_module_dims:lm_head": (targets.BASE_LAYER_WITH_LORA, targets.VOCAB_PARALLEL_EMBEDDING),
        "sglang_module_dims:layer": (
            targets.VOCAB_PARALLEL_EMBEDDING,
            targets.QKV_PARALLEL_LINEAR,
            targets.MERGED_COLUMN_PARALLEL_LINEAR,
            targets.LINEAR_BASE,
        ),
    },
}

#: Attributes every ``torch.nn.Module`` has: torch's, not SGLang's.
TORCH_MODULE_ATTRIBUTES = set(dir(torch.nn.Module))


def dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of names, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def resolved_target(node: ast.AST) -> str | None:
    """The table entry of ``resolve(targets.X)``, or None."""
    if isinstance(node, ast.Call) and dotted(node.func) == "resolve" and len(node.args) == 1:
        name = dotted(node.args[0])
        if name and name.startswith("targets."):
            return getattr(targets, name.split(".", 1)[1])
    return None


def receivers_of(tree: ast.AST, module: str, function: str | None = None) -> dict[str, tuple[str, ...]]:
    """Expression -> SGLang class paths, for one module (or one function of it)."""
    typed = {}
    for name, classes in RECEIVERS.get(module, {}).items():
        scope, _, expression = name.rpartition(":")
        if scope in ("", function):
            typed[expression] = (classes,) if isinstance(classes, str) else classes
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "sglang":
            for alias in node.names:
                typed[alias.asname or alias.name] = (f"{node.module}.{alias.name}",)
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            names, values = node.targets[0], node.value
            pairs = (
                zip(names.elts, values.elts)
                if isinstance(names, ast.Tuple) and isinstance(values, ast.Tuple)
                else [(names, values)]
            )
            for name, value in pairs:
                target = resolved_target(value)
                # a resolved dict or function has builtin attributes only
                if target and isinstance(name, ast.Name) and isinstance(compat.resolve(target), type):
                    typed[name.id] = (target,)
    return typed


def attribute_uses(tree: ast.Module, typed: dict[str, tuple[str, ...]]) -> Iterator[tuple[tuple[str, ...], str, int]]:
    """``(classes, attribute, line)`` for each attribute used on a typed expression."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and dotted(node.value) in typed:
            yield typed[dotted(node.value)], node.attr, node.lineno
        if (
            isinstance(node, ast.Call)
            and dotted(node.func) in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
            and dotted(node.args[0]) in typed
            and isinstance(node.args[1], ast.Constant)
        ):
            yield typed[dotted(node.args[0])], node.args[1].value, node.lineno


def subclass_uses(tree: ast.Module, typed: dict[str, tuple[str, ...]]) -> Iterator[tuple[str, str, int, tuple[str, ...]]]:
    """For classes deriving from an SGLang class: ``(parent, attribute, line, parameters)`` for
    each inherited attribute read on ``self``, each ``super()`` call and each override (with the
    named parameters of an overriding method)."""
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        parents = [typed[dotted(b)][0] for b in cls.bases if dotted(b) in typed]
        if not parents:
            continue
        (parent,) = parents
        parent_cls = compat.resolve(parent)
        own = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
        own_values = {
            target.id
            for n in cls.body
            if isinstance(n, (ast.Assign, ast.AnnAssign))
            for target in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(target, ast.Name)
        }
        own_instance = {
            n.attr
            for n in ast.walk(cls)
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and dotted(n.value) == "self"
        }
        for name, node in own.items():
            if name == "__init__" or hasattr(parent_cls, name):
                params = tuple(
                    a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs if a.arg != "self"
                )
                yield parent, name, node.lineno, params
        for name in own_values:
            if hasattr(parent_cls, name):
                yield parent, name, cls.lineno, ()
        for name in own_instance:  # state of the parent's that the subclass sets
            if not attributes.missing_attributes(parent_cls, [name]):
                yield parent, name, cls.lineno, ()
        for node in ast.walk(cls):
            if isinstance(node, ast.Attribute) and dotted(node.value) == "self":
                if node.attr not in own and node.attr not in own_values and node.attr not in own_instance:
                    yield parent, node.attr, node.lineno, ()
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Call)
                and dotted(node.value.func) == "super"
            ):
                yield parent, node.attr, node.lineno, ()


def surface_problems(source: Path) -> list[str]:
    """Every use of an SGLang name in ``source`` that the table does not list."""
    listed = set(targets.ALL)
    problems = []
    for path in sorted(source.rglob("*.py")):
        module = path.relative_to(source).as_posix()
        if module.startswith("upstream/"):
            continue
        tree = ast.parse(path.read_text())
        docstrings = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body
            and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "sglang":
                        problems.append(f"{module}:{node.lineno}: import {alias.name} (import the names you use)")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "sglang":
                for alias in node.names:
                    if f"{node.module}.{alias.name}" not in listed:
                        problems.append(f"{module}:{node.lineno}: {node.module}.{alias.name} is not in targets.ALL")
            elif (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docstrings
                and re.fullmatch(r"sglang(\.\w+)+", node.value)
                and node.value not in listed
                and node.value not in ENTRY_POINT_GROUPS
            ):
                problems.append(f"{module}:{node.lineno}: {node.value!r} is not in targets.ALL")
        typed = receivers_of(tree, module)
        uses = set(attribute_uses(tree, typed))
        for function in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            uses |= set(attribute_uses(function, {**typed, **receivers_of(function, module, function.name)}))
        for classes, attribute, line in sorted(uses, key=lambda use: use[2]):
            if attribute in TORCH_MODULE_ATTRIBUTES:
                continue
            if classes == (MODEL,):
                if attribute not in targets.MODEL_ATTRIBUTES:
                    problems.append(f"{module}:{line}: model attribute {attribute} is not in targets.MODEL_ATTRIBUTES")
            elif not any(attribute in targets.REQUIRED_ATTRIBUTES.get(cls, ()) for cls in classes):
                problems.append(f"{module}:{line}: {' or '.join(classes)}.{attribute} is not in targets.REQUIRED_ATTRIBUTES")
        for parent, attribute, line, params in subclass_uses(tree, typed):
            if attribute != "__init__" and attribute not in targets.REQUIRED_ATTRIBUTES.get(parent, ()):
                problems.append(f"{module}:{line}: {parent}.{attribute} is not in targets.REQUIRED_ATTRIBUTES")
            required = targets.REQUIRED_PARAMETERS.get(f"{parent}.{attribute}", ())
            missing = [p for p in params if p not in required]
            if missing:
                problems.append(
                    f"{module}:{line}: {parent}.{attribute} parameter(s) {', '.join(missing)} not in targets.REQUIRED_PARAMETERS"
                )
    return problems


def test_every_sglang_name_the_source_uses_is_in_the_table():
    assert surface_problems(SOURCE) == []


@pytest.mark.parametrize(
    ("table", "key", "entry", "expected"),
    [
        ("REQUIRED_ATTRIBUTES", targets.LORA_MEMORY_POOL, "_clear_buffer_slot_for_base", "patches/mem_pool.py:"),
        ("REQUIRED_ATTRIBUTES", targets.TRITON_BACKEND, "sgemm_batch_info", "backend/xpu.py:"),
        ("REQUIRED_ATTRIBUTES", targets.TRITON_BACKEND, "run_qkv_lora", "backend/xpu.py:"),
        ("REQUIRED_ATTRIBUTES", targets.LORA_BATCH_INFO, "permutation", "backend/xpu.py:"),
        ("REQUIRED_ATTRIBUTES", targets.QKV_PARALLEL_LINEAR, "v_head_size", "adapters/tensor_checks.py:"),
        ("REQUIRED_ATTRIBUTES", targets.SERVER_ARGS, "lora_paths", "patches/adapter_checks.py:"),
        ("REQUIRED_PARAMETERS", targets.TRITON_BACKEND + ".run_qkv_lora", "n_slices", "backend/xpu.py:"),
        ("MODEL_ATTRIBUTES", None, "w_kc", "backend/outside_lora_math.py:"),
        ("ALL", None, targets.LORA_BATCH_LAYOUT, "backend/xpu.py:"),
        ("ALL", None, targets.LOAD_PLUGINS, "doctor.py:"),
    ],
)
def test_a_missing_entry_is_reported(monkeypatch, table, key, entry, expected):
    """The check itself: removing one entry from the table makes the source check fail, naming the
    module that uses it."""
    if table == "ALL":
        monkeypatch.setattr(targets, "ALL", tuple(t for t in targets.ALL if t != entry))
    elif table == "MODEL_ATTRIBUTES":
        monkeypatch.setattr(targets, "MODEL_ATTRIBUTES", {k: v for k, v in targets.MODEL_ATTRIBUTES.items() if k != entry})
    else:
        entries = dict(getattr(targets, table))
        entries[key] = tuple(n for n in entries[key] if n != entry)
        monkeypatch.setattr(targets, table, entries)
    problems = surface_problems(SOURCE)
    assert problems and all(entry in p or entry.rsplit(".", 1)[-1] in p for p in problems), problems
    assert any(p.startswith(expected) for p in problems), problems
