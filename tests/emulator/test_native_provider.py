"""The native provider against emulated sgl-kernel-xpu builds: per-op detection, fallbacks,
errors, bound calls that match the portable ops, and the emulator's contract checks."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from sglang_xpu_lora import providers
from sglang_xpu_lora.providers import capture_probe, native, torch_ops, triton_ops
from sglang_xpu_lora.providers.base import OP_NAMES
from sglang_xpu_lora.providers.selection import DECODE_OPS

ALL = set(OP_NAMES)
EXPECTED_NATIVE = {
    "v0.1.0": {"embedding_lora_a_fwd", "sgemm_lora_a_fwd"},
    "v0.2.0": {"embedding_lora_a_fwd", "sgemm_lora_a_fwd", "sgemm_lora_b_fwd", "qkv_lora_b_fwd"},
    "pr506-draft": ALL - {"chunked_sgmv_lora_expand_fwd"},
    "full": ALL,
}
UNTRIED = "native op not run inside graphs: capture safety is decided by a trial capture at graph set-up"


@pytest.fixture
def as_on_xpu(monkeypatch):
    """An XPU where Triton runs and the emulated build's kernels are registered for it."""
    from sglang_xpu_lora.providers import triton_ops

    monkeypatch.setattr(triton_ops, "triton_support", lambda device: (True, "Triton test backend"))
    monkeypatch.setattr(native, "has_kernel_for_device", lambda kernel, device_type: True)


def groups(**ops_by_provider) -> dict:
    return {provider: ops for provider, ops in ops_by_provider.items() if ops}


def by_provider(chosen: dict) -> dict:
    grouped = {}
    for op, choice in chosen.items():
        grouped.setdefault(choice.provider.name, set()).add(op)
    return grouped


@pytest.mark.parametrize("build", list(EXPECTED_NATIVE))
def test_auto_on_cpu_uses_native_for_the_ops_the_build_has_and_torch_for_the_others(emulate, build):
    with emulate(build):
        selection = providers.select_ops("cpu")
        assert by_provider(selection.choices) == groups(native=EXPECTED_NATIVE[build], torch=ALL - EXPECTED_NATIVE[build])
        for op, choice in selection.choices.items():
            if choice.provider.name == "torch":
                assert getattr(selection.eager, op).__wrapped__ is getattr(torch_ops, op)
                assert native.MINIMUM_BUILD[op] in choice.reason
        # Native ops run inside graphs only after a trial capture accepted them (tests/unit/test_capture_probe.py).
        assert "native" not in by_provider(selection.graph_choices) and not selection.graph_decided
        assert set(selection.graph_candidates) == EXPECTED_NATIVE[build]
        assert selection.needs_zeroed_slots
        assert providers.runs_on_device("cpu")


@pytest.mark.parametrize("build", list(EXPECTED_NATIVE))
def test_auto_on_an_xpu_uses_native_then_triton_and_triton_in_graphs_until_the_trial(emulate, as_on_xpu, build):
    with emulate(build):
        selection = providers.select_ops("xpu")
    has = EXPECTED_NATIVE[build]
    eager_native = has - set(DECODE_OPS)  # eager decode prefers Triton to host-syncing native ops
    assert by_provider(selection.choices) == groups(native=eager_native, triton=ALL - eager_native)
    assert by_provider(selection.graph_choices) == {"triton": ALL}
    assert all(selection.graph_choices[op].reason.startswith(UNTRIED) for op in has)
    assert all(selection.choices[op].capture_safe is None for op in eager_native)
    assert selection.needs_zeroed_slots and triton_ops.PROVIDER in selection.providers


def test_the_sync_free_build_has_the_full_builds_ops_and_numbers(emulate):
    """Same detection, same results as ``full`` (the bound calls against the portable ops:
    :func:`test_each_native_op_matches_the_portable_op`)."""
    with emulate("full-syncfree"):
        selection = providers.choose("cpu")
    assert by_provider(selection.choices) == {"native": ALL}


