"""Local adapter references (issue 18 item 4): what counts as a local path, and a local adapter
refused with its path and the missing piece instead of being read as a Hugging Face Hub id; tokens
added to the vocabulary refused as SGLang counts them."""

from __future__ import annotations

import os

import pytest

from sglang_xpu_lora.adapters import AdapterRejected
from sglang_xpu_lora.adapters.adapter_files import check_added_tokens, check_adapter_files, is_local_reference, weight_files


@pytest.fixture
def adapter_dir(tmp_path):
    """A directory holding what PEFT's save_pretrained writes (contents irrelevant here)."""
    directory = tmp_path / "sql"
    directory.mkdir()
    (directory / "adapter_config.json").write_text("{}")
    (directory / "adapter_model.safetensors").write_bytes(b"")
    return directory


@pytest.mark.parametrize(
    "reference, local",
    [
        ("/adapters/sql", True),  # absolute, missing: SGLang would ask the Hub
        ("./adapters/sql", True),
        ("../sql", True),
        ("~/adapters/sql", True),
        ("adapters/sql/v2", True),  # two slashes: no Hub id has them
        ("my adapter", True),
        ("adapters--sql", True),
        ("org/sql-lora", False),  # a Hub id
        ("sql-lora", False),
    ],
)
def test_local_references_are_told_from_hub_ids(reference, local, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_local_reference(reference) is local


def test_an_existing_directory_is_local_even_when_it_reads_as_a_hub_id(adapter_dir, monkeypatch):
    monkeypatch.chdir(adapter_dir.parent)
    assert is_local_reference("sql") and check_adapter_files("a", "sql") == adapter_dir.relative_to(adapter_dir.parent)


def test_a_complete_adapter_directory_and_a_hub_id_pass(adapter_dir):
    assert check_adapter_files("a", str(adapter_dir)) == adapter_dir
    assert check_adapter_files("a", "org/sql-lora") is None  # SGLang downloads it


@pytest.mark.parametrize("weights", ["adapter_model.bin", "weights.pt"])
def test_every_weights_file_sglang_reads_counts(adapter_dir, weights):
    (adapter_dir / "adapter_model.safetensors").rename(adapter_dir / weights)
    assert check_adapter_files("a", str(adapter_dir)) == adapter_dir


def refusal(name, reference):
    with pytest.raises(AdapterRejected) as refused:
        check_adapter_files(name, reference)
    message = str(refused.value)
    assert message.startswith(f"LoRA adapter {name!r} cannot be loaded from {reference}: "), message
    assert "Repo id" not in message or "Hugging Face Hub id" in message, message
    return message


def test_a_missing_path_is_named(tmp_path):
    assert "the path does not exist; check the path" in refusal("sql", str(tmp_path / "sqll"))
    message = refusal("sql", "adapters/sql/v2")
    assert "the path does not exist (nor is it a Hugging Face Hub id: Repo id must be in the form" in message


def test_tilde_is_not_expanded_by_sglang():
    assert f"give the full path ({os.path.expanduser('~/sql')})" in refusal("sql", "~/sql")


def test_a_file_a_directory_without_config_and_one_without_weights_are_named(adapter_dir):
    assert "it is a file, not a directory" in refusal("sql", str(adapter_dir / "adapter_config.json"))
    (adapter_dir / "adapter_model.safetensors").unlink()
    assert "has no adapter weights (adapter_model.safetensors or adapter_model.bin;" in refusal("sql", str(adapter_dir))
    (adapter_dir / "adapter_config.json").unlink()
    assert "has no adapter_config.json, so it is not a PEFT adapter" in refusal("sql", str(adapter_dir))


def test_added_tokens_count_from_the_base_vocabulary_as_sglang_counts_them():
    check_added_tokens("a", None, 1024)
    check_added_tokens("a", {"<s>": 1, "</s>": 2}, 1024)  # the base's own tokens, copied
    with pytest.raises(AdapterRejected) as refused:
        check_added_tokens("a", {"<s>": 1, "<b>": 1025, "<a>": 1024}, 1024)
    assert str(refused.value).startswith(
        "LoRA adapter 'a' cannot be served: its added_tokens.json adds 2 token(s) ('<a>', '<b>') to the base "
        "model's vocabulary of 1024"
    ), refused.value
    assert "merge_and_unload" in str(refused.value)


def test_weight_files_are_those_sglang_loads(tmp_path):
    """SGLang's loader takes the first pattern with files (safetensors, then bin, then pt) and drops
    training files from bin/pt: a directory with only training_args.bin has no weights, and one
    whose only .bin is training_args.bin finds none even with an adapter_model.pt next to it."""
    (tmp_path / "training_args.bin").write_bytes(b"x")
    assert weight_files(tmp_path) == []
    (tmp_path / "adapter_model.pt").write_bytes(b"x")
    assert weight_files(tmp_path) == []  # SGLang stops at *.bin, then filters it empty
    (tmp_path / "adapter_model.bin").write_bytes(b"x")
    assert weight_files(tmp_path) == [tmp_path / "adapter_model.bin"]
    (tmp_path / "adapter_model.safetensors").write_bytes(b"x")
    assert weight_files(tmp_path) == [tmp_path / "adapter_model.safetensors"]
