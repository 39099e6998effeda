"""Every SGLang name and attribute the plugin's source uses is in the symbol table
(:mod:`sglang_xpu_lora.upstream.targets`), which the compat guard checks before registering.

Read from the source (AST), not from a run:

* imports from ``sglang`` and string literals that are SGLang dotted paths; every ``targets.X``
  the source names is in ``targets.ALL`` (derived from the module, so this holds by construction;
  the check keeps it so);
* ``resolve(targets.X)`` results, names imported from SGLang, parameters and ``self`` attributes
  annotated with an SGLang class (imported under ``TYPE_CHECKING`` where the module must not import
  SGLang), and the receivers listed in :data:`RECEIVERS` (how the older modules name the SGLang
  objects they are handed): every attribute read, set, named in ``getattr``/``hasattr``/
  ``setattr`` or replaced by ``dataclasses.replace`` on them;
* classes that derive from an SGLang class: inherited attributes read on ``self``, ``super()``
  calls, and every attribute they override, with the parameters the overrides name.

Completeness: the names that hold SGLang objects somewhere (annotated or listed) are SGLang's
words in this plugin (``info``, ``pool``, ``batch_info``...): a module that reads attributes on such
a name without typing it fails (:func:`untyped_receivers`), so a new module handed an SGLang
object annotates it, and its reads are checked like the others.
"""

from __future__ import annotations

import ast
import re
import shutil
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

class Each(tuple):
    """Receiver classes each of which reaches every read (duck-typed code): each must list the
    attribute. A plain tuple is classes the code tells apart (``isinstance``): one must list it."""


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
        "cfg": targets.SERVER_ARGS,
        "normalize_checked:obj": Each((targets.GENERATE_REQ_INPUT, targets.EMBEDDING_REQ_INPUT)),
        "around_resolve_lora_path:obj": Each((targets.GENERATE_REQ_INPUT, targets.EMBEDDING_REQ_INPUT)),
        "generated_samples:obj": targets.GENERATE_REQ_INPUT,
        "manager": targets.TOKENIZER_MANAGER,
        "manager.lora_registry": targets.LORA_REGISTRY,
    },
    "patches/cli_choices.py": {"arg": targets.SERVER_ARGS_FIELD_ARG},
    # info: a batch info; layer: SGLang's LoRA layer handed to the backend's forward_with_base.
    "backend/xpu.py": {"info": targets.LORA_BATCH_INFO, "layer": targets.COLUMN_PARALLEL_LINEAR_WITH_LORA},
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


def sglang_imports(tree: ast.AST) -> dict[str, str]:
    """Name -> SGLang dotted path of each name imported from ``sglang`` in ``tree``."""
    return {
        alias.asname or alias.name: f"{node.module}.{alias.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "sglang"
        for alias in node.names
    }


def annotated_classes(annotation: ast.AST | None, imported: dict[str, str]) -> tuple[str, ...]:
    """The SGLang classes an annotation names (``LoRABatchInfo``, ``Optional[LoRAMemoryPool]``,
    ``"LoRABatchInfo"``), by the names the module imports from SGLang."""
    if annotation is None:
        return ()
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return annotated_classes(ast.parse(annotation.value, mode="eval").body, imported)
    found = []
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name) and node.id in imported:
            found.append(imported[node.id])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node is not annotation:
            found.extend(annotated_classes(node, imported))
    return tuple(dict.fromkeys(found))


def annotated_receivers(tree: ast.AST, imported: dict[str, str], function: ast.AST | None = None) -> dict[str, tuple[str, ...]]:
    """Expression -> SGLang classes from annotations: ``function``'s parameters, and ``self.x``
    (or names) annotated anywhere in ``tree``."""
    typed = {}
    if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
        arguments = function.args
        for arg in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs):
            classes = annotated_classes(arg.annotation, imported)
            if classes:
                typed[arg.arg] = classes
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and dotted(node.target):
            classes = annotated_classes(node.annotation, imported)
            if classes:
                typed[dotted(node.target)] = classes
    return typed


