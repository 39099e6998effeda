"""Unload is final (``patches/unload_final.py``), in SGLang's real ``TokenizerManager`` code: its
``load_lora_adapter``, ``unload_lora_adapter`` and ``_resolve_lora_path`` with the plugin's hooks,
against a scheduler stand-in that records what it loaded and can hold a call open. This makes the
interleavings of requests, loads and unloads of one name exact (the e2e tests in
``tests/e2e/test_unload_is_final.py`` run them through a real server, where the timing decides).

Each scenario runs for ``intel_xpu`` (plugin backend: hooked), for SGLang's ``csgmv`` with the
default scope (not hooked: SGLang's own behaviour, which the scenario must catch) and for ``csgmv``
with ``SGLANG_XPU_LORA_ADAPTER_CHECKS=all`` (hooked).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from sglang_xpu_lora.adapters import checked_backends

#: backend, SGLANG_XPU_LORA_ADAPTER_CHECKS, whether unloads are final there.
SCOPES = [("intel_xpu", None, True), ("csgmv", None, False), ("csgmv", "all", True)]


class Scheduler:
    """What the scheduler processes hold: name -> adapter path. A call whose ``(kind, name)`` is in
    :attr:`held` waits until the test sets that event."""

    def __init__(self):
        self.loaded: dict[str, str] = {}
        self.held: dict[tuple[str, str], asyncio.Event] = {}

    async def __call__(self, obj):
        from sglang.srt.managers.io_struct import LoadLoRAAdapterReqInput, LoRAUpdateOutput

        kind = "load" if isinstance(obj, LoadLoRAAdapterReqInput) else "unload"
        if (kind, obj.lora_name) in self.held:
            await self.held[(kind, obj.lora_name)].wait()
        if kind == "load" and obj.lora_name in self.loaded:
            return [LoRAUpdateOutput(success=False, error_message=f"{obj.lora_name} is already loaded", loaded_adapters=dict(self.loaded))]
        if kind == "load":
            self.loaded[obj.lora_name] = obj.lora_path
        else:
            self.loaded.pop(obj.lora_name)
        return [LoRAUpdateOutput(success=True, error_message="", loaded_adapters=dict(self.loaded))]


@pytest.fixture(params=SCOPES, ids=["intel_xpu", "csgmv", "csgmv-all"])
def scope(request, sglang_plugins_loaded, monkeypatch):
    """(backend, final): the LoRA settings SGLang's code reads (``get_lora``, ``get_parallel``) for
    that backend, with ``--max-loaded-loras 2``."""
    from sglang.srt import runtime_context
    from sglang.srt.managers import tokenizer_control_mixin, tokenizer_manager

    backend, checks, final = request.param
    lora = SimpleNamespace(enable_lora=True, lora_backend=backend, max_loaded_loras=2, lora_paths=None)
    parallel = SimpleNamespace(dp_size=1)
    for module in (runtime_context, tokenizer_control_mixin, tokenizer_manager):
        monkeypatch.setattr(module, "get_lora", lambda: lora)
        monkeypatch.setattr(module, "get_parallel", lambda: parallel)
    if checks:
        monkeypatch.setenv(checked_backends.ADAPTER_CHECKS_ENV, checks)
    else:
        monkeypatch.delenv(checked_backends.ADAPTER_CHECKS_ENV, raising=False)
    return backend, final


@pytest.fixture
def manager(scope):
    """A ``TokenizerManager`` with only its LoRA state (as ``init_lora`` makes it), talking to a
    :class:`Scheduler`."""
    from sglang.srt.lora.lora_registry import LoRARegistry
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    manager = object.__new__(TokenizerManager)
    manager.lora_registry = LoRARegistry()
    manager.lora_update_lock = asyncio.Lock()
    manager.lora_ref_cache, manager.pending_lora_unloads = {}, {}
    manager.update_lora_adapter_communicator = Scheduler()
    manager.auto_create_handle_loop = lambda: None
    return manager


async def load(manager, name, path):
    from sglang.srt.managers.io_struct import LoadLoRAAdapterReqInput

    return await manager.load_lora_adapter(LoadLoRAAdapterReqInput(lora_name=name, lora_path=path))


async def unload(manager, name):
    from sglang.srt.managers.io_struct import UnloadLoRAAdapterReqInput

    return await manager.unload_lora_adapter(UnloadLoRAAdapterReqInput(lora_name=name))


async def request(manager, name):
    """A request naming ``name``: the path SGLang serves it with, or its error message."""
    obj = SimpleNamespace(lora_path=name, lora_id=None)
    try:
        await manager._resolve_lora_path(obj)
    except ValueError as exc:
        return str(exc)
    await manager.lora_registry.release(obj.lora_id)  # the request finished
    return manager.lora_registry.get_all_adapters()[name].lora_path


def was_unloaded(name):
    """The start of the refusal of a request naming ``name`` after its unload, where unloads are
    final (``patches/request_checks.py`` says that it was unloaded)."""
    return f"LoRA adapter {name!r} was unloaded (load it again to serve it). Loaded adapters: "


def test_a_request_after_an_unload_is_refused_and_the_name_loads_new_weights(scope, manager):
    async def scenario():
        await load(manager, "a", "/old")
        unloaded = await unload(manager, "a")
        served = await request(manager, "a")
        loaded = await load(manager, "a", "/new")
        return unloaded, served, loaded, await request(manager, "a")

    unloaded, served, loaded, after = asyncio.run(scenario())
    assert unloaded.success
    if scope[1]:
        assert served.startswith(was_unloaded("a")), served
        assert loaded.success and after == "/new" == manager.update_lora_adapter_communicator.loaded["a"]
    else:  # SGLang alone: the old weights come back, and the new ones are refused
        assert served == "/old" and not loaded.success and after == "/old"


def test_a_request_while_the_unload_drains_is_refused(scope, manager):
    """The request arrives while SGLang's unload is under way (the scheduler call held open)."""

    async def scenario():
        scheduler = manager.update_lora_adapter_communicator
        await load(manager, "a", "/old")
        scheduler.held[("unload", "a")] = asyncio.Event()
        unloading = asyncio.create_task(unload(manager, "a"))
        await asyncio.sleep(0.01)  # the unload unregisters the name and waits for the scheduler
        during = asyncio.create_task(request(manager, "a"))
        await asyncio.sleep(0.01)
        scheduler.held[("unload", "a")].set()
        unloaded, served = await unloading, await during
        return unloaded, served, await request(manager, "a")

    unloaded, served, after = asyncio.run(scenario())
    assert unloaded.success
    if scope[1]:
        assert served.startswith("LoRA adapter 'a' is being unloaded. Loaded adapters: "), served
        assert after.startswith(was_unloaded("a")), after
        assert "a" not in manager.update_lora_adapter_communicator.loaded
    else:  # SGLang alone: the request loads the old weights back once the unload is done
        assert served == "/old" and after == "/old"


