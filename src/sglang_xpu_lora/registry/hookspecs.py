"""pluggy hook specifications for the ``sglang.lora_backends`` entry-point group.

A distribution adds LoRA backends to SGLang by declaring an entry point in the group
``sglang.lora_backends`` whose target (a module or object) implements :func:`sglang_lora_backends`
with :data:`hookimpl`. Importing that target must be cheap: no torch, SGLang or kernel imports;
those belong inside each spec's ``factory``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

#: The entry-point group plugins declare their backends in; also pluggy's project name for the hook.
ENTRY_POINT_GROUP = "sglang.lora_backends"

hookspec = pluggy.HookspecMarker(ENTRY_POINT_GROUP)
#: Marker for implementations: ``@hookimpl def sglang_lora_backends(): return [LoRABackendSpec(...)]``.
hookimpl = pluggy.HookimplMarker(ENTRY_POINT_GROUP)

if TYPE_CHECKING:
    from sglang_xpu_lora.registry.spec import LoRABackendSpec


@hookspec
def sglang_lora_backends() -> "list[LoRABackendSpec]":
    """Return the LoRA backends this plugin provides.

    Called once per process when the ``sglang.srt.plugins`` entry point of sglang-xpu-lora runs.
    Every returned backend is registered with SGLang's backend registry, added to the
    ``--lora-backend`` choices and checked by the argument validation hook.

    :returns: a list of :class:`~sglang_xpu_lora.registry.spec.LoRABackendSpec`.
    """
