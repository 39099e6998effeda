"""A request's LoRA fields checked where it enters (``patches/request_checks.py``), on SGLang's real
request classes and ``TokenizerManager`` code with the plugin's hooks.

Each malformed request is run where the hooks apply (``intel_xpu``; ``csgmv`` with
``SGLANG_XPU_LORA_ADAPTER_CHECKS=all``) and where they do not (``csgmv`` by default): the first
refuses it naming the field and the lengths; the second shows what SGLang alone lets through (which
``tests/e2e/test_request_checks_served.py`` shows killing the server, answering HTTP 500 or dropping
entries). The unloaded/never-loaded refusals run on a ``TokenizerManager`` with only its LoRA state.
"""

from __future__ import annotations

import asyncio
import re
from types import SimpleNamespace

import pytest

from sglang_xpu_lora.adapters import checked_backends
from sglang_xpu_lora.patches.errors import BackendArgumentError

#: backend, SGLANG_XPU_LORA_ADAPTER_CHECKS, whether requests are checked there.
SCOPES = [("intel_xpu", None, True), ("csgmv", None, False), ("csgmv", "all", True)]

SINGLE_LIST = "is a list of {} for a single prompt; expected an adapter name (a string) or None"
TYPE = "must be an adapter name (a string), None, or a list of those, not "
ENTRY = "must be an adapter name (a string) or None, not "
EMPTY = "is an empty adapter name; name a loaded adapter, or give None for the base model"
LORA_ID_ALONE = "lora_id is the adapter id SGLang sets from lora_path, and this request has no "


def batch_length(found: int, prompts: int) -> str:
    plural = "s" if prompts != 1 else ""
    entries = f"lora_path has {found} entr{'y' if found == 1 else 'ies'}"
    return f"{entries} for a batch of {prompts} prompt{plural}; expected {prompts}"


#: (request fields, the refusal where checked). SGLang alone normalises each of them without a
#: word, but for the one in SGLANG_REFUSES.
REFUSED = [
    ({"text": "p", "lora_path": ["a", "b"]}, "lora_path " + SINGLE_LIST.format(2)),
    ({"text": "p", "lora_path": ["a"]}, "lora_path " + SINGLE_LIST.format(1)),
    ({"input_ids": [1, 2], "lora_path": []}, "lora_path " + SINGLE_LIST.format(0)),
    ({"text": ["p", "q", "r"], "lora_path": ["a", "b"]}, batch_length(2, 3)),
    ({"text": ["p", "q"], "lora_path": ["a", "b", None]}, batch_length(3, 2)),
    ({"input_ids": [[1], [2]], "lora_path": []}, batch_length(0, 2)),
    (  # n=2 makes one prompt a batch of one; SGLang repeats the list for the samples
        {"text": "p", "lora_path": ["a", "b"], "sampling_params": {"n": 2}},
        batch_length(2, 1) + ", one per prompt (or one string for all); SGLang repeats each entry "
        "for the n=2 samples",
    ),
    ({"text": ["p", "q"], "lora_path": ["a"] * 4, "sampling_params": {"n": 2}}, batch_length(4, 2)),
    ({"text": "p", "lora_path": ("a",)}, "lora_path " + TYPE + "tuple"),
    ({"text": "p", "lora_path": 3}, "lora_path " + TYPE + "int"),
    ({"text": ["p", "q"], "lora_path": 3}, "lora_path " + TYPE + "int"),
    ({"text": ["p", "q"], "lora_path": [["a"], None]}, "lora_path[0] " + ENTRY + "list"),
    ({"text": ["p", "q"], "lora_path": ["a", 1]}, "lora_path[1] " + ENTRY + "int"),
    ({"text": "p", "lora_id": "some-id"}, LORA_ID_ALONE),
    ({"text": ["p", "q"], "lora_id": [None, "some-id"]}, LORA_ID_ALONE),
    ({"text": "p", "lora_path": "a", "lora_id": ["x", "y"]}, "lora_id " + SINGLE_LIST.format(2)),
    ({"text": ["p", "q"], "lora_path": ["a"]}, batch_length(1, 2)),  # "1 entry"
    # an empty name: SGLang alone serves one prompt with the base model, refuses it for n=2
    ({"text": "p", "lora_path": ""}, "lora_path " + EMPTY),
    ({"text": "p", "lora_path": " ", "sampling_params": {"n": 2}}, "lora_path " + EMPTY),
    ({"text": ["p", "q"], "lora_path": ["a", ""]}, "lora_path[1] " + EMPTY),
    ({"text": "p", "lora_path": "a", "lora_id": ""}, "lora_id " + EMPTY),
]
#: SGLang alone refuses this one itself, in its own words (its type check of a batch's list).
SGLANG_REFUSES = {10}

