"""The provider interface has one source (``providers/base.py``) and every provider keeps to it; the
selection knows providers only through their descriptors (``PROVIDER`` in each provider module).

* every op of the portable and the Triton provider has the interface's signature (the Triton ones
  with the keyword-only ``batch_info`` added, and ``launches`` where they launch a kernel, the
  portable GEMM ops with the keyword-only ``routing``), and a drifted op is caught by the same check;
* native detection binds the kernels' schema arguments to the interface's parameter names: every
  op of the full emulated build is found, and a renamed interface parameter makes it unfindable;
* no module outside ``providers/`` references a provider module (imports, attribute reads);
* a provider added to the list is chosen, logged and laid out from its descriptor alone.
"""

from __future__ import annotations

import ast
import inspect
import logging
import types
from pathlib import Path
from typing import Optional

import pytest
import torch

from sglang_xpu_lora import providers
from sglang_xpu_lora.providers import base, capture_probe, native, selection, torch_ops, triton_ops
from sglang_xpu_lora.providers.base import OP_NAMES, Offer, Provider, signature_mismatch

SOURCE = Path(__file__).resolve().parents[2] / "src" / "sglang_xpu_lora"


@pytest.mark.parametrize("op", OP_NAMES)
def test_the_portable_ops_have_the_interface_signatures_plus_routing(op):
    # the GEMM ops take the batch's routing cache (keyword-only); the embedding op routes nothing
    routing = () if op == "embedding_lora_a_fwd" else ("routing",)
    assert torch_ops.PROVIDER.caches_routing
    assert signature_mismatch(op, getattr(torch_ops, op), keyword_only=routing) is None


@pytest.mark.parametrize("op", OP_NAMES)
def test_the_triton_ops_have_the_interface_signatures_plus_batch_info_and_launches(op):
    # the ops that launch a kernel take the caller's launch cache; the embedding op calls SGLang's wrapper
    launches = () if op == "embedding_lora_a_fwd" else ("launches",)
    assert triton_ops.PROVIDER.uses_launch_cache
    assert signature_mismatch(op, getattr(triton_ops, op), keyword_only=("batch_info", *launches)) is None


def test_a_drifted_op_is_caught():
    """What the two tests above catch: a renamed, reordered, re-defaulted, missing or extra parameter."""

    def renamed(input_x: torch.Tensor, weights: torch.Tensor, stack_num: int, seg_indptr: torch.Tensor,
                weight_indices: torch.Tensor, lora_ranks: torch.Tensor, seg_lens: Optional[torch.Tensor] = None):
        """``sgemm_lora_a_fwd`` with the slice count under its old name."""

    def redefaulted(input_x: torch.Tensor, weights: torch.Tensor, num_slices: int, seg_indptr: torch.Tensor,
                    weight_indices: torch.Tensor, lora_ranks: torch.Tensor, seg_lens: Optional[torch.Tensor] = 0):
        """``sgemm_lora_a_fwd`` with another default."""

    def short(input_x: torch.Tensor, weights: torch.Tensor, num_slices: int, seg_indptr: torch.Tensor,
              weight_indices: torch.Tensor, lora_ranks: torch.Tensor):
        """``sgemm_lora_a_fwd`` without ``seg_lens``."""

    assert "parameter 2 is stack_num: int where the interface has num_slices: int" in signature_mismatch("sgemm_lora_a_fwd", renamed)
    assert "parameter 6" in signature_mismatch("sgemm_lora_a_fwd", redefaulted)
    assert "missing parameter(s) seg_lens" in signature_mismatch("sgemm_lora_a_fwd", short)
    assert "parameter 7 is *, routing where the interface has *, batch_info" in signature_mismatch(
        "sgemm_lora_a_fwd", torch_ops.sgemm_lora_a_fwd, ("batch_info",)
    )
    assert "missing parameter(s) *, batch_info" in signature_mismatch("embedding_lora_a_fwd", torch_ops.embedding_lora_a_fwd, ("batch_info",))
    assert "extra parameter(s) *, batch_info" in signature_mismatch("sgemm_lora_a_fwd", triton_ops.sgemm_lora_a_fwd)
    assert signature_mismatch("sgemm_lora_b_fwd", torch_ops.sgemm_lora_a_fwd) is not None


def test_native_detection_binds_the_schemas_to_the_interface(emulate, monkeypatch):
    """Every op of the full build is found with each schema argument bound to an interface
    parameter; renaming a parameter in the interface alone makes the op unfindable (native
    detection reads the names from ``base``, nowhere else)."""
    with emulate("full"):
        for op in OP_NAMES:
            kernel, reason = native.detect_op(op)
            assert kernel is not None, reason
            aliases = native.ALIASES.get(op, {})
            assert {aliases.get(name, name) for name in kernel.arguments} <= set(base.parameters(op))
        real = base.parameters
        monkeypatch.setattr(native, "parameters", lambda op: tuple("slices" if p == "num_slices" else p for p in real(op)))
        kernel, reason = native.detect_op("chunked_sgmv_lora_shrink_fwd")
    assert kernel is None and "needs unsupported argument(s) num_slices" in reason


