"""Issue 18 item 4 against SGLang 0.5.23's own code: adapters that SGLang refuses only after the model
load (a mistyped local path read as a Hub id, no adapter_config.json, no weights, a target module the
model does not have, added tokens) are refused at argument validation naming each adapter, its path
and what is wrong; and a local path's files are refused at load (HTTP 400) before SGLang reads the
path as a Hub id."""

from __future__ import annotations

import types

import pytest

import adapter_rows
from sglang_cpu_devsupport import tiny_model
from sglang_xpu_lora.adapters import checked_backends
from sglang_xpu_lora.patches.adapter_checks import check_lora_paths


@pytest.fixture(scope="module")
def broken(tiny_artifacts, tmp_path_factory):
    return adapter_rows.build_broken(tiny_artifacts["sql-r8"], tmp_path_factory.mktemp("broken"), tiny_model.VOCAB_SIZE)


def server_args(tiny_artifacts, adapters, **fields):
    """What SGLang's check_lora_server_args leaves for the plugin's AFTER hook: parsed LoRARefs."""
    from sglang.srt.lora.lora_registry import LoRARef

    refs = [LoRARef(lora_name=name, lora_path=str(path)) for name, path in adapters.items()]
    values = dict(
        enable_lora=True, lora_backend="intel_xpu", lora_paths=refs, model_path=str(tiny_artifacts["base"]),
        trust_remote_code=False, max_lora_rank=32, lora_target_modules=None, device="cpu",
    )
    return types.SimpleNamespace(**{**values, **fields})


def test_every_broken_adapter_is_refused_at_argument_validation(sglang_plugins_loaded, tiny_artifacts, broken, monkeypatch):
    monkeypatch.delenv(checked_backends.ADAPTER_CHECKS_ENV, raising=False)
    adapters = {"sql-r8": tiny_artifacts["sql-r8"], **{name: path for name, (path, _) in broken.items()}}
    with pytest.raises(ValueError) as refused:
        check_lora_paths(server_args(tiny_artifacts, adapters))
    lines = str(refused.value).splitlines()
    assert len(lines) == len(broken), lines  # one per broken adapter, none for sql-r8
    for line, (name, (path, named)) in zip(lines, broken.items()):
        assert line.startswith(f"LoRA adapter {name!r}") and named in line, (name, line)
        assert "Repo id" not in line


def test_lora_target_modules_bound_the_adapters_at_argument_validation(sglang_plugins_loaded, tiny_artifacts, monkeypatch):
    monkeypatch.delenv(checked_backends.ADAPTER_CHECKS_ENV, raising=False)
    adapters = {"qv-r4": tiny_artifacts["qv-r4"], "sql-r8": tiny_artifacts["sql-r8"]}
    check_lora_paths(server_args(tiny_artifacts, adapters, lora_target_modules={"all"}))
    with pytest.raises(ValueError) as refused:
        check_lora_paths(server_args(tiny_artifacts, adapters, lora_target_modules={"q_proj", "v_proj"}))
    assert str(refused.value).startswith("LoRA adapter 'sql-r8' cannot be served exactly: field 'target_modules' names [")
    assert "restart it with --lora-target-modules including" in str(refused.value)


def test_a_hub_id_is_left_to_sglang(sglang_plugins_loaded, tiny_artifacts, monkeypatch):
    monkeypatch.delenv(checked_backends.ADAPTER_CHECKS_ENV, raising=False)
    check_lora_paths(server_args(tiny_artifacts, {"hub": "some-org/some-adapter"}))