#: (request fields, lora_path after SGLang's normalisation): served as before where checked.
ACCEPTED = [
    ({"text": "p", "lora_path": "a"}, "a"),
    ({"text": "p", "lora_path": None}, None),
    ({"text": "p", "lora_path": "a", "sampling_params": {"n": 2}}, ["a", "a"]),
    ({"text": "p", "lora_path": ["a"], "sampling_params": {"n": 2}}, ["a", "a"]),
    ({"text": ["p", "q"], "lora_path": ["a", None]}, ["a", None]),
    ({"text": ["p", "q"], "lora_path": "a"}, ["a", "a"]),
    ({"text": ["p", "q"], "lora_path": ["a", "b"], "sampling_params": {"n": 2}}, ["a", "b"] * 2),
    # SGLang replaces lora_id by the ids it acquires for lora_path
    ({"text": ["p", "q"], "lora_path": ["a", "b"], "lora_id": ["x", None]}, ["a", "b"]),
]


@pytest.fixture(params=SCOPES, ids=["intel_xpu", "csgmv", "csgmv-all"])
def scope(request, sglang_plugins_loaded, monkeypatch):
    """Whether requests are checked: the LoRA settings SGLang's code reads (``get_lora``,
    ``get_parallel``) for the backend, and the scope setting."""
    from sglang.srt import runtime_context
    from sglang.srt.managers import tokenizer_control_mixin, tokenizer_manager

    backend, checks, checked = request.param
    lora = SimpleNamespace(
        enable_lora=True, lora_backend=backend, max_loaded_loras=None, lora_paths=None
    )
    parallel = SimpleNamespace(dp_size=1)
    for module in (runtime_context, tokenizer_control_mixin, tokenizer_manager):
        monkeypatch.setattr(module, "get_lora", lambda: lora)
        monkeypatch.setattr(module, "get_parallel", lambda: parallel, raising=False)
    if checks:
        monkeypatch.setenv(checked_backends.ADAPTER_CHECKS_ENV, checks)
    else:
        monkeypatch.delenv(checked_backends.ADAPTER_CHECKS_ENV, raising=False)
    return checked


@pytest.mark.parametrize("index", range(len(REFUSED)))
def test_malformed_lora_fields_are_refused_naming_the_field_and_lengths(scope, index):
    from sglang.srt.managers.io_struct import GenerateReqInput

    fields, refusal = REFUSED[index]
    obj = GenerateReqInput(**fields)
    if scope:
        with pytest.raises(ValueError) as refused:
            obj.normalize_batch_and_arguments()
        assert refusal in str(refused.value)
    elif index in SGLANG_REFUSES:
        with pytest.raises(ValueError, match="lora_path should be a list or a string"):
            obj.normalize_batch_and_arguments()
    else:  # SGLang alone lets it through to the scheduler
        obj.normalize_batch_and_arguments()


@pytest.mark.parametrize("index", range(len(ACCEPTED)))
def test_well_formed_requests_are_normalised_as_sglang_does(scope, index):
    from sglang.srt.managers.io_struct import GenerateReqInput

    fields, lora_path = ACCEPTED[index]
    obj = GenerateReqInput(**fields)
    obj.normalize_batch_and_arguments()
    assert obj.lora_path == lora_path


