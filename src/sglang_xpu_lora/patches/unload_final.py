"""Target: sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin.unload_lora_adapter
    (AROUND) and sglang.srt.lora.lora_registry.LoRARegistry.release (AROUND). They run where the
    ``TokenizerManager`` runs: the ``sglang serve`` launcher process (HTTP) or the process that
    made the ``sglang.Engine``; SGLang loads plugins there before it builds the manager.
Why: SGLang 0.5.23 remembers every adapter name ever loaded in ``TokenizerManager.lora_ref_cache``,
    so that an adapter evicted under ``--max-loaded-loras`` is loaded again when a request names it
    (sglang PR #11526). A user's ``unload_lora_adapter`` does not remove the name from that cache,
    and ``_resolve_lora_path`` loads again any unregistered name it finds there. So after a
    successful unload, a request naming the adapter loads its old weights and is answered with them
    (HTTP 200), and a later load of other weights under the name is refused "already loaded": an
    unload does not revoke the adapter (the same class of bug as TGI #2505). And a request refused
    for naming an adapter that is not loaded still has SGLang release the adapter it never
    acquired (``LoRARegistry.release(None)``), in a task nobody awaits: a ``TypeError`` logged as
    "Task exception was never retrieved", with its traceback, for every such request.
How: for adapters in scope (:mod:`sglang_xpu_lora.adapters.checked_backends`: plugin backends, all
    backends with ``SGLANG_XPU_LORA_ADAPTER_CHECKS=all``), an unload
    * removes the name from ``lora_ref_cache`` before SGLang unloads it. A request that read the
      old reference before that point has already queued its implicit load on SGLang's
      ``lora_update_lock`` (``_resolve_lora_path`` reads the cache and calls ``load_lora_adapter``,
      which enters the lock, without yielding in between), so that load runs before the unload and
      is undone by it; a request that reads the cache after finds nothing;
    * removes the name again once SGLang's unload succeeded, in the same step (no other coroutine
      runs in between): a load of the name that held the lock while the unload waited for it put
      its own reference there, and the unload removed its weights;
    * of an adapter evicted under ``--max-loaded-loras`` (cached, no longer registered) revokes it
      and succeeds, where SGLang answers "does not exist" and would keep loading it for requests.
    A request naming an unloaded adapter is then refused as unloaded (the manager remembers the
    names its users unloaded, :func:`unloaded_names`; the refusal is in
    :mod:`sglang_xpu_lora.patches.request_checks`: an error from ``Engine.generate``, HTTP 400),
    saying how many adapters are loaded and where to list them, not their names
    (:func:`loaded_count`; so does the refusal to unload a name that is not loaded, which SGLang
    answers with every loaded adapter's name),
    and a later load under the name loads the weights it names. Evicted adapters stay in the
    cache and are loaded again on request exactly as before. The release of a request that
    acquired nothing (``lora_id`` None: ``LoRARegistry.acquire`` looks every name up before it
    counts any, so a refused request holds no count) returns without touching the usage counters.
Checked against: SGLang 0.5.23 (the compat guard checks that ``_resolve_lora_path`` still loads from
    ``lora_ref_cache`` right where it reads it, that a load still records its reference there, and
    that its refusal to unload a name not registered still starts as :data:`SGLANG_NOT_REGISTERED`).
Remove when: SGLang removes a user-unloaded name from ``lora_ref_cache`` (``unload_lora_adapter``
    in ``tokenizer_control_mixin.py``) and releases only what a request acquired; no upstream issue
    tracks either yet.
"""

from __future__ import annotations

from typing import Any

from sglang_xpu_lora.adapters import checked_backends
from sglang_xpu_lora.patches.undo import UndoStack, queue_hook
from sglang_xpu_lora.registry import LoRABackendRegistry
from sglang_xpu_lora.upstream import targets
from sglang_xpu_lora.upstream.compat import resolve


def in_scope() -> bool:
    """Whether this process serves LoRA through a backend whose unloads are made final."""
    lora = resolve(targets.GET_LORA)()
    return bool(lora.enable_lora) and checked_backends.applies_to(lora.lora_backend)


#: The start of SGLang's refusal to unload an adapter that is not registered
#: (``LoRARegistry.unregister``), which goes on to list every loaded adapter's name; replaced by the
#: plugin's (:func:`unload_finally`). Anchored in ``upstream/targets.py``.
SGLANG_NOT_REGISTERED = "LoRA with name {name} does not exist. Loaded LoRAs: "

#: Attribute set on SGLang's ``TokenizerManager`` in scope: the names its users unloaded (a set).
UNLOADED_ATTR = "xpu_lora_unloaded"


def unloaded_names(manager: Any) -> frozenset[str]:
    """The adapter names unloaded through ``manager`` (in scope) since it started; a name loaded
    again stays in it (a request for it is served while it is loaded)."""
    return frozenset(getattr(manager, UNLOADED_ATTR, ()))