def test_a_mistyped_path_under_a_local_directory_is_a_path(sglang_plugins_loaded, tiny_artifacts, monkeypatch):
    """``artifacts/sql-r9`` is a valid Hub id, but ``artifacts/`` is a directory here: a path (as
    ``./artifacts/sql-r9`` is), refused at argument validation; SGLang would try to download it
    after loading the model."""
    monkeypatch.delenv(checked_backends.ADAPTER_CHECKS_ENV, raising=False)
    root = tiny_artifacts["sql-r8"].parent
    monkeypatch.chdir(root.parent)
    with pytest.raises(ValueError) as refused:
        check_lora_paths(server_args(tiny_artifacts, {"typo": f"{root.name}/sql-r9", "good": f"{root.name}/sql-r8"}))
    assert str(refused.value) == (
        f"LoRA adapter 'typo' cannot be loaded from {root.name}/sql-r9: the path does not exist (read as a path: "
        f"{root.name}/ is a directory here, not a Hugging Face Hub namespace); check the path or give an existing "
        "adapter directory"
    )


def test_an_empty_name_or_path_is_refused(sglang_plugins_loaded, tiny_artifacts, monkeypatch):
    """``--lora-paths =PATH`` loads an adapter no request can select (a request naming "" gets the
    base model); ``NAME=`` would read the working directory."""
    monkeypatch.delenv(checked_backends.ADAPTER_CHECKS_ENV, raising=False)
    with pytest.raises(ValueError) as refused:
        check_lora_paths(server_args(tiny_artifacts, {"": tiny_artifacts["sql-r8"], "no-path": ""}))
    assert str(refused.value).splitlines() == [
        f"the LoRA adapter at {str(tiny_artifacts['sql-r8'])!r} has an empty name, which no request can select; "
        "name it (--lora-paths NAME=PATH, or lora_name when loading it)",
        "LoRA adapter 'no-path' cannot be loaded from '': the path is empty; give the adapter's directory",
    ]


def test_a_refusal_ends_the_launcher_with_its_message_alone(sglang_plugins_loaded, tiny_artifacts, broken, monkeypatch):
    """The refusal is a ``ValueError`` (``Engine`` callers catch it) and a ``SystemExit`` with the
    message as its code: ``sglang serve`` prints it and exits 1, without a traceback."""
    monkeypatch.delenv(checked_backends.ADAPTER_CHECKS_ENV, raising=False)
    with pytest.raises(SystemExit) as refused:
        check_lora_paths(server_args(tiny_artifacts, {"no-config": broken["no-config"][0]}))
    assert isinstance(refused.value, ValueError)
    assert refused.value.code == f"error: {refused.value}" and str(refused.value).startswith("LoRA adapter 'no-config'")


@pytest.mark.parametrize("name", ["missing-path", "no-config", "no-weights", "training-files-only", "invalid-config-json"])
def test_a_local_path_is_refused_at_load_before_sglang_reads_it_as_a_hub_id(sglang_plugins_loaded, broken, monkeypatch, name):
    """SGLang's hooked ``_load_lora_adapter`` (what /load_lora_adapter and Engine.load_lora_adapter
    reach) answers a failed load naming the adapter and the path, also where SGLang's own reading
    of ``adapter_config.json`` fails, and keeps nothing."""
    from sglang.srt.lora.lora_manager import LoRAManager
    from sglang.srt.lora.lora_registry import LoRARef

    monkeypatch.delenv(checked_backends.ADAPTER_CHECKS_ENV, raising=False)
    manager = types.SimpleNamespace(
        configs={}, loras={}, lora_refs={}, num_pinned_loras=0,
        lora_backend=types.SimpleNamespace(name="intel_xpu"), base_hf_config=types.SimpleNamespace(vocab_size=1024),
        create_lora_update_result=lambda success, error_message="": types.SimpleNamespace(success=success, error_message=error_message),
    )
    path, named = broken[name]
    result = LoRAManager._load_lora_adapter(manager, LoRARef(lora_name=name, lora_path=str(path)))
    assert not result.success and named in result.error_message, result.error_message
    assert result.error_message.startswith(f"LoRA adapter {name!r} cannot be loaded from {path}: ")
    assert manager.configs == {} and manager.loras == {}
