"""Regenerate the measured tables of ``docs/performance.md`` from ``benchmarks/results/*.json``.

    python -m benchmarks.report

Only the text between ``<!-- BEGIN name -->`` and ``<!-- END name -->`` markers is replaced; the
analysis around it is written by hand.
"""

from __future__ import annotations

import json
import re
import statistics
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


def _range(values) -> str:
    values = sorted(v for v in values if v is not None)
    if not values:
        return "n/a"
    return f"{values[0]:.3g}-{values[-1]:.3g} (median {statistics.median(values):.3g}, {len(values)} points)"


LAYER_COLUMNS = [
    ("max rank", "max_rank"), ("rank", "rank"), ("adapters", "adapters"), ("tokens", "tokens"), ("base µs", "base_us"),
    ("triton µs", "triton_us"), ("csgmv µs", "csgmv_us"), ("triton_v2 µs", "triton_v2_us"),
    ("torch_native µs", "torch_native_us"), ("intel_xpu µs", "intel_xpu_us"), ("intel_xpu box µs", "intel_xpu_box_us"),
    ("best peer", "best_peer"), ("intel_xpu / best peer", "intel_xpu_vs_best_peer"),
    ("box / best peer", "intel_xpu_box_vs_best_peer"), ("intel_xpu LoRA µs", "intel_xpu_overhead_us"),
    ("best peer LoRA µs", "best_peer_overhead_us"),
]


def layer(data):
    """The layer benchmark (benchmarks/layer.py): a summary of ratios and overheads, then one table
    per model and mode (LoRA overhead = path - base GEMMs, µs)."""
    rows = data["rows"]
    for r in rows:
        if r.get("best_peer") and r.get("base_us") is not None:
            r["best_peer_overhead_us"] = r["best_peer_us"] - r["base_us"]
    with_lora = [r for r in rows if r["adapters"]]
    if "timing_by_mode" in data:  # a merge: each mode's figures from runs of their own settings
        timing = ", ".join(
            f"{mode} {t['calls']} x {t['rounds']} ({t['order']} order)" if t else f"{mode} not recorded"
            for mode, t in data["timing_by_mode"].items()
        )
        timing = f"back-to-back calls x rounds per figure: {timing}"
    else:
        timing = (f"{data['calls']} back-to-back calls x {data['rounds']} rounds per decode figure "
                  f"({data['prefill_calls']} x {data['prefill_rounds']} prefill)")
    out = [_machine(data) + f"; {timing}, median; every output within "
           f"{data.get('tolerance') or 2e-2:g} of float64 unless listed under failures"]
    summary = []
    for mode in ("graph", "eager", "prefill"):
        chosen = [r for r in with_lora if r["mode"] == mode]
        if not chosen:
            continue
        summary.append(f"| {mode} | {_range(r.get('intel_xpu_vs_best_peer') for r in chosen)} | "
                       f"{_range(r.get('triton_v2_vs_best_legacy') for r in chosen)} | "
                       f"{_range(r.get('intel_xpu_overhead_us') for r in chosen)} | "
                       f"{_range(r.get('best_peer_overhead_us') for r in chosen)} | "
                       f"{_range(r.get('intel_xpu_overhead_us', 0) / r['base_us'] * 100 for r in chosen if 'base_us' in r)} |")
    out.append("| mode | intel_xpu / best peer | triton_v2 / faster of triton, csgmv | intel_xpu LoRA µs | "
               "best peer LoRA µs | intel_xpu LoRA, % of base |\n|---|---|---|---|---|---|\n" + "\n".join(summary))
    counts = {}
    for r in with_lora:
        if r.get("best_peer"):
            counts[(r["mode"], r["best_peer"])] = counts.get((r["mode"], r["best_peer"]), 0) + 1
    out.append("Best peer per point: " + ", ".join(f"{mode} {peer} {n}" for (mode, peer), n in sorted(counts.items())) + ".")
    for mode, title in (("graph", "Decode, graph-captured"), ("eager", "Decode, eager"), ("prefill", "Prefill (512-token requests)")):
        for model in dict.fromkeys(r["model"] for r in rows):
            chosen = [r for r in rows if r["mode"] == mode and r["model"] == model]
            if chosen:
                out += [f"{title}, {model} layer, bf16 (adapters 0: no adapter in the batch):", _table(chosen, LAYER_COLUMNS)]
    failures = {}
    for r in rows:
        for key, why in r.items():
            if key.endswith("_failed"):
                failures.setdefault((key[: -len("_failed")], why), []).append(f"{r['model']} {r['mode']} {r['tokens']}")
    if failures or data.get("backend_failures"):
        lines = [f"- `{path}` at {len(where)} points (e.g. {where[0]}): {why}" for (path, why), where in failures.items()]
        lines += [f"- `{path}` not built: {why}" for path, why in (data.get("backend_failures") or {}).items()]
        out.append("Failures:\n\n" + "\n".join(lines))
    if data.get("points_not_run"):
        out.append(f"{data['points_not_run']} grid points not run (time budget).")
    return "\n\n".join(out)


SECTIONS = {"ops-cpu": ops_cpu, "ops-cuda": ops_cuda, "host_overhead-cpu": host, "e2e-cpu": e2e, "layer-cuda": layer}


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
