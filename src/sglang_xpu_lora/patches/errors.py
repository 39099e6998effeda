"""The error the patches end a launch with when the server arguments cannot be served."""

from __future__ import annotations


class BackendArgumentError(SystemExit, ValueError):
    """These server arguments cannot be served by a plugin backend: a device it cannot run on, its
    kernels missing, the plugin could not register it at all (:mod:`.refusal`), an adapter in
    ``--lora-paths`` or the LoRA target modules are refused (:mod:`.adapter_checks`), or a
    scheduler process failed to start (:mod:`.startup_failure`: what only the loaded model shows);
    the message says why and what to do.

    A ``ValueError`` like SGLang's own validation errors (``except ValueError`` and ``except
    Exception`` catch it, e.g. around ``sglang.Engine(...)``), and a ``SystemExit`` whose code is
    ``"error: <message>"``, so a launcher that does not catch it (``sglang serve``, ``python -m
    sglang.launch_server``) exits with status 1 and prints that message alone, not a traceback
    through SGLang's start-up. (Uncaught in a thread other than the main one, a ``SystemExit`` ends
    that thread without a message: catch ``ValueError`` around an ``Engine`` built in a thread.)
    """

    def __init__(self, message: str):
        super().__init__(message)
        self.code = f"error: {message}"