#: The modules that define the providers (``sglang_xpu_lora.providers.native``...).
PROVIDER_MODULES = {type(provider).__module__ for provider in selection.PROVIDERS}


def provider_references(source: str, module: str) -> list[str]:
    """``"line: what"`` for each reference of ``module`` (``providers/selection.py``...) to a provider
    module: an import of it or of a name from it, or an attribute read on it. Inside ``providers/``
    the list of providers (``PROVIDERS = (native.PROVIDER, ...)``, ``selection.py``) may read their
    ``PROVIDER`` and the package's ``__init__.py`` re-exports; a provider module may not reference
    another."""
    if module == "providers/__init__.py":
        return []
    package = ".".join(["sglang_xpu_lora", *module.split("/")[:-1]])
    own = f"{package}.{Path(module).stem}"
    may_list = module.startswith("providers/") and own not in PROVIDER_MODULES
    aliases, found = {}, []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                if base in PROVIDER_MODULES and base != own:
                    found.append(f"{node.lineno}: from {base} import {alias.name}")
                elif f"{base}.{alias.name}" in PROVIDER_MODULES and f"{base}.{alias.name}" != own:
                    aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in PROVIDER_MODULES and alias.name != own:
                    aliases[alias.asname or alias.name] = alias.name
    tree = ast.parse(source)
    listing = {  # the nodes of the list of providers: ``PROVIDERS = (native.PROVIDER, ...)``
        id(inner)
        for node in ast.walk(tree)
        if may_list and isinstance(node, (ast.Assign, ast.AnnAssign))
        and "PROVIDERS" in {target.id for target in getattr(node, "targets", [getattr(node, "target", None)])
                            if isinstance(target, ast.Name)}
        for inner in ast.walk(node)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            if not (id(node) in listing and node.attr == "PROVIDER"):
                found.append(f"{node.lineno}: {aliases[node.value.id]}.{node.attr}")
    return found


@pytest.mark.parametrize("path", sorted(SOURCE.rglob("*.py")), ids=lambda path: path.relative_to(SOURCE).as_posix())
def test_no_module_outside_the_providers_references_one(path):
    """Provider identity lives in ``providers/``: no other module imports a provider module or
    reads an attribute of one (trial captures and the eager-decode rule go through the
    descriptors); inside ``providers/`` only the list of providers does."""
    module = path.relative_to(SOURCE).as_posix()
    assert provider_references(path.read_text(), module) == [], f"{module} references a provider module"


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("backend/xpu.py", "from sglang_xpu_lora.providers import native\nbind = native.bind\n"),
        ("backend/xpu.py", "from sglang_xpu_lora.providers.triton_ops import triton_support\n"),
        ("doctor.py", "import sglang_xpu_lora.providers.native as n\nn.kernel_build()\n"),
        ("providers/selection.py", "from . import triton_ops\nPROVIDERS = (triton_ops.PROVIDER,)\ntriton_ops.bind\n"),
        ("providers/selection.py", "from . import triton_ops\nPROVIDERS = (triton_ops.PROVIDER,)\ntriton = triton_ops.PROVIDER\n"),
        ("backend/xpu.py", "from sglang_xpu_lora.providers import native\nnative.PROVIDER\n"),
        ("providers/native.py", "from sglang_xpu_lora.providers import triton_ops\ntriton_ops.bind\n"),
    ],
)
def test_a_reference_to_a_provider_module_is_caught(module, source):
    """What the test above catches: the references the backend, doctor and selection made before
    the descriptors carried them (each line here stood in the source once)."""
    assert provider_references(source, module) != []


class Fancy(Provider):
    """A provider of one op, ``sgemm_lora_b_fwd``, on every device."""

    def offers(self, device_kind, kernels, graph_verdicts):
        offers = {op: Offer(None, "Fancy has only sgemm_lora_b_fwd") for op in OP_NAMES}
        offers["sgemm_lora_b_fwd"] = Offer(base.ignoring_batch_info(torch_ops.sgemm_lora_b_fwd), "Fancy test kernel")
        return offers