def test_embedding_requests_are_checked_too(scope):
    """``/encode`` and ``Engine.encode``: one prompt with a list is refused where checked (SGLang
    alone checks the length of a batch's list itself, and nothing for one prompt)."""
    from sglang.srt.managers.io_struct import EmbeddingReqInput

    obj = EmbeddingReqInput(text="p", lora_path=["a", "b"])
    if scope:
        with pytest.raises(ValueError) as refused:
            obj.normalize_batch_and_arguments()
        assert "lora_path " + SINGLE_LIST.format(2) in str(refused.value)
    else:
        obj.normalize_batch_and_arguments()
    batch = EmbeddingReqInput(text=["p", "q"], lora_path=["a", "b"])
    batch.normalize_batch_and_arguments()
    assert batch.lora_path == ["a", "b"]


@pytest.fixture
def manager(scope):
    """A ``TokenizerManager`` with only its LoRA state (as ``init_lora`` makes it), whose scheduler
    answers every load and unload with success."""
    from sglang.srt.lora.lora_registry import LoRARegistry
    from sglang.srt.managers.io_struct import LoRAUpdateOutput
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    async def scheduler(obj):
        return [LoRAUpdateOutput(success=True, error_message="", loaded_adapters={})]

    manager = object.__new__(TokenizerManager)
    manager.lora_registry = LoRARegistry()
    manager.lora_update_lock = asyncio.Lock()
    manager.lora_ref_cache, manager.pending_lora_unloads = {}, {}
    manager.update_lora_adapter_communicator = scheduler
    manager.auto_create_handle_loop = lambda: None
    return manager


async def resolve(manager, lora_path):
    """The error message of a request naming ``lora_path`` (SGLang's normalised form), or None."""
    try:
        await manager._resolve_lora_path(SimpleNamespace(lora_path=lora_path, lora_id=None))
    except ValueError as exc:
        return str(exc)
    return None


def test_a_request_for_an_adapter_that_is_not_loaded_says_whether_it_was_unloaded(scope, manager):
    from sglang.srt.managers.io_struct import LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput

    async def scenario():
        for name in ("a", "b", "gone"):
            load = LoadLoRAAdapterReqInput(lora_name=name, lora_path=f"/{name}")
            await manager.load_lora_adapter(load)
        await manager.unload_lora_adapter(UnloadLoRAAdapterReqInput(lora_name="gone"))
        refused = await resolve(manager, ["a", "gone", None, "never", "gone"])
        return refused, await resolve(manager, ["a", "b", None])

    refused, served = asyncio.run(scenario())
    assert served is None
    if scope:
        assert refused == (
            "LoRA adapter 'gone' was unloaded (load it again to serve it); "
            "LoRA adapter 'never' has never been loaded. Loaded adapters: 2 (GET /v1/models lists them)."
        )
    else:  # SGLang alone serves the unloaded adapter again and refuses the other as never loaded
        assert re.match(r"Got LoRA adapter that has never been loaded: never\n", refused), refused


#: Tenants loaded for the refusals that must not list them (issue 31: 9 KB at 1,000 adapters).
TENANTS = [f"tenant-{i:02d}" for i in range(50)]
#: The end of every refusal of an adapter that is not loaded, with TENANTS loaded (the unloaded
#: one excepted): how many, and where to list them.
FORTY_NINE = "Loaded adapters: 49 (GET /v1/models lists them)."


async def load_tenants(manager, unloaded="tenant-07"):
    """Load :data:`TENANTS` and unload ``unloaded``."""
    from sglang.srt.managers.io_struct import LoadLoRAAdapterReqInput

    for name in TENANTS:
        await manager.load_lora_adapter(LoadLoRAAdapterReqInput(lora_name=name, lora_path=f"/{name}"))
    await unload(manager, unloaded)


async def unload(manager, name):
    """SGLang's ``unload_lora_adapter`` of ``name``: its ``LoRAUpdateOutput``."""
    from sglang.srt.managers.io_struct import UnloadLoRAAdapterReqInput

    return await manager.unload_lora_adapter(UnloadLoRAAdapterReqInput(lora_name=name))