def test_triton_mode_ignores_the_native_build(emulate, as_on_xpu):
    with emulate("full", kernels="triton"):
        selection = providers.choose("xpu")
    assert by_provider(selection.choices) == by_provider(selection.graph_choices) == {"triton": ALL}
    assert not selection.needs_zeroed_slots


def test_older_shrink_name_and_embedding_without_max_len_are_detected(emulate):
    with emulate("pr506-draft"):
        choices = providers.select_ops("cpu").choices
    assert choices["chunked_sgmv_lora_shrink_fwd"].kernel.kernel_name == "chunked_sgmv_lora_shrink_forward"
    assert "max_len" not in choices["embedding_lora_a_fwd"].kernel.arguments


def test_native_mode_with_a_missing_op_names_it_and_the_build_that_has_it(emulate):
    with emulate("pr506-draft", kernels="native"):
        with pytest.raises(RuntimeError) as error:
            providers.select_ops()
    assert "sgl-kernel-xpu op chunked_sgmv_lora_expand_fwd is unavailable" in str(error.value)
    assert "Install an sgl-kernel-xpu build with chunked_sgmv_lora_expand_fwd" in str(error.value)


def test_backend_construction_fails_at_start_up_in_native_mode(emulate, sglang_plugins_loaded):
    from sglang_xpu_lora.backend.xpu import IntelXpuLoRABackend

    with emulate("v0.1.0", kernels="native"):
        with pytest.raises(RuntimeError, match="op sgemm_lora_b_fwd is unavailable"):
            IntelXpuLoRABackend(max_loras_per_batch=2, device=torch.device("cpu"))


# --- bound native calls match the portable ops ---------------------------------------------------


def _batch(num_rows=7, num_slots=3, max_rank=4):
    torch.manual_seed(0)
    seg_indptr = torch.tensor([0, 3, 3, num_rows], dtype=torch.int32)
    weight_indices = torch.tensor([2, 0, 1], dtype=torch.int32)
    ranks = torch.tensor([0, max_rank, 2], dtype=torch.int32)
    return dict(seg_indptr=seg_indptr, weight_indices=weight_indices, lora_ranks=ranks)


@pytest.mark.parametrize("build", ["full", "full-syncfree"])
def test_each_native_op_matches_the_portable_op(emulate, build):
    rows, slots, rank, hidden = 7, 3, 4, 12
    meta = _batch(rows, slots, rank)
    permutation = torch.tensor([6, 0, 5, 1, 4, 2, 3], dtype=torch.int32)
    x = torch.randn(rows, hidden)
    a = torch.randn(slots, 3 * rank, hidden)
    mid = torch.randn(rows, 3 * rank)
    b = torch.randn(slots, 20, rank)
    base = torch.randn(rows, 20)
    scalings = torch.tensor([0.5, 2.0, 1.0])
    offsets = torch.tensor([0, 8, 14, 20], dtype=torch.int32)
    ids = torch.tensor([0, 5, 9, 10, 3, 11, 2])
    emb = torch.randn(slots, rank, 11)
    calls = {
        "embedding_lora_a_fwd": dict(input_ids=ids, weights=emb, vocab_size=11, max_len=4, **meta),
        "sgemm_lora_a_fwd": dict(input_x=x, weights=a, num_slices=3, **meta),
        "sgemm_lora_b_fwd": dict(input_x=mid[:, :rank].contiguous(), weights=b, scalings=scalings, base_output=base, **meta),
        "qkv_lora_b_fwd": dict(input_x=mid, qkv_lora_b=b, output_offset=offsets, max_qkv_out_dim=8, scalings=scalings, base_output=base, **meta),
        "gate_up_lora_b_fwd": dict(input_x=mid[:, : 2 * rank].contiguous(), gate_up_lora_b=b, output_dim=10, scalings=scalings, **meta),
        "chunked_sgmv_lora_shrink_fwd": dict(input_x=x, weights=a, num_slices=3, num_segments=3, permutation=permutation, **meta),
        "chunked_sgmv_lora_expand_fwd": dict(
            input_x=mid, weights=b, slice_offsets=offsets, max_slice_size=8, num_slices=3, num_segments=3,
            scalings=scalings, permutation=permutation, base_output=base, **meta,
        ),
    }
    with emulate(build) as kernel_calls:
        selection = providers.select_ops()
        for op, kwargs in calls.items():
            got = getattr(selection.eager, op)(**kwargs)
            expected = getattr(torch_ops, op)(**kwargs)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=op)
        assert set(kernel_calls) == ALL


