"""Undoable patch steps: what :func:`sglang_xpu_lora.patches.apply_all` rolls back on a failure.

Every patch records how to undo each step it took on an :class:`UndoStack` as it goes, so a patch
that fails half-way and the patches applied before it can all be undone. SGLang's ``HookRegistry``
has no way to withdraw a registered hook (and may already have applied it), so a hook is queued
behind a switch: :func:`queue_hook` registers a wrapper that calls the hook while the switch is on
and passes straight through to SGLang's original once the undo turned it off.
"""

from __future__ import annotations

from typing import Callable

from sglang_xpu_lora.upstream import targets
from sglang_xpu_lora.upstream.compat import resolve


class UndoStack:
    """Undo callables in the order their steps were taken; :meth:`unwind` runs them newest first."""

    def __init__(self) -> None:
        self._steps: list[tuple[str, Callable[[], None]]] = []

    def push(self, description: str, undo: Callable[[], None]) -> None:
        """Record that a step was taken and how to undo it (``description`` names it in reports)."""
        self._steps.append((description, undo))

    def unwind(self) -> list[str]:
        """Undo every step, newest first. Returns one line per step: what was undone, or why an undo
        itself failed (the remaining steps are still undone)."""
        report = []
        while self._steps:
            description, undo = self._steps.pop()
            try:
                undo()
            except Exception as exc:  # noqa: BLE001 - undo the rest whatever one undo does
                report.append(f"could not undo {description} ({type(exc).__name__}: {exc})")
            else:
                report.append(f"undid {description}")
        return report


def queue_hook(target: str, hook: Callable, hook_type: str, undo: UndoStack) -> None:
    """Register ``hook`` on ``target`` with SGLang's ``HookRegistry`` behind a switch.

    :param target: the dotted ``HookRegistry`` target.
    :param hook: an ``AROUND`` hook ``hook(original, *args, **kwargs)``, an ``AFTER`` hook
        ``hook(result, *args, **kwargs)`` or a ``BEFORE`` hook ``hook(*args, **kwargs)`` (returning
        None or new ``(args, kwargs)``), as SGLang's ``HookType`` defines them.
    :param hook_type: ``"AROUND"``, ``"AFTER"`` or ``"BEFORE"``.
    :param undo: gets the step that turns the switch off (the hook then passes through).
    Raises:
        ValueError: for another hook type (``REPLACE`` cannot pass through).
    """
    hook_registry, hook_types = resolve(targets.HOOK_REGISTRY), resolve(targets.HOOK_TYPE)
    switch = {"on": True}
    if hook_type == "AROUND":
        kind = hook_types.AROUND

        def gated(original, *args, **kwargs):
            return hook(original, *args, **kwargs) if switch["on"] else original(*args, **kwargs)

    elif hook_type == "AFTER":
        kind = hook_types.AFTER

        def gated(result, *args, **kwargs):
            return hook(result, *args, **kwargs) if switch["on"] else result

    elif hook_type == "BEFORE":
        kind = hook_types.BEFORE

        def gated(*args, **kwargs):
            return hook(*args, **kwargs) if switch["on"] else None

    else:
        raise ValueError(f"queue_hook supports AROUND, AFTER and BEFORE hooks, not {hook_type}")
    gated.__name__ = gated.__qualname__ = getattr(hook, "__name__", "hook")
    hook_registry.register(target, gated, kind)
    undo.push(f"the {hook_type} hook on {target}", lambda: switch.update(on=False))