def _record_unload(manager: Any, lora_name: str) -> None:
    setattr(manager, UNLOADED_ATTR, unloaded_names(manager) | {lora_name})


#: Where a client finds the adapters a server serves: SGLang's OpenAI-compatible model list has one
#: entry per loaded adapter (``id`` its name), after the base model.
LIST_ADAPTERS = "GET /v1/models lists them"


def loaded_count(manager: Any) -> str:
    """``"Loaded adapters: N (GET /v1/models lists them)."``: how many adapters ``manager`` (SGLang's
    ``TokenizerManager``) has registered, the ones ``/v1/models`` lists, and where to list them,
    never their names (one tenant's refusal must not list every other tenant; at 1,000 adapters
    the list was 9 KB). Counted without copying the registry (``num_registered_loras``)."""
    return f"Loaded adapters: {manager.lora_registry.num_registered_loras} ({LIST_ADAPTERS})."


def is_registered(manager: Any, name: str) -> bool:
    """Whether adapter ``name`` is registered in ``manager``'s ``LoRARegistry`` (loaded, and not
    being unloaded): one lookup in the registry's mapping, as SGLang's own per-request lookups do
    (``LoRARegistry.acquire``), where ``get_all_adapters()`` copies all K entries. It reads without
    the registry's lock, as ``get_all_adapters`` does, and does not count as a use for the
    registry's LRU order (SGLang's ``acquire`` of the request does)."""
    return name in manager.lora_registry._registry


def why_not_loaded(manager: Any, name: str) -> str:
    """Why adapter ``name`` is not loaded in ``manager``: it is being unloaded, was unloaded
    (:func:`unloaded_names`), was evicted under ``--max-loaded-loras`` since the request was checked
    (remembered for an implicit reload), or was never loaded. A sentence without its final period, naming the adapter."""
    if name in manager.pending_lora_unloads:
        return f"LoRA adapter {name!r} is being unloaded"
    if name in unloaded_names(manager):
        return f"LoRA adapter {name!r} was unloaded (load it again to serve it)"
    if name in manager.lora_ref_cache:
        return f"LoRA adapter {name!r} was evicted under --max-loaded-loras while the request waited (send it again)"
    return f"LoRA adapter {name!r} has never been loaded"


def is_evicted(manager: Any, lora_name: str) -> bool:
    """Whether ``lora_name`` is an adapter evicted under ``--max-loaded-loras``: remembered in the
    manager's ``lora_ref_cache`` but neither registered nor waiting for an unload to complete."""
    return (
        lora_name in manager.lora_ref_cache
        and not is_registered(manager, lora_name)
        and lora_name not in manager.pending_lora_unloads
    )


async def unload_finally(original: Any, manager: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
    """SGLang's ``unload_lora_adapter(obj)`` on ``manager``, after which ``obj.lora_name`` is no longer
    loaded again by a request (see the module header).

    Returns:
        SGLang's ``LoRAUpdateOutput``; a success for an adapter that was evicted under
        ``--max-loaded-loras`` (SGLang reports it as not existing). SGLang's refusal of a name that
        is not loaded, which lists every loaded adapter's name, says instead why the name is not
        loaded (:func:`why_not_loaded`) and how many are (:func:`loaded_count`).
    """
    name = obj.lora_name
    evicted = is_evicted(manager, name)
    manager.lora_ref_cache.pop(name, None)
    result = await original(manager, obj, *args, **kwargs)
    if result.success:
        manager.lora_ref_cache.pop(name, None)  # a load that ran during the unload was undone by it
        _record_unload(manager, name)
        return result
    registered = manager.lora_registry.get_all_adapters()
    if evicted and name not in registered and name not in manager.pending_lora_unloads:
        _record_unload(manager, name)
        loaded = {lora_name: ref.lora_path for lora_name, ref in registered.items()}
        return resolve(targets.LORA_UPDATE_OUTPUT)(success=True, error_message="", loaded_adapters=loaded)
    if (result.error_message or "").startswith(SGLANG_NOT_REGISTERED.format(name=name)):
        result.error_message = f"{why_not_loaded(manager, name)}: nothing to unload. {loaded_count(manager)}"
    return result


def apply(registry: LoRABackendRegistry, undo: UndoStack) -> None:

    async def around_unload_lora_adapter(original, manager, obj, *args, **kwargs):
        if not in_scope():
            return await original(manager, obj, *args, **kwargs)
        return await unload_finally(original, manager, obj, *args, **kwargs)

    queue_hook(targets.TOKENIZER_UNLOAD_LORA_ADAPTER, around_unload_lora_adapter, "AROUND", undo)

    async def around_release(original, lora_registry, lora_id, *args, **kwargs):
        if lora_id is None and in_scope():
            return None  # a request refused before it acquired an adapter holds no count
        return await original(lora_registry, lora_id, *args, **kwargs)

    queue_hook(targets.LORA_REGISTRY_RELEASE, around_release, "AROUND", undo)
