"""Target: sglang.srt.arg_groups.lora_hook.check_lora_server_args (AFTER)
Why: a backend that needs a device (``intel_xpu`` needs ``xpu``) must fail at argument validation
    with a message naming both flags, like SGLang's ``--sampling-backend intel_xpu`` check
    (``validate_device_sampling_backend``), not deep inside a kernel later; likewise a backend
    whose kernels are missing (the spec's ``preflight``), before any worker process starts.
How: an AFTER hook; it runs after resolution, so an auto-detected device is already filled in.
    ``check_server_args`` imports ``check_lora_server_args`` inside the function, so the patched
    module attribute is what it calls.
Checked against: SGLang 0.5.23.
Remove when: SGLang lets LoRA backends validate their own arguments.
"""

from __future__ import annotations

from typing import Any

from sglang_xpu_lora.patches.undo import UndoStack, queue_hook
from sglang_xpu_lora.registry import LoRABackendRegistry
from sglang_xpu_lora.upstream import targets
from sglang_xpu_lora.upstream.compat import resolve


def check_backend_device(registry: LoRABackendRegistry, server_args: Any) -> None:
    """Raise ``ValueError`` when the chosen plugin backend cannot run on the resolved device, or
    its preflight fails."""
    cfg = resolve(targets.RESOLVING_VIEW)(server_args)
    if not cfg.enable_lora:
        return
    spec = registry.get(cfg.lora_backend)
    if spec is None:
        return
    error = spec.device_error(cfg.device)
    if error:
        raise ValueError(error)
    if spec.preflight is not None:
        try:
            spec.preflight(cfg.device)
        except RuntimeError as exc:
            raise ValueError(str(exc)) from exc


def apply(registry: LoRABackendRegistry, undo: UndoStack) -> None:
    def after_check_lora_server_args(result, server_args, *args, **kwargs):
        check_backend_device(registry, server_args)
        return result

    queue_hook(targets.CHECK_LORA_SERVER_ARGS, after_check_lora_server_args, "AFTER", undo)
