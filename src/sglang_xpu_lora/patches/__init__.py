"""The patch ledger: every change sglang-xpu-lora makes to SGLang, applied in this order, whole or
not at all.

=====================  ==========================================================================
module                 SGLang symbol, why, and when to remove (details in each module's header)
=====================  ==========================================================================
validation             ``arg_groups.serving_hook.handle_missing_default_values`` (AROUND) and
                       ``arg_groups.lora_hook.check_lora_server_args`` (AFTER): device check
                       naming ``--lora-backend`` and ``--device`` (and, without ``--device``,
                       which device SGLang picked and why) when SGLang resolves the device, and
                       the preflight; a refusal ends the launcher with one ``error:`` line.
                       Remove when backends can validate their own arguments.
mem_pool               ``LoRAManager.init_memory_pool`` and
                       ``LoRAMemoryPool.load_lora_weight_to_buffer`` (AROUND): slots zeroed
                       before each load for backends that declare it. Remove when SGLang zeroes
                       dense slots itself.
adapter_checks         ``check_lora_server_args`` (AFTER), ``LoRAManager.validate_new_adapter`` and
                       ``_load_lora_adapter[_from_tensors]`` (AROUND),
                       ``LoRAAdapter._normalize_weights`` (BEFORE): every ``adapter_config.json`` field honoured
                       (rsLoRA, alpha/rank patterns, regex targets, partial q/k/v) or refused at
                       load, tensors finite and shaped for the model, nothing left after a failed
                       load; local adapter paths with their files, target modules the model
                       has and no added tokens, for ``--lora-paths`` before the model loads; for
                       plugin backends (all with ``SGLANG_XPU_LORA_ADAPTER_CHECKS=all``).
                       Remove when SGLang honours every ``LoraConfig`` field itself.
embedding_logits       ``LogitsProcessor.forward`` (AROUND): a model that computes its logits from
                       its tied ``embed_tokens`` (Gemma, Cohere, MiniCPM, ...) gets the base
                       embedding as its logits head when LoRA wraps ``embed_tokens`` (SGLang hands
                       the wrapper over and the scheduler dies: an embedding lookup of hidden
                       states); PEFT's tied lm_head reads the base weight too. For plugin backends
                       (all with ``SGLANG_XPU_LORA_ADAPTER_CHECKS=all``). Remove when SGLang keeps
                       the base embedding as the logits head (sglang #7554).
unload_final           ``TokenizerControlMixin.unload_lora_adapter`` (AROUND), in the
                       TokenizerManager's process: an unloaded adapter is no longer loaded again
                       by a request that names it (SGLang keeps every name in ``lora_ref_cache``
                       for the implicit reload of adapters evicted under ``--max-loaded-loras``,
                       sglang PR #11526; cf. TGI #2505), so it is refused as unloaded (HTTP 400,
                       ``request_checks``) and a later load under its name loads the new weights;
                       evicted adapters are reloaded as before. ``LoRARegistry.release``
                       (AROUND): a request refused for naming an adapter that is not loaded
                       releases nothing (SGLang logs a ``TypeError`` traceback for each). For
                       plugin backends (all with ``SGLANG_XPU_LORA_ADAPTER_CHECKS=all``). Remove
                       when SGLang drops a user-unloaded name from ``lora_ref_cache`` and releases
                       only what a request acquired.
request_checks         ``GenerateReqInput`` / ``EmbeddingReqInput.normalize_batch_and_arguments``
                       and ``TokenizerManager._resolve_lora_path`` (AROUND), in the
                       TokenizerManager's process: a request's ``lora_path`` and ``lora_id`` are
                       None, a string or, for a batch, a list with one string or None per prompt,
                       and ``lora_id`` comes only with a ``lora_path``, or the request is refused
                       naming the field and the lengths (HTTP 400) where SGLang's scheduler
                       would die (a list for one prompt, a ``lora_id`` alone), answer HTTP 500 or
                       drop entries; an adapter that is not loaded is refused as unloaded or as
                       never loaded, with how many adapters are loaded, never their names (SGLang's
                       refusals list them all). For plugin backends (all with
                       ``SGLANG_XPU_LORA_ADAPTER_CHECKS=all``). Remove when SGLang checks a
                       request's LoRA fields against its batch.
backend_registry       ``lora_registry.LORA_SUPPORTED_BACKENDS`` via ``register_lora_backend``:
                       make plugin backends resolvable. SGLang's API; permanent.
cli_choices            ``ServerArgs`` ``lora_backend`` ``Arg.choices``: let argparse accept plugin
                       backends. Remove when SGLang derives choices from the registry.
startup_failure        ``entrypoints.engine._set_envs_and_config`` (AFTER),
                       ``_wait_for_scheduler_ready`` (AROUND), ``Scheduler.__init__`` (AROUND),
                       ``TokenizerManager.__init__`` (AFTER): a scheduler that fails to start (what
                       only the loaded model shows) ends ``Engine(...)`` with an exception in the
                       caller naming the failure (the failed launch's sockets closed), and
                       ``sglang serve`` with the message alone, instead of the scheduler's
                       SIGQUIT killing the caller's process (from any thread: the scheduler exits
                       and the wait raises). For plugin backends (all with
                       ``SGLANG_XPU_LORA_ADAPTER_CHECKS=all``). Remove when SGLang raises
                       scheduler start-up failures in the caller.
log_lines              ``sglang.srt.utils.common.configure_logger`` (AFTER): the plugin's one line
                       per process (its version, SGLang's, the backends registered) once SGLang
                       has configured logging. Remove when SGLang logs the plugins it loaded
                       after configuring logging.
=====================  ==========================================================================

Only when the plugin registers no backend (:func:`apply_refusal`, instead of the above):

=====================  ==========================================================================
refusal                ``ServerArgs.resolve_once`` (BEFORE) and the ``--lora-backend`` choices:
                       the backend names parse and fail when the arguments are resolved, before
                       SGLang's own resolution and validation, with the reason the plugin
                       registered nothing. Remove when SGLang reports unavailable plugin backends.
log_lines              as above, at WARNING: no LoRA backend registered, and why.
=====================  ==========================================================================

Order: every hook is queued before any backend becomes selectable (``Engine(lora_backend=...)``
resolves through the backend registry without argparse, so a backend registered before its pool
hook would be usable without it), and the log line, which says the backends are registered, comes
last. Whole or not at all: each patch records how to undo every step it
takes (:mod:`.undo`); when one raises, :func:`apply_all` undoes all steps taken so far and raises
:class:`PartialApplicationError`. As a last line of defence the backend itself refuses a memory
pool without the layout its ops need (``IntelXpuLoRABackend`` checks at its first batch).

Not patched, on purpose: graph batch-info sizing. SGLang 0.5.23's ``PrefillCudaGraphRunner`` already
passes ``max_num_requests=`` to ``init_prefill_cuda_graph_batch_info``, which the backend inherits
from ``TritonLoRABackend``; the compat guard checks that call site, so a host without it is
reported instead of silently mis-sized.

Hooks go through ``sglang.srt.plugins.hook_registry.HookRegistry``; ``load_plugins()`` applies them
after every general plugin ran.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable

from sglang_xpu_lora.patches import (
    adapter_checks, backend_registry, cli_choices, embedding_logits, log_lines, mem_pool, refusal,
    request_checks, startup_failure, unload_final, validation,
)
from sglang_xpu_lora.patches.undo import UndoStack
from sglang_xpu_lora.registry import LoRABackendRegistry

PATCHES = (
    validation, mem_pool, adapter_checks, embedding_logits, unload_final, request_checks,
    startup_failure, backend_registry, cli_choices, log_lines,
)


class PartialApplicationError(RuntimeError):
    """A patch failed; every step applied before it was undone. ``undone`` lists those steps."""

    def __init__(self, patch: str, cause: BaseException, undone: list[str]):
        steps = "; ".join(undone) or "nothing had been applied"
        super().__init__(f"patch {patch} failed ({type(cause).__name__}: {cause}); rolled back: {steps}")
        self.patch, self.undone = patch, undone


def apply_all(registry: LoRABackendRegistry) -> None:
    """Register every plugin backend with SGLang and queue the hooks (see the ledger above).

    Raises:
        PartialApplicationError: when a patch raised; nothing of any patch is left applied.
    """
    _apply_whole([(patch.__name__.rsplit(".", 1)[-1], lambda undo, patch=patch: patch.apply(registry, undo)) for patch in PATCHES])


def apply_refusal(names: Iterable[str], reasons: list[str]) -> None:
    """Instead of :func:`apply_all`, when the plugin registers no backend: ``--lora-backend NAME``
    parses for each of ``names`` and fails with ``reasons`` when the server arguments are resolved
    (:mod:`.refusal`), and each process logs that no backend is registered, and why (:mod:`.log_lines`).

    Raises:
        PartialApplicationError: when this host lacks what even that needs; nothing is left applied.
    """
    names = tuple(names)
    status = f"no LoRA backend registered: {'; '.join(reasons)}"
    _apply_whole([
        ("refusal", lambda undo: refusal.apply(names, reasons, undo)),
        ("log_lines", lambda undo: log_lines.queue_line(logging.WARNING, status, undo)),
    ])


def _apply_whole(steps: list[tuple[str, Callable[[UndoStack], None]]]) -> None:
    undo = UndoStack()
    for name, step in steps:
        try:
            step(undo)
        except Exception as exc:
            raise PartialApplicationError(name, exc, undo.unwind()) from exc