def names_in(message):
    """The loaded tenants' names that ``message`` gives away."""
    return [name for name in TENANTS if name in message]


def test_a_refusal_at_50_adapters_names_the_adapter_and_counts_the_others(scope, manager):
    """With 50 tenants loaded (one of them then unloaded), a request for a name never loaded and one
    for the unloaded tenant are refused naming that adapter and saying how many are loaded and
    where to list them, without any other tenant's name. SGLang alone lists all of them (and serves
    the unloaded tenant again)."""

    async def scenario():
        await load_tenants(manager)
        return await resolve(manager, "tenant-x"), await resolve(manager, "tenant-07")

    never, unloaded = asyncio.run(scenario())
    if scope:
        assert never == f"LoRA adapter 'tenant-x' has never been loaded. {FORTY_NINE}"
        assert unloaded == f"LoRA adapter 'tenant-07' was unloaded (load it again to serve it). {FORTY_NINE}"
        assert names_in(never) == [] and names_in(unloaded) == ["tenant-07"]
    else:
        assert never.startswith("Got LoRA adapter that has never been loaded: tenant-x\n"), never
        assert names_in(never) == TENANTS and len(never) > 50 * len("'tenant-00', ")
        assert unloaded is None  # SGLang alone loads the unloaded tenant again


class CountedWalks:
    """Mixin for the mappings of a manager's adapter names: counts the walks over all their entries
    (iteration, keys, values, items, copy), each O(K) in the number of loaded adapters; a
    lookup of one name (``in``, ``get``, ``move_to_end``) is not counted."""

    walks = 0

    def _walked(self):
        CountedWalks.walks += 1

    def __iter__(self):
        self._walked()
        return super().__iter__()

    def keys(self):
        self._walked()
        return super().keys()

    def values(self):
        self._walked()
        return super().values()

    def items(self):
        self._walked()
        return super().items()

    def copy(self):
        self._walked()
        return super().copy()


def test_a_request_looks_up_its_own_adapters_without_walking_every_loaded_one(scope, manager, monkeypatch):
    """Issue 31: the check of a request's adapters copied the whole registry (and the cache of
    names) for every request, O(K) per request at K loaded adapters. With 50 tenants in mappings
    that count every walk over their entries, a served request (one name, a batch with the base
    model) walks none, and neither does a
    refused one: its refusal counts the loaded adapters without listing them
    (``num_registered_loras``). Where the plugin checks nothing, SGLang's own lookups walk none
    for a served request either, and its refusal lists every tenant. The counting mappings are
    checked to count a walk, as the old check's ``set(get_all_adapters())`` made one."""
    from collections import OrderedDict

    class CountedRegistry(CountedWalks, OrderedDict):
        pass

    class CountedCache(CountedWalks, dict):
        pass

    async def scenario():
        await load_tenants(manager)
        registry = manager.lora_registry
        registry._registry = CountedRegistry(registry._registry)
        manager.lora_ref_cache = CountedCache(manager.lora_ref_cache)
        monkeypatch.setattr(CountedWalks, "walks", 0)
        served = [await resolve(manager, "tenant-02"), await resolve(manager, ["tenant-03", None, "tenant-04"])]
        served_walks = CountedWalks.walks
        refused = await resolve(manager, ["tenant-05", "tenant-x"])
        refused_walks = CountedWalks.walks - served_walks
        set(registry.get_all_adapters())  # the old check's copy: counted
        return served, served_walks, refused, refused_walks, CountedWalks.walks - served_walks - refused_walks

    served, served_walks, refused, refused_walks, copy_walks = asyncio.run(scenario())
    assert served == [None, None]
    assert served_walks == 0
    assert copy_walks >= 1
    if scope:
        assert refused == f"LoRA adapter 'tenant-x' has never been loaded. {FORTY_NINE}"
        assert refused_walks == 0
    else:
        assert refused.startswith("Got LoRA adapter that has never been loaded: tenant-x\n"), refused
        assert refused_walks >= 1  # SGLang's refusal lists every loaded name