def receivers_of(tree: ast.AST, module: str, function: str | None = None) -> dict[str, tuple[str, ...]]:
    """Expression -> SGLang class paths, for one module (or one function of it)."""
    typed = {}
    for name, classes in RECEIVERS.get(module, {}).items():
        scope, _, expression = name.rpartition(":")
        if scope in ("", function):
            typed[expression] = (classes,) if isinstance(classes, str) else classes
    for alias, path in sglang_imports(tree).items():
        typed[alias] = (path,)
    for node in ast.walk(tree):
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


#: What :func:`attribute_uses` yields for ``getattr(obj, name)`` with a name computed at run time.
COMPUTED_NAME = "<a name computed at run time: read the attribute by its name>"


def string_constants(tree: ast.Module) -> dict[str, str]:
    """The module's ``NAME = "text"`` constants."""
    return {
        node.targets[0].id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }


#: The plugin's own attributes on SGLang objects are named in this namespace.
OWN_ATTRIBUTE = re.compile(r"_?(sglang_)?xpu_lora_\w+")


def attribute_uses(
    tree: ast.Module, typed: dict[str, tuple[str, ...]], constants: dict[str, str] | None = None
) -> Iterator[tuple[tuple[str, ...], str, int]]:
    """``(classes, attribute, line)`` for each attribute used on a typed expression; a
    ``getattr`` name given by a module constant (``constants``) is that constant's value."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and dotted(node.value) in typed:
            yield typed[dotted(node.value)], node.attr, node.lineno
        if (
            isinstance(node, ast.Call)
            and dotted(node.func) in ("dataclasses.replace", "replace")
            and node.args
            and dotted(node.args[0]) in typed
        ):
            for keyword in node.keywords:
                if keyword.arg:
                    yield typed[dotted(node.args[0])], keyword.arg, node.lineno
        if (
            isinstance(node, ast.Call)
            and dotted(node.func) in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
            and dotted(node.args[0]) in typed
        ):
            name = node.args[1]
            if isinstance(name, ast.Name) and name.id in (constants or {}):
                value = constants[name.id]
                if OWN_ATTRIBUTE.fullmatch(value):
                    continue  # the plugin's own attribute on the object
            else:  # a computed name is reported as such: the table cannot be checked against it
                value = name.value if isinstance(name, ast.Constant) else COMPUTED_NAME
            yield typed[dotted(node.args[0])], value, node.lineno


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


def table_uses(tree: ast.Module) -> Iterator[tuple[str, int]]:
    """``(constant, line)`` for each ``targets.X`` (or name imported from ``targets``) in ``tree``
    that is a dotted SGLang name (a string constant of the table)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and dotted(node.value) == "targets":
            yield node.attr, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module == "sglang_xpu_lora.upstream.targets":
            for alias in node.names:
                yield alias.name, node.lineno


def functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    return (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))


def parameter_names(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    arguments = function.args
    return [a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)]


def receiver_names(source: Path) -> set[str]:
    """The names that hold SGLang objects somewhere in ``source``: the plain names of
    :data:`RECEIVERS` and every parameter annotated with an SGLang class."""
    names = {expression.rpartition(":")[2] for entries in RECEIVERS.values() for expression in entries}
    for path in sorted(source.rglob("*.py")):
        tree = ast.parse(path.read_text())
        imported = sglang_imports(tree)
        for function in functions(tree):
            names |= set(annotated_receivers(ast.Module(body=[], type_ignores=[]), imported, function))
    return {name for name in names if "." not in name and name != "m"}


def untyped_receivers(source: Path) -> list[str]:
    """Every function parameter of ``source`` that bears a name other modules give an SGLang object
    (:func:`receiver_names`) and whose attributes the function reads, but that is neither annotated
    with an SGLang class nor listed in :data:`RECEIVERS`: the reads on it would go unchecked."""
    names, problems = receiver_names(source), []
    for path in sorted(source.rglob("*.py")):
        module = path.relative_to(source).as_posix()
        if module.startswith("upstream/"):
            continue
        tree = ast.parse(path.read_text())
        imported, typed = sglang_imports(tree), receivers_of(tree, module)
        for function in functions(tree):
            scope = {**typed, **receivers_of(function, module, function.name),
                     **annotated_receivers(function, imported, function)}
            for name in parameter_names(function):
                if name in names and name not in scope and any(
                    isinstance(n, ast.Attribute) and dotted(n.value) == name and n.attr not in TORCH_MODULE_ATTRIBUTES
                    for n in ast.walk(function)
                ):
                    problems.append(
                        f"{module}:{function.lineno}: {function.name}() reads attributes of `{name}`, a name "
                        "that holds an SGLang object elsewhere: annotate it with the SGLang class (imported "
                        "under TYPE_CHECKING) so its reads are checked, or give it another name"
                    )
    return problems


