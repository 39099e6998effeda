"""The provider interface has one source (``providers/base.py``) and every provider keeps to it; the
selection knows providers only through their descriptors (``PROVIDER`` in each provider module).

* every op of the portable and the Triton provider has the interface's signature (the Triton ones
  with the keyword-only ``batch_info`` added, the portable GEMM ops with the keyword-only
  ``routing``), and a drifted op is caught by the same check;
* native detection binds the kernels' schema arguments to the interface's parameter names: every
  op of the full emulated build is found, and a renamed interface parameter makes it unfindable;
* no module that chooses or routes ops spells a provider's name;
* a provider added to the list is chosen, logged and laid out from its descriptor alone.
"""

from __future__ import annotations

import ast
import inspect
import logging
from pathlib import Path
from typing import Optional

import pytest
import torch

from sglang_xpu_lora import providers
from sglang_xpu_lora.providers import base, native, selection, torch_ops, triton_ops
from sglang_xpu_lora.providers.base import OP_NAMES, Offer, Provider, signature_mismatch

SOURCE = Path(__file__).resolve().parents[2] / "src" / "sglang_xpu_lora"


@pytest.mark.parametrize("op", OP_NAMES)
def test_the_portable_ops_have_the_interface_signatures_plus_routing(op):
    # the GEMM ops take the batch's routing cache (keyword-only); the embedding op routes nothing
    routing = () if op == "embedding_lora_a_fwd" else ("routing",)
    assert torch_ops.PROVIDER.caches_routing
    assert signature_mismatch(op, getattr(torch_ops, op), keyword_only=routing) is None


@pytest.mark.parametrize("op", OP_NAMES)
def test_the_triton_ops_have_the_interface_signatures_plus_batch_info(op):
    assert signature_mismatch(op, getattr(triton_ops, op), keyword_only=("batch_info",)) is None


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


@pytest.mark.parametrize("module", ["providers/selection.py", "providers/batch_binding.py", "backend/xpu.py",
                                    "backend/batch_routes.py"])
def test_choosing_and_routing_never_spell_a_provider_name(module):
    names = {provider.name for provider in selection.PROVIDERS}
    tree = ast.parse((SOURCE / module).read_text())
    spelled = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Constant) and node.value in names]
    assert spelled == [], f"{module} spells a provider's name at lines {spelled}: use its descriptor"


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


def test_the_interface_signature_is_the_protocols():
    method = inspect.signature(base.LoRAOpsProvider.chunked_sgmv_lora_expand_fwd)
    assert tuple(method.parameters)[1:] == base.parameters("chunked_sgmv_lora_expand_fwd")
    with pytest.raises(KeyError, match="not an op of the interface"):
        base.signature("csgmv_shrink_fwd")