def test_an_adapter_evicted_and_remembered_passes_the_check_to_sglangs_reload(scope, manager):
    """A name evicted under ``--max-loaded-loras`` (SGLang unregisters it and keeps it in
    ``lora_ref_cache``) is looked up in the cache too: the request passes the check and SGLang's
    implicit reload serves it; a name in neither is refused."""
    from sglang.srt.managers.io_struct import LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput

    async def scenario():
        await load_tenants(manager)
        await manager.load_lora_adapter(LoadLoRAAdapterReqInput(lora_name="evicted", lora_path="/evicted"))
        async with manager.lora_update_lock:  # SGLang's LRU eviction, as load_lora_adapter runs it
            await manager._unload_lora_adapter_locked(UnloadLoRAAdapterReqInput(lora_name="evicted"))
        assert "evicted" in manager.lora_ref_cache and "evicted" not in manager.lora_registry.get_all_adapters()
        return await resolve(manager, ["evicted", "tenant-01"]), await resolve(manager, "tenant-x")

    evicted, never = asyncio.run(scenario())
    assert evicted is None
    assert "evicted" in manager.lora_registry.get_all_adapters()  # loaded again
    if scope:
        assert never == f"LoRA adapter 'tenant-x' has never been loaded. Loaded adapters: 50 (GET /v1/models lists them)."


def test_an_unload_between_the_check_and_sglangs_lookup_is_refused_as_unloaded(scope, manager):
    """An unload that lands after the plugin's check passed and before SGLang looks the adapter up
    (here: right after SGLang read which names are unregistered) makes SGLang refuse the request
    itself, listing every loaded adapter; the plugin replaces that refusal by its own."""

    async def scenario():
        await load_tenants(manager)
        registry = manager.lora_registry
        read_unregistered = registry.get_unregistered_loras

        async def unload_lands(names):
            found = await read_unregistered(names)
            await unload(manager, "tenant-03")
            return found

        registry.get_unregistered_loras = unload_lands
        return await resolve(manager, ["tenant-01", "tenant-03"])

    refused = asyncio.run(scenario())
    if scope:
        assert refused == f"LoRA adapter 'tenant-03' was unloaded (load it again to serve it). Loaded adapters: 48 (GET /v1/models lists them)."
        assert names_in(refused) == ["tenant-03"]
    else:
        assert refused.startswith("The following requested LoRA adapters are not loaded: tenant-03\n"), refused
        listed = refused.split("\nLoaded adapters: ", 1)[1]
        assert len(names_in(listed)) == 48  # all loaded: TENANTS but tenant-03 and tenant-07


def test_unloading_a_name_that_is_not_loaded_is_refused_without_the_other_names(scope, manager):
    """``/unload_lora_adapter`` of a name never loaded and of one already unloaded: refused naming the
    adapter and counting the others (SGLang alone lists every loaded adapter's name)."""

    async def scenario():
        await load_tenants(manager)
        return await unload(manager, "tenant-x"), await unload(manager, "tenant-07")

    never, again = asyncio.run(scenario())
    assert not never.success and not again.success
    if scope:
        assert never.error_message == f"LoRA adapter 'tenant-x' has never been loaded: nothing to unload. {FORTY_NINE}"
        assert again.error_message == (
            f"LoRA adapter 'tenant-07' was unloaded (load it again to serve it): nothing to unload. {FORTY_NINE}"
        )
    else:
        assert never.error_message.startswith("LoRA with name tenant-x does not exist. Loaded LoRAs: ")
        assert names_in(never.error_message) == [name for name in TENANTS if name != "tenant-07"]