def test_a_load_the_unload_waited_for_is_unloaded_with_it(scope, manager):
    """A load of the name holds SGLang's update lock when the unload arrives; the unload then
    removes what it loaded, for good."""

    async def scenario():
        scheduler = manager.update_lora_adapter_communicator
        scheduler.held[("load", "a")] = asyncio.Event()
        loading = asyncio.create_task(load(manager, "a", "/new"))
        await asyncio.sleep(0.01)
        unloading = asyncio.create_task(unload(manager, "a"))
        await asyncio.sleep(0.01)
        scheduler.held[("load", "a")].set()
        loaded, unloaded = await loading, await unloading
        return loaded, unloaded, await request(manager, "a")

    loaded, unloaded, after = asyncio.run(scenario())
    assert loaded.success and unloaded.success
    if scope[1]:
        assert after.startswith(was_unloaded("a")), after
    else:
        assert after == "/new"


def test_evicted_adapters_are_loaded_again_and_an_unloaded_evicted_adapter_is_revoked(scope, manager):
    """``--max-loaded-loras 2``: a third load evicts the least recently used adapter, and a request
    loads it again with its path, on every backend. Unloading an evicted adapter succeeds and
    revokes it where unloads are final (SGLang alone: "does not exist", and it comes back)."""

    async def scenario():
        for name in ("a", "b", "c"):
            await load(manager, name, f"/{name}")
        evicted = sorted(set("abc") - set(manager.lora_registry.get_all_adapters()))
        reloaded = await request(manager, "a")  # evicts b
        unloaded = await unload(manager, "b")
        return evicted, reloaded, unloaded, await request(manager, "b")

    evicted, reloaded, unloaded, after = asyncio.run(scenario())
    assert evicted == ["a"] and reloaded == "/a"
    if scope[1]:
        assert unloaded.success and after.startswith(was_unloaded("b")), (unloaded, after)
        assert "b" not in manager.update_lora_adapter_communicator.loaded
    else:
        assert not unloaded.success and after == "/b"


def test_a_refused_request_releases_nothing(scope, manager):
    """SGLang's ``_release_lora_once`` schedules a release for every request with a ``lora_path``,
    also one refused before it acquired an adapter (``lora_id`` None). Where the hooks apply, that
    release returns and a held adapter keeps its count; SGLang alone raises ``TypeError`` in a task
    nobody awaits (logged as "Task exception was never retrieved", with its traceback)."""

    async def scenario():
        await load(manager, "a", "/a")
        held = SimpleNamespace(lora_path="a", lora_id=None)
        await manager._resolve_lora_path(held)  # a request on "a", still running
        refused = SimpleNamespace(lora_path="never", lora_id=None)
        with pytest.raises(ValueError, match="has never been loaded"):
            await manager._resolve_lora_path(refused)
        manager.enable_lora, manager._lora_release_tasks = True, set()
        task = manager._release_lora_once(SimpleNamespace(lora_released=False, obj=refused))
        await asyncio.wait([task])
        unload_waits = asyncio.ensure_future(manager.lora_registry.wait_for_unload(held.lora_id))
        await asyncio.sleep(0.05)
        return task.exception(), unload_waits.done()

    error, drained = asyncio.run(scenario())
    assert not drained  # the running request on "a" still holds its count
    if scope[1]:
        assert error is None
    else:
        assert isinstance(error, TypeError) and "lora_id must be either a string" in str(error), error
