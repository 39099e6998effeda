"""What a LoRA backend declares about itself when it joins through ``sglang.lora_backends``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union


@dataclass(frozen=True)
class LoRABackendSpec:
    """One LoRA backend offered to SGLang.

    :param name: the ``--lora-backend`` value (e.g. ``"intel_xpu"``).
    :param factory: zero-argument callable returning the backend class (a subclass of SGLang's
        ``BaseLoRABackend``); called lazily by SGLang's ``get_backend_from_name`` only when the
        backend is chosen, so heavy imports belong inside it.
    :param device: the device the backend needs (``"xpu"``), or None for any device.
    :param runs_on_other_devices: optional callable taking the resolved device name; returning True
        lets the backend run on a device other than ``device`` (e.g. when portable kernels were
        selected). It may raise ``ValueError`` to report a misconfiguration.
    :param other_devices_hint: appended to the device error: how to run elsewhere.
    :param preflight: optional callable taking the resolved device name (or None), run at argument
        validation when the backend is selected (before any process starts); it raises
        ``ValueError`` or ``RuntimeError`` with an actionable message when the backend cannot start
        (e.g. a required kernel is missing, or its kernels cannot run on that device).
    :param needs_zeroed_lora_slots: the backend's kernels contract over the full
        ``max_lora_rank``, so the memory pool must zero each slot before an adapter is loaded into
        it: zero rank tails, nothing left of a previous tenant (see
        :mod:`sglang_xpu_lora.patches.mem_pool`). A bool, or a callable given the backend instance
        when the instance decides (``intel_xpu``: from the ops it selected). This is the one place
        the plugin's pool patch reads it from.
    :param receives_memory_pool: optional callable ``(backend instance, pool)``: the plugin's pool
        patch hands the backend its manager's ``LoRAMemoryPool`` through it once the pool is built
        (``intel_xpu`` checks the pool before serving and sizes its trial captures from it).
    """

    name: str
    factory: Callable[[], type]
    device: Optional[str] = None
    runs_on_other_devices: Optional[Callable[[Optional[str]], bool]] = None
    other_devices_hint: str = ""
    preflight: Optional[Callable[[Optional[str]], object]] = None
    needs_zeroed_lora_slots: Union[bool, Callable[[object], bool]] = False
    receives_memory_pool: Optional[Callable[[object, object], None]] = None

    def zeroed_slots_needed(self, backend: object) -> bool:
        """Whether ``backend``, an instance of this spec's backend, needs zeroed pool slots."""
        needed = self.needs_zeroed_lora_slots
        return bool(needed(backend) if callable(needed) else needed)

    def device_error(self, device: Optional[str], picked_because: Optional[str] = None) -> Optional[str]:
        """The validation error for running on ``device``, or None when it is allowed.

        :param picked_because: when the user did not choose ``device``, who did and why (a clause
            shown after it, e.g. "SGLang picked it: --device was not given and ...").
        Raises:
            ValueError: propagated from ``runs_on_other_devices`` for a misconfiguration.
        """
        if self.device is None or device == self.device:
            return None
        if self.runs_on_other_devices is not None and self.runs_on_other_devices(device):
            return None
        message = f"--lora-backend {self.name} requires --device {self.device}, got --device {device}"
        if picked_because:
            message += f" ({picked_because})"
        return f"{message}; {self.other_devices_hint}" if self.other_devices_hint else message