HALF_APPLIED = """
import types
from sglang.srt.lora.backend import lora_registry
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.plugins.hook_registry import HookRegistry
import sglang_xpu_lora.patches.request_checks as request_checks

queued = []
queue_hook = request_checks.queue_hook

def queue_three(target, *args):  # the fourth (last) hook of the patch cannot be queued
    if len(queued) == 3:
        raise RuntimeError("no hook for " + target)
    queued.append(target)
    queue_hook(target, *args)

request_checks.queue_hook = queue_three
from sglang.srt.plugins import load_plugins
load_plugins()
print("REGISTERED", "intel_xpu" in lora_registry.LORA_SUPPORTED_BACKENDS)
hooks = HookRegistry._hooks.items()
(refuse,) = [h for t, queue in hooks for _, h, _ in queue if t.endswith("ServerArgs.resolve_once")]
try:
    refuse(types.SimpleNamespace(lora_backend="intel_xpu", enable_lora=True))
except ValueError as exc:
    print("REFUSED", exc)
single = GenerateReqInput(text="p", lora_path=["a", "b"])
single.normalize_batch_and_arguments()  # passed through: SGLang's own normalisation
print("PASSED", single.lora_path)
"""


@pytest.mark.launches
def test_a_patch_that_fails_half_way_is_rolled_back_whole(run_python):
    """The request checks apply whole or not at all, like every patch: when their last hook cannot
    be queued, the three queued before it and every earlier patch's steps are undone (the hooks pass
    straight through), no backend is registered, and ``--lora-backend intel_xpu`` fails naming the
    patch, the cause and what was undone."""
    result = run_python(HALF_APPLIED)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "REGISTERED False" in result.stdout
    io = "sglang.srt.managers.io_struct."
    assert (
        "could not patch SGLang: patch request_checks failed (RuntimeError: no hook for "
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._resolve_lora_path); rolled back: "
        f"undid the AROUND hook on {io}EmbeddingReqInput.normalize_batch_and_arguments; "
        f"undid the AROUND hook on {io}GenerateReqInput.normalize_batch_and_arguments; "
        "undid the AFTER hook on sglang.srt.arg_groups.lora_hook.check_lora_server_args; "
        "undid the AROUND hook on sglang.srt.lora.lora_registry.LoRARegistry.release; "
    ) in result.stdout
    assert "PASSED ['a', 'b']" in result.stdout


@pytest.mark.parametrize(
    ("backend", "checks", "workers", "refused"),
    [("intel_xpu", None, 2, True), ("intel_xpu", None, 1, False), ("csgmv", None, 2, False), ("csgmv", "all", 2, True)],
    ids=["intel_xpu", "one-worker", "csgmv", "csgmv-all"],
)
def test_extra_tokenizer_workers_are_refused_at_argument_validation(
    sglang_plugins_loaded, tiny_artifacts, monkeypatch, backend, checks, workers, refused
):
    """SGLang's extra tokenizer workers do not load plugins, so their requests would go unchecked
    (a ``lora_path`` list for one prompt then stops the scheduler: found by a breaker's server
    run): refused where requests are checked, as SGLang's own validation runs it."""
    from sglang.srt.server_args import prepare_server_args

    monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", "torch")
    if checks:
        monkeypatch.setenv(checked_backends.ADAPTER_CHECKS_ENV, checks)
    else:
        monkeypatch.delenv(checked_backends.ADAPTER_CHECKS_ENV, raising=False)
    args = prepare_server_args([
        "--model-path", str(tiny_artifacts["base"]), "--device", "cpu", "--enable-lora", "--lora-paths",
        f"a={tiny_artifacts['sql-r8']}", "--lora-backend", backend, "--max-lora-rank", "32",
        "--tokenizer-worker-num", str(workers),
    ])
    args.resolve_once()  # as Engine._launch_subprocesses does before check_server_args()
    if not refused:
        args.check_server_args()
        return
    with pytest.raises(BackendArgumentError) as refusal:
        args.check_server_args()
    assert str(refusal.value) == (
        f"--tokenizer-worker-num 2 with --lora-backend {backend}: SGLang 0.5.23 does not load plugins in its extra "
        "tokenizer worker processes, so the LoRA request checks and final unloads of sglang-xpu-lora would not run "
        "there (a malformed lora_path would stop the scheduler for every tenant); serve with --tokenizer-worker-num "
        "1 (the default)"
    )