def test_a_provider_added_to_the_list_is_chosen_from_its_descriptor(monkeypatch, caplog):
    fancy = Fancy(name="fancy", title="Fancy", contracts_over_max_rank=False, expands_read_spaced_slices=False)
    monkeypatch.setattr(selection, "PROVIDERS", (fancy, *selection.PROVIDERS))
    monkeypatch.setattr(selection, "SETTINGS", selection._settings())
    monkeypatch.delenv("SGLANG_XPU_LORA_KERNELS", raising=False)
    with caplog.at_level(logging.INFO, logger="sglang_xpu_lora.providers"):
        chosen = providers.select_ops("cpu")
    assert chosen.choices["sgemm_lora_b_fwd"].provider is fancy
    assert chosen.graph_choices["sgemm_lora_b_fwd"].reason == "Fancy test kernel"
    assert "no Fancy: Fancy has only sgemm_lora_b_fwd; no native op: " in chosen.choices["qkv_lora_b_fwd"].reason
    assert {c.provider.name for op, c in chosen.choices.items() if op != "sgemm_lora_b_fwd"} == {"torch"}
    assert chosen.needs_zeroed_slots  # the portable ops still serve the others
    assert not chosen.reads_spaced_slices("sgemm_lora_b_fwd", True)
    assert all(r.levelno == logging.WARNING for r in caplog.records)  # the first provider is not logged
    assert len(caplog.records) == len(OP_NAMES) - 1
    assert providers.runs_on_device("cpu")  # an op served by a provider other than the last resort

    monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", "fancy")  # a setting of its own, forcing it
    with pytest.raises(RuntimeError, match="the fancy provider cannot serve embedding_lora_a_fwd on cpu: Fancy has only"):
        providers.choose("cpu")


class Trialled(Provider):
    """A provider of every op whose capture safety is decided by a trial capture: its trial calls
    double their input, and the one of ``sgemm_lora_b_fwd`` also reads a value on the host (which a
    capture refuses); eagerly its ops are the portable ones."""

    def offers(self, device_kind, kernels, graph_verdicts):
        offers = {}
        for op in OP_NAMES:
            verdict = graph_verdicts.get(op)
            safe, why = (None, "by trial") if verdict is None else (verdict.capture_safe, verdict.reason)
            kernel = types.SimpleNamespace(op=op, kernel_name=f"trialled.{op}")
            offers[op] = Offer(base.ignoring_batch_info(getattr(torch_ops, op)), "Trialled test kernel", safe, why, kernel)
        return offers

    def bind_trial(self, kernel):
        def call(**kwargs):
            x = kwargs["input_x"] if "input_x" in kwargs else kwargs["input_ids"].float()
            if kernel.op == "sgemm_lora_b_fwd":
                x = x * float(x.sum())  # a host read
            return x * 2

        return call


def test_a_provider_captured_by_trial_needs_only_its_descriptor(monkeypatch):
    """Adding a provider whose ops are tried in graphs is one module (here a class) plus one
    ``PROVIDERS`` entry: its ops are the trial candidates, bound for the trial by its own
    ``bind_trial`` (what the backend and doctor pass the probe), and the verdicts decide its ops
    inside graphs; the op whose trial failed falls back."""
    from fake_graphs import FakeGraphs

    trialled = Trialled(name="trialled", title="Trialled op", contracts_over_max_rank=True,
                        expands_read_spaced_slices=True, capture_by_trial=True)
    monkeypatch.setattr(selection, "PROVIDERS", (trialled, *selection.PROVIDERS))
    monkeypatch.setattr(selection, "SETTINGS", selection._settings())
    monkeypatch.delenv("SGLANG_XPU_LORA_KERNELS", raising=False)
    monkeypatch.delenv("SGLANG_XPU_LORA_GRAPH_NATIVE", raising=False)
    before = providers.choose("cpu")
    assert set(before.graph_candidates) == set(OP_NAMES) and not before.graph_decided
    assert {c.provider for c in before.choices.values()} == {trialled}
    case = capture_probe.ProbeCase(torch.device("cpu"), tokens=6, slots=3, max_rank=4, dtype=torch.float32)
    verdicts = capture_probe.CaptureProbe(FakeGraphs()).try_ops(before.graph_candidates, case, before.bind_trial)
    assert [op for op, verdict in verdicts.items() if not verdict.capture_safe] == ["sgemm_lora_b_fwd"]
    after = providers.choose("cpu", verdicts)
    assert after.graph_decided
    assert {op for op, c in after.graph_choices.items() if c.provider is trialled} == set(OP_NAMES) - {"sgemm_lora_b_fwd"}
    assert after.graph_choices["sgemm_lora_b_fwd"].provider is torch_ops.PROVIDER
    with pytest.raises(NotImplementedError, match="the torch provider is not captured by trial"):
        torch_ops.PROVIDER.bind_trial(None)


def test_the_interface_signature_is_the_protocols():
    method = inspect.signature(base.LoRAOpsProvider.chunked_sgmv_lora_expand_fwd)
    assert tuple(method.parameters)[1:] == base.parameters("chunked_sgmv_lora_expand_fwd")
    with pytest.raises(KeyError, match="not an op of the interface"):
        base.signature("chunked_sgmv_lora_shrink_forward")
