"""An adapter's directory: is the reference a local path, and does it hold what SGLang reads.

SGLang 0.5.23's ``LoRAConfig`` reads a reference that is not an existing directory as a Hugging Face
Hub id (``snapshot_download``), so a mistyped local path fails with the Hub's "Repo id must be in
the form ..." (or a download error) after the model has loaded. :func:`check_adapter_files` decides
first whether the user meant a local path (:func:`is_local_reference`) and, if so, refuses it with
the path and the missing piece: the directory, ``adapter_config.json`` (which SGLang opens), or a
weights file (:func:`weight_files`, as SGLang's ``DefaultModelLoader`` picks them; PEFT saves
``adapter_model.safetensors`` or ``adapter_model.bin``). An adapter without a name, which no
request could select, is refused too.

:func:`check_added_tokens` refuses an adapter that adds tokens to the vocabulary
(``added_tokens.json`` with ids at or above the base vocabulary, the entries SGLang counts as
``lora_added_tokens_size``): SGLang 0.5.23 refuses them in ``validate_new_adapter`` too, but at
start-up only after the model load.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping, Optional

from sglang_xpu_lora.adapters import AdapterRejected
from sglang_xpu_lora.upstream import targets
from sglang_xpu_lora.upstream.compat import resolve

ADAPTER_CONFIG = "adapter_config.json"
ADDED_TOKENS = "added_tokens.json"
#: The weight files SGLang's loader looks for in an adapter directory, in its order.
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")
#: Prefixes that make a reference a path, whatever the Hub accepts.
LOCAL_PREFIXES = ("/", "./", "../", "~")


def hub_id_problem(reference: str) -> Optional[str]:
    """Why ``reference`` cannot be a Hugging Face Hub repo id (``huggingface_hub``'s own
    ``validate_repo_id``), or None when it can be one."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(reference)
    except HFValidationError as exc:
        return str(exc)
    return None


def is_local_reference(reference: str) -> bool:
    """Whether an adapter reference (``--lora-paths`` value, ``lora_path``) names a local path: it
    exists, starts with ``/``, ``./``, ``../`` or ``~``, its first component is a directory in the
    working directory (``artifacts/sql-r8``), or it cannot be a Hub id.
    Anything else is a Hub id, which SGLang downloads."""
    return (
        os.path.exists(reference)
        or reference.startswith(LOCAL_PREFIXES)
        or _local_parent(reference) is not None
        or hub_id_problem(reference) is not None
    )


def _local_parent(reference: str) -> Optional[str]:
    """The first component of ``reference`` when it has several and that one is a directory in
    the working directory, else None."""
    head, separator, _ = reference.partition("/")
    return head if separator and head and os.path.isdir(head) else None


def weight_files(directory: Path) -> list[Path]:
    """The files SGLang's ``DefaultModelLoader`` loads from a local adapter ``directory``: those of
    the first of :data:`WEIGHT_PATTERNS` that matches any, minus the training files SGLang's
    ``filter_files_not_needed_for_inference`` drops (``training_args.bin``, ``optimizer.pt``...)
    from ``*.bin``/``*.pt``. Empty when SGLang would find no weights."""
    for pattern in WEIGHT_PATTERNS:
        files = sorted(directory.glob(pattern))
        if files:
            if pattern == "*.safetensors":
                return files
            kept = set(resolve(targets.FILTER_FILES_NOT_NEEDED_FOR_INFERENCE)([str(file) for file in files]))
            return [file for file in files if str(file) in kept]
    return []


def check_adapter_files(name: str, reference: str) -> Optional[Path]:
    """Check the local adapter directory ``reference`` of adapter ``name``.

    Returns:
        The directory when it holds ``adapter_config.json`` and a weights file; None when
        ``reference`` is a Hub id (checked when SGLang downloads it).

    Raises:
        AdapterRejected: naming the adapter, the path and what is missing (a name, the path itself,
            a directory, ``adapter_config.json``, the weights), or that SGLang does not expand ``~``.
    """
    if not name.strip():
        raise AdapterRejected(
            f"the LoRA adapter at {reference!r} has an empty name, which no request can select; name it "
            "(--lora-paths NAME=PATH, or lora_name when loading it)"
        )
    if not reference.strip():
        _reject(name, repr(reference), "the path is empty; give the adapter's directory")
    if not is_local_reference(reference):
        return None
    path = Path(reference)
    if not path.exists() and reference.startswith("~"):
        expanded = os.path.expanduser(reference)
        _reject(name, reference, f"SGLang does not expand '~' in adapter paths; give the full path ({expanded})")
    if not path.exists():
        parent = _local_parent(reference)
        if reference.startswith(LOCAL_PREFIXES):
            why = ""
        elif parent is not None:
            why = f" (read as a path: {parent}/ is a directory here, not a Hugging Face Hub namespace)"
        else:
            why = f" (nor is it a Hugging Face Hub id: {hub_id_problem(reference)})"
        _reject(name, reference, f"the path does not exist{why}; check the path or give an existing adapter directory")
    if not path.is_dir():
        _reject(name, reference, f"it is a file, not a directory; give the directory that holds {ADAPTER_CONFIG}")
    if not (path / ADAPTER_CONFIG).is_file():
        _reject(
            name, reference,
            f"the directory has no {ADAPTER_CONFIG}, so it is not a PEFT adapter; give the directory "
            "PEFT's save_pretrained wrote",
        )
    if not weight_files(path):
        _reject(
            name, reference,
            "the directory has no adapter weights (adapter_model.safetensors or adapter_model.bin; "
            "training files such as training_args.bin or optimizer.pt are not weights); save the adapter "
            "again with PEFT's save_pretrained",
        )
    return path


def read_added_tokens(directory: Path) -> Optional[dict]:
    """The ``added_tokens.json`` of an adapter directory (token -> id), or None without one.

    Raises:
        ValueError: the file is not valid JSON.
    """
    file = directory / ADDED_TOKENS
    return json.loads(file.read_text()) if file.is_file() else None


def check_added_tokens(name: str, added_tokens: Optional[Mapping[str, int]], base_vocab_size: Optional[int]) -> None:
    """Refuse an adapter whose ``added_tokens`` (token -> id, from ``added_tokens.json``) add tokens
    to the base model's vocabulary: ids at or above ``base_vocab_size`` (ids below are the base's
    own tokens, as SGLang counts them). With ``base_vocab_size`` None every entry counts.

    Raises:
        AdapterRejected: naming the adapter, how many tokens it adds and the first few.
    """
    added = {token: i for token, i in (added_tokens or {}).items() if base_vocab_size is None or i >= base_vocab_size}
    if not added:
        return
    shown = ", ".join(repr(token) for token in sorted(added, key=added.get)[:3]) + (", ..." if len(added) > 3 else "")
    vocab = f" of {base_vocab_size}" if base_vocab_size is not None else ""
    raise AdapterRejected(
        f"LoRA adapter {name!r} cannot be served: its {ADDED_TOKENS} adds {len(added)} token(s) ({shown}) to the "
        f"base model's vocabulary{vocab}, and SGLang's "
        "multi-LoRA serving has one vocabulary for all adapters; merge the adapter into the base model "
        "(PeftModel.merge_and_unload, with the resized tokenizer) and serve that"
    )


def _reject(name: str, reference: str, problem: str) -> None:
    raise AdapterRejected(f"LoRA adapter {name!r} cannot be loaded from {reference}: {problem}")