# --- the emulator's contract checks catch violations fed on purpose --------------------------------


@pytest.mark.parametrize(
    "op, change, message",
    [
        ("embedding_lora_a_fwd", {"lora_ranks": torch.tensor([0, 4, 2])}, "expected scalar type Int but found torch.int64"),
        ("sgemm_lora_a_fwd", {"input_x": torch.randn(12, 7).t()}, "input_x must be contiguous"),
        ("sgemm_lora_a_fwd", {"seg_indptr": torch.tensor([0, 3, 3, 6], dtype=torch.int32)}, r"seg_indptr\[-1\] \(6\) must equal num_tokens \(7\)"),
        ("sgemm_lora_a_fwd", {"weight_indices": torch.tensor([2, 0, 3], dtype=torch.int32)}, r"weight_indices must be in \[0, 3\)"),
        ("qkv_lora_b_fwd", {"output_offset": torch.tensor([0, 8, 20], dtype=torch.int32)}, "output_offset must have exactly 4 elements"),
        ("qkv_lora_b_fwd", {"max_qkv_out_dim": 6}, r"max_qkv_out_dim \(6\) must equal the widest band \(8\)"),
        ("qkv_lora_b_fwd", {"input_x": torch.randn(7, 8)}, r"input_x.size\(1\) \(8\) must equal 3 \* weights.size\(2\) \(4\)"),
        ("sgemm_lora_b_fwd", {"base_output": torch.randn(7, 20, dtype=torch.float64)}, "base_output must be float16, bfloat16 or float32"),
        ("sgemm_lora_a_fwd", {"lora_ranks": torch.tensor([0, 5, 2], dtype=torch.int32)}, r"lora_ranks must be in \[0, 4\]"),
    ],
)
def test_emulator_catches_contract_violations(emulate, op, change, message):
    meta = _batch()
    base = {
        "embedding_lora_a_fwd": dict(input_ids=torch.arange(7), weights=torch.randn(3, 4, 11), vocab_size=11, max_len=4, **meta),
        "sgemm_lora_a_fwd": dict(input_x=torch.randn(7, 12), weights=torch.randn(3, 4, 12), num_slices=1, **meta),
        "sgemm_lora_b_fwd": dict(input_x=torch.randn(7, 4), weights=torch.randn(3, 20, 4), scalings=torch.ones(3), **meta),
        "qkv_lora_b_fwd": dict(
            input_x=torch.randn(7, 12), qkv_lora_b=torch.randn(3, 20, 4), output_offset=torch.tensor([0, 8, 14, 20], dtype=torch.int32),
            max_qkv_out_dim=8, scalings=torch.ones(3), **meta,
        ),
    }[op]
    with emulate("full"):
        bound = getattr(providers.select_ops().eager, op)
        bound(**base)  # the unmodified call is valid
        with pytest.raises(RuntimeError, match=message):
            bound(**{**base, **change})


# --- the provider table of docs/providers.md -----------------------------------------------------

DOC = Path(__file__).resolve().parents[2] / "docs" / "providers.md"


def provider_table(emulate, device: str) -> str:
    """Markdown: for each op, the provider outside / inside graphs under ``auto``, per emulated build
    (``none``: no LoRA ops in the installed sgl_kernel), and whether pool slots are zeroed before each
    load (the pool is SGLang's packed layout in every case)."""
    builds = ["none", *EXPECTED_NATIVE]
    columns = {}
    for build in builds:
        with emulate(build) if build != "none" else contextlib.nullcontext():
            selection = providers.choose(device)
        columns[build] = {op: f"{selection.choices[op].provider.name} / {selection.graph_choices[op].provider.name}" for op in OP_NAMES}
        columns[build]["Pool slots zeroed before each load"] = "yes" if selection.needs_zeroed_slots else "no"
    lines = ["| op | " + " | ".join(f"`{b}`" for b in builds) + " |", "|---" * (len(builds) + 1) + "|"]
    for row in (*OP_NAMES, "Pool slots zeroed before each load"):
        name = f"`{row}`" if row in OP_NAMES else row
        lines.append(f"| {name} | " + " | ".join(columns[b][row] for b in builds) + " |")
    return "\n".join(lines)