def surface_problems(source: Path) -> list[str]:
    """Every use of an SGLang name in ``source`` that the table does not list."""
    listed = set(targets.ALL)
    problems = []
    for path in sorted(source.rglob("*.py")):
        module = path.relative_to(source).as_posix()
        tree = ast.parse(path.read_text())
        if module != "upstream/targets.py":
            for name, line in table_uses(tree):
                value = getattr(targets, name, None)
                if isinstance(value, str) and value not in listed:
                    problems.append(f"{module}:{line}: targets.{name} ({value}) is not in targets.ALL")
        if module.startswith("upstream/"):
            continue
        imported = sglang_imports(tree)
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
        typed = {**receivers_of(tree, module), **annotated_receivers(tree, imported)}
        constants = string_constants(tree)
        uses = set(attribute_uses(tree, typed, constants))
        for function in functions(tree):
            scope = {**typed, **receivers_of(function, module, function.name),
                     **annotated_receivers(function, imported, function)}
            uses |= set(attribute_uses(function, scope, constants))
        for classes, attribute, line in sorted(uses, key=lambda use: use[2]):
            if attribute in TORCH_MODULE_ATTRIBUTES:
                continue
            if classes == (MODEL,):
                if attribute not in targets.MODEL_ATTRIBUTES:
                    problems.append(f"{module}:{line}: model attribute {attribute} is not in targets.MODEL_ATTRIBUTES")
            elif isinstance(classes, Each):
                for cls in classes:
                    if attribute not in targets.REQUIRED_ATTRIBUTES.get(cls, ()):
                        problems.append(f"{module}:{line}: {cls}.{attribute} is not in targets.REQUIRED_ATTRIBUTES")
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


def test_every_name_that_holds_an_sglang_object_is_typed():
    assert untyped_receivers(SOURCE) == []


