"""Target: ``choices`` of the ``Arg`` annotating sglang.srt.server_args.ServerArgs.lora_backend
Why: ``--lora-backend`` choices are a hard-coded list (``arg_groups/fields/lora.py``), so
    ``python -m sglang.launch_server --lora-backend intel_xpu`` and ``sglang serve`` would be
    rejected by argparse.
How: append each registered backend name to the list object argparse receives. It must be reached
    through ``ServerArgs`` (evaluated annotations, one shared ``Arg``); ``fields/lora.py`` uses
    string annotations, so resolving them there returns a fresh copy each time.
Checked against: SGLang 0.5.23.
Remove when: SGLang derives the choices from ``LORA_SUPPORTED_BACKENDS``.
"""

from __future__ import annotations

import typing

from sglang_xpu_lora.patches.undo import UndoStack
from sglang_xpu_lora.registry import LoRABackendRegistry
from sglang_xpu_lora.upstream import targets
from sglang_xpu_lora.upstream.compat import resolve


def lora_backend_choices() -> list:
    """The live ``choices`` list behind ``--lora-backend`` (mutating it changes the parser)."""
    server_args = resolve(targets.SERVER_ARGS)
    arg_cls = resolve(targets.SERVER_ARGS_FIELD_ARG)
    annotation = typing.get_type_hints(server_args, include_extras=True)["lora_backend"]
    arg = next(meta for meta in typing.get_args(annotation)[1:] if isinstance(meta, arg_cls))
    return arg.choices


def apply(registry: LoRABackendRegistry, undo: UndoStack) -> None:
    choices = lora_backend_choices()
    for name in registry.specs():
        if name not in choices:
            choices.append(name)
            undo.push(f"--lora-backend choice {name!r}", lambda name=name: choices.remove(name))