def test_docs_provider_table_is_current(emulate, monkeypatch):
    monkeypatch.setenv("SGLANG_XPU_LORA_KERNELS", "auto")
    tables = {"cpu": provider_table(emulate, "cpu")}
    with monkeypatch.context() as patched:  # as on an XPU: Triton runs, the build's kernels too
        patched.setattr(native, "has_kernel_for_device", lambda kernel, device_type: True)
        from sglang_xpu_lora.providers import triton_ops

        patched.setattr(triton_ops, "triton_support", lambda device: (True, "Triton test backend"))
        tables["xpu"] = provider_table(emulate, "xpu")
    text = DOC.read_text()
    for device, table in tables.items():
        assert table in text, f"docs/providers.md is out of date; the {device} table is now:\n{table}"


@pytest.mark.parametrize(
    "op, change, message",
    [
        ("sgemm_lora_a_fwd", {"input_x": torch.randn(12, 7).t()}, "input_x must be contiguous"),
        ("sgemm_lora_a_fwd", {"weight_indices": torch.tensor([2, 0, 3], dtype=torch.int32)}, r"weight_indices must be in \[0, 3\)"),
        ("sgemm_lora_a_fwd", {"lora_ranks": torch.tensor([0, 5, 2], dtype=torch.int32)}, r"lora_ranks must be in \[0, 4\]"),
        ("sgemm_lora_a_fwd", {"seg_indptr": torch.tensor([0, 3, 3, 8], dtype=torch.int32)}, r"seg_indptr\[-1\] must not exceed num_tokens \(7\)"),
        ("qkv_lora_b_fwd", {"max_qkv_out_dim": 6}, r"max_qkv_out_dim \(6\) must equal the widest band"),
    ],
)
def test_the_sync_free_build_checks_values_on_the_device(emulate, op, change, message):
    meta = _batch()
    base = {
        "sgemm_lora_a_fwd": dict(input_x=torch.randn(7, 12), weights=torch.randn(3, 4, 12), num_slices=1, **meta),
        "qkv_lora_b_fwd": dict(
            input_x=torch.randn(7, 12), qkv_lora_b=torch.randn(3, 20, 4), output_offset=torch.tensor([0, 8, 14, 20], dtype=torch.int32),
            max_qkv_out_dim=8, scalings=torch.ones(3), **meta,
        ),
    }[op]
    with emulate("full-syncfree"):
        bound = getattr(providers.select_ops().eager, op)
        bound(**base)
        with pytest.raises(RuntimeError, match=message):
            bound(**{**base, **change})


def test_eager_decode_rule_moves_the_host_syncing_permuted_ops_to_triton(emulate, as_on_xpu, monkeypatch):
    """On by default: eager decode (the permuted ops) runs SGLang's Triton kernels in place of
    native ops not shown sync-free, the other eager ops and the graph table unchanged; off, every
    op the build has is native eagerly. Native ops a trial capture showed sync-free stay native."""
    from sglang_xpu_lora.providers import selection

    decode = set(DECODE_OPS)
    with emulate("full"):
        ruled = providers.select_ops("xpu")
        sync_free = {op: capture_probe.Verdict(op, True, "captured") for op in ALL}
        shown_sync_free = providers.select_ops("xpu", sync_free)
        monkeypatch.setattr(selection, "EAGER_DECODE_AVOIDS_HOST_SYNCS", False)
        off = providers.select_ops("xpu")
    assert by_provider(off.choices) == groups(native=ALL)
    assert by_provider(ruled.choices) == groups(native=ALL - decode, triton=decode)
    assert all("syncs with the host" in ruled.choices[op].reason for op in decode)
    assert ruled.graph_choices == off.graph_choices
    assert by_provider(shown_sync_free.choices) == groups(native=ALL)
