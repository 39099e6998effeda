"""Regenerate the measured tables of ``docs/performance.md`` from ``benchmarks/results/*.json``.

    python -m benchmarks.report

Only the text between ``<!-- BEGIN name -->`` and ``<!-- END name -->`` markers is replaced; the
analysis around it is written by hand.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from benchmarks.common import RESULTS

DOC = Path(__file__).resolve().parents[1] / "docs" / "performance.md"


def _load(name):
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _table(rows, columns, formats=None):
    formats = formats or {}
    lines = ["| " + " | ".join(title for title, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = []
        for _, key in columns:
            value = row(key) if callable(row) else row.get(key)
            cells.append(formats.get(key, "{:.3g}").format(value) if isinstance(value, float) else ("" if value is None else str(value)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _machine(data):
    m = data["machine"]
    parts = [m.get("gpu") or f"{m.get('cpu')} x{m.get('cpu_count')}", f"torch {m['torch']}"]
    if m.get("triton"):
        parts.append(f"triton {m['triton']}")
    return f"*{', '.join(parts)}, Python {m['python']}, {m['date']}*"


def ops_cpu(data):
    rows = [r for r in data["rows"] if r["mode"] == "decode" and r["model"] == "llama-3.1-8b"]
    cols = [("rank", "rank"), ("adapters", "adapters"), ("tokens", "tokens"), ("portable ms", "portable_ms"),
            ("torch_native ms", "torch_native_ms"), ("speed-up", "speedup_vs_torch_native")]
    prefill = [r for r in data["rows"] if r["mode"] == "prefill" and r["model"] == "llama-3.1-8b"]
    return (_machine(data) + "\n\nDecode, Llama-3.1-8B layer (qkv+o+gate_up+down), fp32:\n\n" + _table(rows, cols)
            + "\n\nPrefill (512-token requests):\n\n" + _table(prefill, cols))


def ops_cuda(data):
    def decode_rows(model):
        return [r for r in data["rows"] if r["mode"] == "decode" and r["model"] == model and r.get("real_rank", r["rank"]) == r["rank"]]

    cols = [("rank", "rank"), ("adapters", "adapters"), ("tokens", "tokens"), ("portable eager ms", "portable_ms"),
            ("portable graph ms", "portable_graph_ms"), ("triton graph ms", "triton_graph_ms"),
            ("portable / triton", "graph_ratio_vs_triton"), ("csgmv graph ms", "csgmv_graph_ms"),
            ("portable / csgmv", "graph_ratio_vs_csgmv"), ("vs torch_native", "speedup_vs_torch_native"),
            ("roofline", "roofline_fraction")]
    out = [_machine(data)]
    bandwidth = data.get("copy_bandwidth_bytes_s")
    if bandwidth:
        out.append(f"Measured device copy bandwidth (read + write): {bandwidth / 1e12:.2f} TB/s.")
    check = data.get("graph_replay_check")
    if check:
        out.append(
            "Graph replay check (decode layer captured with one batch's routing, index buffers refilled "
            f"with another's, replayed): max relative error against eager {check['replay_error']:.2g}; "
            f"the two batches' outputs differ by {check['batches_differ']:.2g}."
        )
    for model in ("llama-3.1-8b", "llama-3.3-70b-tp8"):
        out += [f"Decode, {model} layer, bf16, CUDA graphs:", _table(decode_rows(model), cols)]
    prefill = [r for r in data["rows"] if r["mode"] == "prefill" and r["model"] == "llama-3.1-8b" and r.get("real_rank", r["rank"]) == r["rank"]]
    out += ["Prefill, llama-3.1-8b layer, bf16, CUDA graphs:", _table(prefill, cols[:9])]
    tiers = [r for r in data["rows"] if "intel_xpu_graph_ms" in r]
    if tiers:
        build = data.get("emulated_build")
        which = (f"over the emulated `{build}` build (native ops outside graphs where the emulator has kernels for the "
                 "device, the selection's graph table inside them)" if build else "as `auto` selects it on this device")
        out += [f"`intel_xpu` {which}, on SGLang's packed pool at real ranks; best peer = the faster of `triton` and "
                "`csgmv` in the same run; max error relative to a float64 reference, bf16:",
                _table(tiers, INTEL_XPU_COLUMNS)]
    return "\n\n".join(out)


INTEL_XPU_COLUMNS = [
    ("model", "model"), ("mode", "mode"), ("rank", "rank"), ("real rank", "real_rank"), ("adapters", "adapters"),
    ("tokens", "tokens"), ("graph ms", "intel_xpu_graph_ms"), ("graph / best peer", "intel_xpu_graph_vs_best_peer"),
    ("eager / triton", "intel_xpu_vs_triton"), ("max error", "intel_xpu_max_error"),
    ("graph max error", "intel_xpu_graph_max_error"),
]


def host(data):
    cols = [("decode batch", "batch_size"), ("triton µs", "triton_us"), ("intel_xpu µs", "intel_xpu_us"),
            ("ratio", "ratio"), ("syncs added", "added_syncs")]
    return _machine(data) + "\n\n" + _table(data["rows"], cols)


def e2e(data):
    cols = [("adapters", "adapters"), ("workload", "workload"), ("intel_xpu tok/s (median)", "intel_xpu_tok_s"),
            ("min-max", "intel_xpu_min_max"), ("torch_native tok/s (median)", "torch_native_tok_s"),
            ("min-max ", "torch_native_min_max"), ("ratio", "ratio")]
    return _machine(data) + f", {data.get('repeats')} repeats\n\n" + _table(data["rows"], cols)


SECTIONS = {"ops-cpu": ops_cpu, "ops-cuda": ops_cuda, "host_overhead-cpu": host, "e2e-cpu": e2e}


def main() -> None:
    text = DOC.read_text()
    for name, render in SECTIONS.items():
        data = _load(name)
        if data is None:
            continue
        block = f"<!-- BEGIN {name} -->\n{render(data)}\n<!-- END {name} -->"
        text = re.sub(rf"<!-- BEGIN {re.escape(name)} -->.*?<!-- END {re.escape(name)} -->", lambda _: block, text, flags=re.S)
    DOC.write_text(text)
    print(f"updated {DOC}")


if __name__ == "__main__":
    main()
