"""Target: sglang.srt.arg_groups.serving_hook.handle_missing_default_values (AROUND) and
    sglang.srt.arg_groups.lora_hook.check_lora_server_args (AFTER).
Why: a backend that needs a device (``intel_xpu`` needs ``xpu``) must fail at argument resolution
    with a message naming both flags, like SGLang's ``--sampling-backend intel_xpu`` check
    (``validate_device_sampling_backend``), not deep inside a kernel later; likewise a backend
    whose kernels are missing (the spec's ``preflight``), before any worker process starts. The
    message says which device SGLang picked and why when ``--device`` was not given, and a
    ``--device xpu`` that torch cannot see is refused before SGLang's memory sizing fails on it
    with "No GPU memory values found.". A refusal nobody catches ends the process with its
    message alone, not a traceback through SGLang's launcher.
How: ``handle_missing_default_values`` is the resolution step where SGLang fills in the device
    (``get_device``) when ``--device`` is not given; the AROUND hook sees the device before (the
    raw argument) and after, and turns SGLang's "No accelerator" error into the same refusal. The
    AFTER hook on ``check_lora_server_args`` runs the preflight (and the device check again, for a
    pipeline where another plugin replaced the resolution step). ``check_server_args`` and the
    resolution pipeline import both functions inside the function, so the patched module
    attributes are what they call. :class:`BackendArgumentError` ends an uncaught launcher with one
    ``error:`` line.
Checked against: SGLang 0.5.23.
Remove when: SGLang lets LoRA backends validate their own arguments.
"""

from __future__ import annotations

from typing import Any, Optional

from sglang_xpu_lora.patches.errors import BackendArgumentError
from sglang_xpu_lora.patches.undo import UndoStack, queue_hook
from sglang_xpu_lora.registry import LoRABackendRegistry, LoRABackendSpec
from sglang_xpu_lora.upstream import devices, targets
from sglang_xpu_lora.upstream.compat import resolve


def _lora_spec(registry: LoRABackendRegistry, cfg: Any) -> Optional[LoRABackendSpec]:
    """The plugin backend these arguments choose (None: LoRA off, or not a plugin backend)."""
    if not (cfg.enable_lora or cfg.lora_paths):
        return None
    return registry.get(cfg.lora_backend)


def device_refusal(spec: LoRABackendSpec, device: Optional[str], given: Optional[str]) -> Optional[str]:
    """Why ``spec`` cannot run on the resolved ``device`` (None: SGLang found none), or None when it
    can. ``given`` is the ``--device`` the user passed (None: SGLang picked ``device``).

    Raises:
        ValueError: from the spec's ``runs_on_other_devices`` for a misconfiguration.
    """
    if spec.device is None:
        return None
    hint = f"; {spec.other_devices_hint}" if spec.other_devices_hint else ""
    if device is None:
        return (
            f"--lora-backend {spec.name} requires --device {spec.device}, and SGLang found no device to "
            f"serve on (--device was not given): {devices.why_picked(None)}{hint}"
        )
    if device == spec.device:
        if devices.device_available(device):
            return None
        return (
            f"--lora-backend {spec.name} runs on --device {device}, but {devices.device_seen(device)}; "
            f"`sglang-xpu-lora doctor` shows what this Python sees{hint}"
        )
    picked = None if given else f"SGLang picked it: --device was not given and {devices.why_picked(device)}"
    return spec.device_error(device, picked)


def _refuse_device(registry: LoRABackendRegistry, server_args: Any) -> None:
    cfg = resolve(targets.RESOLVING_VIEW)(server_args)
    spec = _lora_spec(registry, cfg)
    if spec is None:
        return
    try:
        refusal = device_refusal(spec, cfg.device, server_args.device)
    except ValueError as exc:
        raise BackendArgumentError(str(exc)) from exc
    if refusal:
        raise BackendArgumentError(refusal)


def check_backend_device(registry: LoRABackendRegistry, server_args: Any) -> None:
    """Raise :class:`BackendArgumentError` when the chosen plugin backend cannot run on the resolved
    device (:func:`device_refusal`), or its preflight fails."""
    _refuse_device(registry, server_args)
    cfg = resolve(targets.RESOLVING_VIEW)(server_args)
    spec = _lora_spec(registry, cfg)
    if spec is not None and spec.preflight is not None:
        try:
            spec.preflight(cfg.device)
        except (RuntimeError, ValueError) as exc:
            raise BackendArgumentError(str(exc)) from exc


def apply(registry: LoRABackendRegistry, undo: UndoStack) -> None:
    def around_handle_missing_default_values(original, server_args, *args, **kwargs):
        given = resolve(targets.RESOLVING_VIEW)(server_args).device
        try:
            result = original(server_args, *args, **kwargs)
        except RuntimeError as exc:
            spec = _lora_spec(registry, resolve(targets.RESOLVING_VIEW)(server_args))
            if given is None and spec is not None and spec.device is not None and devices.picked_device()[0] is None:
                raise BackendArgumentError(device_refusal(spec, None, None)) from exc  # get_device found none
            raise
        _refuse_device(registry, server_args)
        return result

    def after_check_lora_server_args(result, server_args, *args, **kwargs):
        check_backend_device(registry, server_args)
        return result

    queue_hook(targets.CHECK_LORA_SERVER_ARGS, after_check_lora_server_args, "AFTER", undo)
    queue_hook(targets.HANDLE_MISSING_DEFAULT_VALUES, around_handle_missing_default_values, "AROUND", undo)
