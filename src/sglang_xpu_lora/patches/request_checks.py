"""Targets: sglang.srt.arg_groups.lora_hook.check_lora_server_args (AFTER),
    sglang.srt.managers.io_struct.GenerateReqInput.normalize_batch_and_arguments and
    ``EmbeddingReqInput.normalize_batch_and_arguments`` (AROUND), and
    sglang.srt.managers.tokenizer_manager.TokenizerManager._resolve_lora_path (AROUND). They run
    where the ``TokenizerManager`` runs (the ``sglang serve`` launcher process, or the process that
    made the ``sglang.Engine``): every request of ``/generate``, ``/v1/completions``,
    ``/v1/chat/completions`` (streamed or not) and ``Engine.generate`` / ``async_generate`` is
    normalised there first, and its adapters resolved right after.
Why: SGLang 0.5.23 checks neither the shape nor the entries of a request's ``lora_path`` and
    ``lora_id`` for a single prompt, nor their length for a batch. One prompt with a
    ``lora_path`` list reaches the scheduler with a list of adapter ids and kills it (the server
    or the engine process dies: ``TypeError: can only concatenate str (not "list") to str`` in
    ``Req.__init__``); so does a ``lora_id`` without ``lora_path``, which the scheduler looks up
    as an adapter id; a batch with fewer ``lora_path`` entries than prompts is an HTTP 500
    (``IndexError`` when the batch is split); more entries than prompts are ignored silently.
    A request naming an adapter that was unloaded is refused as "never been loaded"; that refusal,
    like the one of a name never loaded, lists every loaded adapter's name.
How: for servers in scope (:mod:`sglang_xpu_lora.adapters.checked_backends`: plugin backends, all
    backends with ``SGLANG_XPU_LORA_ADAPTER_CHECKS=all``), a request's LoRA fields are checked
    around SGLang's own normalisation (:func:`check_entries` before it, :func:`check_lengths`
    with the batch size it found): ``lora_path`` and ``lora_id`` are each None, a string, or a
    list of strings and Nones; a list only for a batch (several prompts, or one prompt sampled
    ``n`` > 1 times), with one entry per prompt (SGLang repeats each for the ``n`` samples);
    ``lora_id`` (the adapter id SGLang sets from ``lora_path``) only with a ``lora_path``. Anything
    else is a ``ValueError`` naming the field, the length found and the length expected (HTTP 400,
    an error event in a ``/generate`` stream; an exception from ``Engine.generate``), before the
    request is registered, so nothing else is affected. The OpenAI ``model: "<base>:<adapter>"``
    form arrives as a string ``lora_path``. When the request's adapters are resolved, a name that
    is neither loaded nor remembered for the implicit reload of evicted adapters is refused saying
    whether it is being unloaded, was unloaded
    (:func:`sglang_xpu_lora.patches.unload_final.unloaded_names`) or was never loaded, with how
    many adapters are loaded and where to list them (``GET /v1/models``), never their names
    (SGLang lists every loaded adapter's name in its refusal: 9 KB at 1,000 adapters, and one
    tenant learns every other's name); SGLang's own such refusals, which a request meets when an
    unload or an eviction lands between the plugin's check and SGLang's, are replaced by the
    plugin's. Since the hooks run only in processes that load plugins, a server
    in scope with ``--tokenizer-worker-num`` above 1 (extra tokenizer workers that SGLang starts
    without loading plugins) is refused at argument validation.
Checked against: SGLang 0.5.23 (the compat guard checks that ``normalize_batch_and_arguments``
    still sets ``is_single`` and ``batch_size``, that SGLang still repeats ``lora_path`` for the
    ``n`` samples, and that its refusals of an adapter not loaded still start as
    :data:`SGLANG_NOT_LOADED` says).
Remove when: SGLang checks a request's LoRA fields against its batch (``_normalize_lora_paths`` of
    ``GenerateReqInput``) and ``lora_id`` is no longer a request field; no upstream issue yet.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sglang_xpu_lora.adapters import checked_backends
from sglang_xpu_lora.patches import unload_final
from sglang_xpu_lora.patches.errors import BackendArgumentError
from sglang_xpu_lora.patches.undo import UndoStack, queue_hook
from sglang_xpu_lora.registry import LoRABackendRegistry
from sglang_xpu_lora.upstream import targets
from sglang_xpu_lora.upstream.compat import TESTED_SGLANG, resolve

if TYPE_CHECKING:
    from sglang.srt.managers.io_struct import EmbeddingReqInput, GenerateReqInput

#: The request fields that name adapters, as SGLang's request classes spell them.
LORA_FIELDS = ("lora_path", "lora_id")


def check_entries(lora_path: Any, lora_id: Any) -> None:
    """Check a request's LoRA fields as given, before SGLang normalises them: each is None, a string
    or a list of strings and Nones, and ``lora_id`` names adapters only with a ``lora_path``.

    Raises:
        ValueError: naming the field (and the list entry) and what it holds.
    """
    for field, value in zip(LORA_FIELDS, (lora_path, lora_id)):
        if value is None:
            continue
        if isinstance(value, str):
            check_name(field, value)
            continue
        if not isinstance(value, list):
            raise ValueError(
                f"{field} must be an adapter name (a string), None, or a list of those, "
                f"not {type(value).__name__}"
            )
        for index, entry in enumerate(value):
            if entry is not None and not isinstance(entry, str):
                raise ValueError(
                    f"{field}[{index}] must be an adapter name (a string) or None, "
                    f"not {type(entry).__name__}"
                )
            if entry is not None:
                check_name(f"{field}[{index}]", entry)
    ids = [lora_id] if isinstance(lora_id, str) else [i for i in lora_id or () if i is not None]
    if ids and not lora_path:
        raise ValueError(
            "lora_id is the adapter id SGLang sets from lora_path, and this request has no "
            "lora_path; name the adapters in lora_path"
        )


def check_name(field: str, name: str) -> None:
    """An adapter name given in a request must name one: SGLang 0.5.23 serves an empty
    ``lora_path`` for one prompt with the base model and refuses it in a batch or with ``n`` > 1
    samples as an adapter never loaded.

    Raises:
        ValueError: for an empty (or blank) name, naming ``field``.
    """
    if not name.strip():
        raise ValueError(f"{field} is an empty adapter name; name a loaded adapter, or give None for the base model")


def check_lengths(field: str, value: Any, single: bool, prompts: int, samples: int) -> None:
    """Check one LoRA field as given against the batch SGLang found when it normalised the request.

    :param value: the field as the request gave it (checked by :func:`check_entries`).
    :param single: whether SGLang serves the request as one prompt (``is_single``).
    :param prompts: the number of prompts (SGLang's ``batch_size``, before the ``n`` samples).
    :param samples: the ``n`` parallel samples per prompt (SGLang repeats a list for each).
    Raises:
        ValueError: a list for a single prompt, or a list whose length is not ``prompts``, naming
            the field, the length found and the length expected.
    """
    if not isinstance(value, list):
        return
    if single:
        raise ValueError(
            f"{field} is a list of {len(value)} for a single prompt; expected an adapter name "
            "(a string) or None (a list is for a batch of prompts, one entry per prompt)"
        )
    if len(value) != prompts:
        repeated = f"; SGLang repeats each entry for the n={samples} samples" if samples > 1 else ""
        plural = "s" if prompts != 1 else ""
        entries = "entry" if len(value) == 1 else "entries"
        raise ValueError(
            f"{field} has {len(value)} {entries} for a batch of {prompts} prompt{plural}; expected "
            f"{prompts}, one per prompt (or one string for all){repeated}"
        )


def normalize_checked(original: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
    """SGLang's ``obj.normalize_batch_and_arguments()``, with the request's LoRA fields checked
    (:func:`check_entries` before it, :func:`check_lengths` against the batch it found).

    Raises:
        ValueError: see :func:`check_entries` and :func:`check_lengths`; or SGLang's own.
    """
    given = (obj.lora_path, obj.lora_id)  # as LORA_FIELDS lists them
    check_entries(*given)
    result = original(obj, *args, **kwargs)
    samples = samples_per_prompt(obj)
    for field, value in zip(LORA_FIELDS, given):
        check_lengths(field, value, obj.is_single, obj.batch_size, samples)
    return result


def samples_per_prompt(obj: Any) -> int:
    """The ``n`` parallel samples per prompt SGLang found when it normalised ``obj``: a
    ``GenerateReqInput``'s ``parallel_sample_num``; an ``EmbeddingReqInput`` samples once."""
    if isinstance(obj, resolve(targets.GENERATE_REQ_INPUT)):
        return generated_samples(obj)
    return 1


def generated_samples(obj: Any) -> int:
    """``GenerateReqInput.parallel_sample_num`` (set by its normalisation)."""
    return obj.parallel_sample_num


#: SGLang's own refusals of a request whose adapter is not loaded, which list every loaded adapter's
#: name (``TokenizerManager._resolve_lora_path``, ``LoRARegistry.acquire``); the plugin reaches
#: them only in a race (an unload or eviction between its check and SGLang's) and says the same
#: in its own words (:func:`short_refusal`). Anchored in ``upstream/targets.py``.
SGLANG_NOT_LOADED = (
    "Got LoRA adapter that has never been loaded: ",
    "The following requested LoRA adapters are not loaded: ",
)


def refusal(manager: Any, names: Any) -> str:
    """The refusal of a request naming ``names`` (adapters that are not loaded): why, per name
    (:func:`sglang_xpu_lora.patches.unload_final.why_not_loaded`), then
    :func:`sglang_xpu_lora.patches.unload_final.loaded_count`."""
    reasons = "; ".join(unload_final.why_not_loaded(manager, name) for name in names)
    return f"{reasons}. {unload_final.loaded_count(manager)}"


def refuse_unknown_adapters(manager: Any, lora_path: Any) -> None:
    """Refuse a request (its ``lora_path``, normalised) that names an adapter ``manager`` neither
    has registered nor remembers for an implicit reload (an adapter evicted under
    ``--max-loaded-loras``); SGLang would refuse it as never loaded, listing every loaded adapter.

    Each name is looked up directly (:func:`~sglang_xpu_lora.patches.unload_final.is_registered`, then
    the cache), so a request costs its own names' lookups whatever the number of loaded adapters
    (no copy of the registry per request).

    Raises:
        ValueError: :func:`refusal`: per such adapter (sorted, each once), whether it is being
            unloaded, was unloaded or was never loaded; then how many adapters are loaded and
            where to list them, never their names.
    """
    names = [lora_path] if isinstance(lora_path, str) else lora_path or ()
    unknown = sorted({
        name for name in names
        if name is not None and not unload_final.is_registered(manager, name) and name not in manager.lora_ref_cache
    })
    if unknown:
        raise ValueError(refusal(manager, unknown))


def short_refusal(manager: Any, error: ValueError) -> ValueError | None:
    """For SGLang's own refusal ``error`` of an adapter that is not loaded (:data:`SGLANG_NOT_LOADED`,
    which lists every loaded adapter), the plugin's :func:`refusal` of the adapter it names; None
    for any other error."""
    message = str(error)
    for prefix in SGLANG_NOT_LOADED:
        if message.startswith(prefix):
            return ValueError(refusal(manager, [message[len(prefix):].split("\n", 1)[0]]))
    return None


async def resolve_checked(
    original: Any, manager: Any, obj: GenerateReqInput | EmbeddingReqInput, *args: Any, **kwargs: Any
) -> Any:
    """SGLang's ``manager._resolve_lora_path(obj)`` after :func:`refuse_unknown_adapters`; SGLang's
    own refusals of an adapter not loaded (an unload or eviction that landed after the check) are
    replaced by the plugin's (:func:`short_refusal`).

    Raises:
        ValueError: see :func:`refuse_unknown_adapters`; SGLang's other refusals as SGLang raises them.
    """
    refuse_unknown_adapters(manager, obj.lora_path)
    try:
        return await original(manager, obj, *args, **kwargs)
    except ValueError as exc:
        short = short_refusal(manager, exc)
        if short is None:
            raise
        raise short from None


def refuse_extra_tokenizer_workers(server_args: Any) -> None:
    """At argument validation: refuse ``--tokenizer-worker-num`` above 1 for servers in scope.
    SGLang 0.5.23 runs the extra tokenizer workers in processes that do not load plugins, so no
    request there would be checked, nor an unload made final (a ``lora_path`` list for one prompt
    would kill the scheduler, and with it every tenant's requests).

    Raises:
        BackendArgumentError: naming the flag, why, and what to run instead.
    """
    cfg = resolve(targets.RESOLVING_VIEW)(server_args)
    if not cfg.enable_lora or not checked_backends.applies_to(cfg.lora_backend):
        return
    if cfg.tokenizer_worker_num > 1:
        raise BackendArgumentError(
            f"--tokenizer-worker-num {cfg.tokenizer_worker_num} with --lora-backend {cfg.lora_backend}: "
            f"SGLang {TESTED_SGLANG} does not load plugins in its extra tokenizer worker processes, so "
            "the LoRA request checks and final unloads of sglang-xpu-lora would not run there (a "
            "malformed lora_path would stop the scheduler for every tenant); serve with "
            "--tokenizer-worker-num 1 (the default)"
        )


def apply(registry: LoRABackendRegistry, undo: UndoStack) -> None:
    def after_check_lora_server_args(result, server_args, *args, **kwargs):
        refuse_extra_tokenizer_workers(server_args)
        return result

    def around_normalize(original, obj, *args, **kwargs):
        if not unload_final.in_scope():
            return original(obj, *args, **kwargs)
        return normalize_checked(original, obj, *args, **kwargs)

    async def around_resolve_lora_path(original, manager, obj, *args, **kwargs):
        if not unload_final.in_scope():
            return await original(manager, obj, *args, **kwargs)
        return await resolve_checked(original, manager, obj, *args, **kwargs)

    queue_hook(targets.CHECK_LORA_SERVER_ARGS, after_check_lora_server_args, "AFTER", undo)
    queue_hook(targets.GENERATE_REQ_NORMALIZE, around_normalize, "AROUND", undo)
    queue_hook(targets.EMBEDDING_REQ_NORMALIZE, around_normalize, "AROUND", undo)
    queue_hook(targets.TOKENIZER_RESOLVE_LORA_PATH, around_resolve_lora_path, "AROUND", undo)