@pytest.mark.parametrize(
    ("table", "key", "entry", "expected"),
    [
        ("REQUIRED_ATTRIBUTES", targets.LORA_MEMORY_POOL, "_clear_buffer_slot_for_base", "patches/mem_pool.py:"),
        ("REQUIRED_ATTRIBUTES", targets.TRITON_BACKEND, "sgemm_batch_info", "backend/xpu.py:"),
        ("REQUIRED_ATTRIBUTES", targets.TRITON_BACKEND, "run_qkv_lora", "backend/xpu.py:"),
        ("REQUIRED_ATTRIBUTES", targets.LORA_BATCH_INFO, "permutation", "backend/route_table.py:"),
        ("REQUIRED_ATTRIBUTES", targets.QKV_PARALLEL_LINEAR, "v_head_size", "adapters/tensor_checks.py:"),
        ("REQUIRED_ATTRIBUTES", targets.SERVER_ARGS, "lora_paths", "patches/adapter_checks.py:"),
        ("REQUIRED_PARAMETERS", targets.TRITON_BACKEND + ".run_qkv_lora", "n_slices", "backend/xpu.py:"),
        ("MODEL_ATTRIBUTES", None, "w_kc", "backend/outside_lora_math.py:"),
        ("ALL", None, targets.LORA_BATCH_LAYOUT, "backend/xpu.py:"),
        ("ALL", None, targets.LOAD_PLUGINS, "doctor.py:"),
        # reads through annotated parameters (batch binding, trial captures)
        ("REQUIRED_ATTRIBUTES", targets.LORA_BATCH_INFO, "num_segments", "providers/batch_binding.py:"),
        ("REQUIRED_ATTRIBUTES", targets.LORA_BATCH_INFO, "scalings", "providers/batch_binding.py:"),
        ("REQUIRED_ATTRIBUTES", targets.LORA_MEMORY_POOL, "dtype", "providers/capture_probe.py:"),
        ("REQUIRED_ATTRIBUTES", targets.LORA_MEMORY_POOL, "max_lora_rank", "providers/capture_probe.py:"),
        # reads on a request of either class (each must list them), by name (no getattr(obj, field))
        ("REQUIRED_ATTRIBUTES", targets.GENERATE_REQ_INPUT, "lora_id", "patches/request_checks.py:"),
        ("REQUIRED_ATTRIBUTES", targets.EMBEDDING_REQ_INPUT, "lora_id", "patches/request_checks.py:"),
        ("REQUIRED_ATTRIBUTES", targets.EMBEDDING_REQ_INPUT, "is_single", "patches/request_checks.py:"),
        ("REQUIRED_ATTRIBUTES", targets.EMBEDDING_REQ_INPUT, "batch_size", "patches/request_checks.py:"),
        ("REQUIRED_ATTRIBUTES", targets.GENERATE_REQ_INPUT, "lora_path", "patches/request_checks.py:"),
        ("REQUIRED_ATTRIBUTES", targets.GENERATE_REQ_INPUT, "parallel_sample_num", "patches/request_checks.py:"),
        # names used only through resolve(targets.X), at their first call deep inside a hook
        ("ALL", None, targets.FUSED_MOE, "backend/outside_lora_math.py:"),
        ("ALL", None, targets.GET_LORA, "patches/unload_final.py:"),
        ("ALL", None, targets.RESOLVING_VIEW, "patches/validation.py:"),
        ("ALL", None, targets.GET_NORMALIZED_TARGET_MODULES, "patches/adapter_checks.py:"),
        ("ALL", None, targets.AUTO_DETECT_LORA_TARGET_MODULES, "patches/adapter_checks.py:"),
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


def test_the_table_lists_every_constant_of_its_module():
    """``ALL`` is derived: every public dotted name of :mod:`targets` is in it, once."""
    constants = [v for k, v in vars(targets).items() if k.isupper() and not k.startswith("_") and isinstance(v, str)]
    assert targets.ALL == tuple(constants) and len(set(targets.ALL)) == len(targets.ALL)


@pytest.mark.parametrize(
    ("module", "annotated", "plain", "function"),
    [
        ("providers/batch_binding.py", "info: LoRABatchInfo) -> dict", "info) -> dict", "batch_arguments()"),
        ("providers/capture_probe.py", "pool: Optional[LoRAMemoryPool] = None", "pool=None", "for_graph_setup()"),
    ],
)
def test_an_untyped_receiver_is_reported(tmp_path, module, annotated, plain, function):
    """The completeness rule: a copy of the source in which a module no longer annotates the SGLang
    object it reads (as if it were new and outside :data:`RECEIVERS`) fails, naming the function."""
    copy = tmp_path / "sglang_xpu_lora"
    shutil.copytree(SOURCE, copy)
    text = (copy / module).read_text()
    assert text.count(annotated) == 1
    (copy / module).write_text(text.replace(annotated, plain))
    problems = untyped_receivers(copy)
    assert len(problems) == 1 and problems[0].startswith(f"{module}:") and function in problems[0], problems



@pytest.mark.parametrize(
    ("module", "before", "after", "named"),
    [
        # getattr(obj, field) with a name computed at run time cannot be checked against the table
        ("request_checks.py", "given = (obj.lora_path, obj.lora_id)",
         "given = [getattr(obj, field) for field in LORA_FIELDS]", COMPUTED_NAME),
        # a constant passes as the plugin's own attribute only while it names one (xpu_lora_...)
        ("unload_final.py", 'UNLOADED_ATTR = "xpu_lora_unloaded"', 'UNLOADED_ATTR = "pending_unloads"',
         "pending_unloads"),
    ],
    ids=["computed-name", "constant-naming-an-sglang-attribute"],
)
def test_a_getattr_read_is_checked_by_the_name_it_reads(tmp_path, module, before, after, named):
    """A copy of the source whose ``getattr`` reads on SGLang objects no longer name the attribute
    literally is reported, naming the module."""
    copy = tmp_path / "sglang_xpu_lora"
    shutil.copytree(SOURCE, copy)
    path = copy / "patches" / module
    text = path.read_text()
    assert text.count(before) == 1
    path.write_text(text.replace(before, after))
    problems = surface_problems(copy)
    assert problems and all(p.startswith(f"patches/{module}:") and named in p for p in problems), problems
