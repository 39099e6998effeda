"""Target: sglang.srt.server_args.ServerArgs.resolve_once (BEFORE) and the ``choices`` of
    ``--lora-backend`` (as :mod:`.cli_choices`), only when the plugin registers no backend.
Why: a plugin that refused to register (an untested SGLang version, an SGLang module that does not
    import, a patch point another plugin hid) would leave ``--lora-backend intel_xpu`` to SGLang's
    ``invalid choice: 'intel_xpu'`` (or ``Invalid backend: intel_xpu`` from
    ``Engine(lora_backend=...)``, after the model loaded), with the reason printed once, far above.
How: the backend names are added to the CLI choices, and a BEFORE hook on the resolution of the
    server arguments (which ``sglang serve``, ``launch_server`` and ``Engine`` run before validating
    them) raises :class:`BackendArgumentError` with the reason when ``lora_backend`` is one of them and
    LoRA is not switched off. Before SGLang's resolution, not after its validation: with a broken
    kernel install that resolution itself fails to import ``sgl_kernel``, and the reason (which names
    that import error) must come first. Nothing of the backend itself (no registry entry, no pool
    or adapter hook) is installed. Everything it needs is resolved while it is applied, so a host
    where any of it is missing fails the apply (and the plugin falls back to printing the reason)
    rather than the hook.
Checked against: SGLang 0.5.23.
Remove when: SGLang reports why a plugin backend is unavailable itself.
"""

from __future__ import annotations

from typing import Iterable

from sglang_xpu_lora import __version__
from sglang_xpu_lora.patches.cli_choices import lora_backend_choices
from sglang_xpu_lora.patches.errors import BackendArgumentError
from sglang_xpu_lora.patches.undo import UndoStack, queue_hook
from sglang_xpu_lora.upstream import targets
from sglang_xpu_lora.upstream.compat import resolve


def refusal_message(name: str, reasons: Iterable[str]) -> str:
    """What ``--lora-backend name`` fails with when the plugin registered no backend."""
    listed = "; ".join(reasons)
    return (
        f"--lora-backend {name} is unavailable: sglang-xpu-lora {__version__} registered no LoRA backend in this "
        f"environment because {listed}. Run `sglang-xpu-lora doctor` with this Python for the whole report."
    )


def apply(names: Iterable[str], reasons: list[str], undo: UndoStack) -> None:
    """Make ``--lora-backend NAME`` parse for each of ``names`` and fail with ``reasons`` when the
    server arguments are resolved.

    Raises:
        Exception: whatever resolving SGLang's hook registry, ``ServerArgs.resolve_once`` or CLI choices raises on
            this host (the caller undoes the steps taken and falls back to printing the reasons).
    """
    names = tuple(names)
    resolve(targets.SERVER_ARGS_RESOLVE_ONCE)
    choices = lora_backend_choices()

    def refuse_unregistered_backend(server_args, *args, **kwargs):
        if server_args.lora_backend in names and server_args.enable_lora is not False:
            raise BackendArgumentError(refusal_message(server_args.lora_backend, reasons))

    queue_hook(targets.SERVER_ARGS_RESOLVE_ONCE, refuse_unregistered_backend, "BEFORE", undo)
    for name in names:
        if name not in choices:
            choices.append(name)
            undo.push(f"--lora-backend choice {name!r}", lambda name=name: choices.remove(name))
