"""Target: sglang.srt.utils.common.configure_logger (AFTER)
Why: SGLang loads plugins in every process (launcher, ``Engine``, each scheduler/TP worker,
    detokenizer) before it configures logging there, so a record logged by the plugin at load
    is lost (no handler yet) and a print bypasses the log level and format. The one line saying
    which plugin version serves which backends on which SGLang, in every process, is what a user
    pastes into an issue (vLLM's platform plugins log one such line per process).
How: an AFTER hook logs the plugin's line through the ``sglang_xpu_lora`` logger once SGLang has
    configured logging, once per process (keyed by pid, so a forked child logs its own); where
    logging already has a handler that would show the line when the plugin loads (SGLang
    configured it first, or the application did), it is logged at once instead. A handler left
    at WARNING by an earlier ``logging.basicConfig()`` (some of SGLang's imports leave one) does
    not count: the line waits for SGLang's level. ``HookRegistry`` also rebinds the
    ``from sglang.srt.utils import configure_logger`` copies every SGLang module holds.
Checked against: SGLang 0.5.23.
Remove when: SGLang logs the plugins it loaded after configuring logging.
"""

from __future__ import annotations

import logging
import os

from sglang_xpu_lora import __version__
from sglang_xpu_lora.patches.undo import UndoStack, queue_hook
from sglang_xpu_lora.registry import LoRABackendRegistry
from sglang_xpu_lora.upstream import targets
from sglang_xpu_lora.upstream.compat import resolve, sglang_version

logger = logging.getLogger("sglang_xpu_lora")


def queue_line(level: int, status: str, undo: UndoStack) -> None:
    """Log the plugin's line, ``sglang-xpu-lora VERSION loaded (SGLang VERSION, pid PID): status``,
    at ``level`` once in this process, as soon as SGLang has configured logging (see the module
    docstring).

    Raises:
        Exception: whatever resolving SGLang's ``configure_logger`` or hook registry raises.
    """
    resolve(targets.CONFIGURE_LOGGER)
    version = sglang_version()
    logged_in = {"pid": None}

    def log_once(configured: bool) -> None:
        if logged_in["pid"] == os.getpid():
            return
        if not configured and not (logging.getLogger().handlers and logger.isEnabledFor(level)):
            return  # no handler yet, or one at a level that would drop it: wait for SGLang's
        logged_in["pid"] = os.getpid()
        logger.log(level, "sglang-xpu-lora %s loaded (SGLang %s, pid %d): %s", __version__, version, os.getpid(), status)

    def after_configure_logger(result, *args, **kwargs):
        log_once(configured=True)
        return result

    queue_hook(targets.CONFIGURE_LOGGER, after_configure_logger, "AFTER", undo)
    log_once(configured=False)


def apply(registry: LoRABackendRegistry, undo: UndoStack) -> None:
    queue_line(logging.INFO, f"--lora-backend {', '.join(sorted(registry.specs()))} registered", undo)
