"""``sglang-xpu-lora doctor``: can this machine serve ``--lora-backend intel_xpu``, and how?

Prints the plugin, SGLang, torch and kernel-build versions, whether an XPU is visible, which
provider (native, triton, torch) each of the seven LoRA ops uses outside and inside graphs and why
(on a CUDA/XPU device after a trial capture of each native op, as at graph set-up; without one it
says that graph set-up decides), the LoRA pool layout (and whether its slots are zeroed before each
load), the ``sglang.lora_backends`` plugins and their distributions, and whether every SGLang patch
point was found. Exit status 0 when the configuration can serve, 1
otherwise. ``--json`` prints the same report as one JSON object. Without torch or SGLang it says
what to install instead of failing with a traceback; ``sglang-xpu-lora --version`` prints the plugin
version.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import sys
import warnings
from typing import Any, Optional, Sequence


def collect() -> dict[str, Any]:
    """The report as a JSON-serialisable dict (see module docstring).

    Runs SGLang's ``load_plugins()`` first, as every SGLang process does, so kernel builds or
    shims that plugins register are seen exactly as the server would see them.
    """
    import torch

    try:
        from sglang.srt.plugins import load_plugins
    except ImportError:
        pass
    else:
        load_plugins()

    from sglang_xpu_lora import __version__, providers
    from sglang_xpu_lora.backend.registration import INTEL_XPU
    from sglang_xpu_lora.providers import native
    from sglang_xpu_lora.upstream import compat, targets

    xpu = getattr(torch, "xpu", None)
    xpu_visible = bool(xpu is not None and xpu.is_available())
    device = "xpu" if xpu_visible else "cuda" if torch.cuda.is_available() else "cpu"
    version = compat.sglang_version()
    host_problems = compat.check_host()
    report: dict[str, Any] = {
        "plugin": __version__,
        "sglang": str(version) if version else None,
        "sglang_supported": compat.SUPPORTED_SGLANG_RANGE,
        "torch": torch.__version__,
        "kernel_build": native.kernel_build()[1],
        "xpu_visible": xpu_visible,
        "device": device,
        "problems": [],
    }
    try:
        report["kernels"] = providers.kernels_choice()
        with _quiet(providers.logger):  # the report says it all, once
            selection = providers.select_ops(device)
            report["graph_probe"], verdicts = capture_probe_report(selection, device)
            if verdicts:
                selection = providers.select_ops(device, verdicts)
    except (ValueError, RuntimeError) as exc:
        report.setdefault("kernels", f"{os.environ.get(providers.KERNELS_ENV)!r} (invalid)")
        report["ops"] = []
        report["problems"].append(str(exc))
    else:
        report["ops"] = op_rows(selection)
        report["pool_layout"] = (
            "SGLang's packed, real ranks; slots zeroed before each load" if selection.needs_zeroed_slots
            else "SGLang's packed, real ranks"
        )
        try:
            device_error = INTEL_XPU.device_error(device)
        except ValueError as exc:
            device_error = str(exc)
        if device_error:
            report["problems"].append(device_error)
    missing = compat.unresolved_targets() if version else {}
    report["patch_points"] = [{"symbol": target, "found": version is not None and target not in missing} for target in targets.ALL]
    for point in report["patch_points"]:
        if point["symbol"] in missing and (failure := compat.import_failure(point["symbol"])):
            point["import_failed"] = failure.module  # the root cause is one of the problems, once
    add_plugin_report(report, host_problems)
    report["problems"].extend(host_problems)
    add_adapter_checks(report)
    report["can_serve"] = not report["problems"]
    return report


#: Sizes of doctor's trial captures: a decode graph of 64 tokens, 8 slots, rank 16, bfloat16.
PROBE_TOKENS, PROBE_SLOTS = 64, 8


def capture_probe_report(selection, device: str) -> tuple[Any, dict]:
    """``(report entry, verdicts)``: on a device with graphs, each native op the selection would run
    inside graphs tried in a trial capture, as graph set-up does (:data:`PROBE_TOKENS` tokens,
    :data:`PROBE_SLOTS` slots); elsewhere, or with nothing to try, a sentence and no verdicts."""
    from sglang_xpu_lora.providers import capture_probe, native

    if not selection.graph_candidates:
        return "no native op to try inside graphs", {}
    choice = capture_probe.graph_native_choice()
    if choice != "probe":
        return f"not tried ({capture_probe.GRAPH_NATIVE_ENV}={choice})", {}
    graphs, why_not = capture_probe.device_graphs(device)
    if graphs is None:
        return f"not tried here ({why_not}): decided by a trial capture at graph set-up on the serving device", {}
    case = capture_probe.ProbeCase.for_graph_setup(device, PROBE_TOKENS, PROBE_SLOTS)
    verdicts = capture_probe.CaptureProbe(graphs).try_ops(selection.graph_candidates, case, native.bind)
    rows = [{"op": op, "capture_safe": v.capture_safe, "reason": v.reason, "ms": round(v.seconds * 1e3, 3)} for op, v in verdicts.items()]
    return rows, verdicts


def add_adapter_checks(report: dict[str, Any]) -> None:
    """Which backends' adapters are checked and fixed at load (``SGLANG_XPU_LORA_ADAPTER_CHECKS``);
    an invalid value is a problem."""
    from sglang_xpu_lora.adapters import checked_backends

    report["adapter_checks"] = checked_backends.describe()
    try:
        checked_backends.setting()
    except ValueError as exc:
        report["problems"].append(str(exc))


def op_rows(selection) -> list[dict[str, Any]]:
    """One row per op of an :class:`~sglang_xpu_lora.providers.OpSelection`: the provider, kernel
    and reason outside graphs (``provider``, ``kernel``, ``capture_safe``, ``reason``) and inside
    them (``graph_provider``, ``graph_reason``)."""
    return [
        {
            "op": op,
            "provider": choice.provider,
            "kernel": getattr(choice.kernel, "kernel_name", None),
            "capture_safe": choice.capture_safe,
            "graph_provider": selection.graph_choices[op].provider,
            "reason": choice.reason,
            "graph_reason": selection.graph_choices[op].reason,
        }
        for op, choice in selection.choices.items()
    ]


def render_ops(ops: list[dict[str, Any]]) -> list[str]:
    """Text lines for :func:`op_rows`: providers eager / in graphs, then why (the graph reason only
    where it differs)."""
    width = max((len(op["op"]) for op in ops), default=0)
    lines = []
    for op in ops:
        safe = {True: "graph-safe", False: "not graph-safe", None: "tried at graph set-up"}[op["capture_safe"]]
        lines.append(f"  {op['op']:<{width}}  {op['provider']:>6} / {op['graph_provider']:<6}  {safe:<16}  {op['reason']}")
        if op["graph_reason"] != op["reason"]:
            lines.append(f"  {'':<{width}}  {'':>6}   {'':<6}  {'in graphs:':<16}  {op['graph_reason']}")
    return lines


def add_plugin_report(report: dict[str, Any], host_problems: list[str]) -> None:
    """Add the ``sglang.lora_backends`` side of the report, as this process loaded it.

    ``backends``: one entry per registered backend: ``name``, the entry point (``plugin``) that
    declared it and the ``distribution`` that ships that entry point (``name version``), so a
    user can tell which installed package serves ``--lora-backend NAME``. ``plugin_errors``: every
    ``sglang.lora_backends`` entry point that was skipped, with why (import error, misspelled hook,
    a name SGLang or another plugin already has), and why sglang-xpu-lora could not patch SGLang
    (a patch failed and everything was rolled back), which is also a problem: ``intel_xpu`` is
    then not registered. ``host_problems`` (the compatibility check, reported separately) are not
    repeated.
    """
    from sglang_xpu_lora import plugin
    from sglang_xpu_lora.registry import get_registry

    registry = get_registry()
    report["backends"] = [
        {"name": name, "plugin": registry.owner(name),
         "distribution": registry.plugin_distributions.get(registry.owner(name), "unknown")}
        for name in registry.specs()
    ]
    own = [problem for problem in plugin.host_problems if problem not in host_problems]
    report["plugin_errors"] = [f"{ep}: {error}" for ep, error in registry.load_errors.items()]
    report["plugin_errors"] += [f"sglang-xpu-lora: {problem}" for problem in own]
    report["problems"].extend(own)


def render_plugins(report: dict[str, Any]) -> list[str]:
    """The lines of :func:`add_plugin_report` for :func:`render`."""
    lines = ["LoRA backends from sglang.lora_backends (backend: entry point, distribution):"]
    lines += [f"  {b['name']}: {b['plugin']}, {b['distribution']}" for b in report["backends"]] or ["  none"]
    if report["plugin_errors"]:
        lines.append("Plugin load errors:")
        lines += [f"  - {error}" for error in report["plugin_errors"]]
    return lines


@contextlib.contextmanager
def _quiet(logger: logging.Logger):
    previous = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(previous)


def missing_host_packages() -> list[str]:
    """Why this interpreter lacks what ``doctor`` inspects (torch, SGLang), as sentences; empty when
    both are importable. Never raises: a broken torch install is reported with its import error."""
    problems = []
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        if isinstance(exc, ModuleNotFoundError) and exc.name == "torch":
            problems.append("torch is not installed")
        else:
            problems.append(f"torch cannot be imported ({type(exc).__name__}: {exc})")
    if importlib.util.find_spec("sglang") is None:
        problems.append("SGLang is not installed")
    return problems


def render_missing_host(problems: Sequence[str]) -> str:
    """The text ``doctor`` prints instead of a report when :func:`missing_host_packages` found some."""
    from sglang_xpu_lora import __version__
    from sglang_xpu_lora.upstream import compat

    return "\n".join(
        [f"sglang-xpu-lora {__version__} cannot check this Python ({sys.executable}):"]
        + [f"  - {problem}" for problem in problems]
        + [
            f"Install the XPU build of torch and SGLang {compat.SUPPORTED_SGLANG_RANGE} into this environment "
            "first (README, Prerequisites), then run `sglang-xpu-lora doctor` again."
        ]
    )


@contextlib.contextmanager
def quiet_host_imports():
    """Hide what SGLang, Triton and torch print while their modules are imported and do not concern
    LoRA (SGLang's "Only CUDA, HIP and XPU support AWQ currently", its GGUF note, Triton's backend
    notes): warnings from their modules, and SGLang log records below ERROR."""
    with warnings.catch_warnings(), _quiet(logging.getLogger("sglang")):
        warnings.filterwarnings("ignore", module=r"(sglang|triton|torch)(\.|$)")
        yield


def render(report: dict[str, Any]) -> str:
    """The report as text for a person."""
    lines = [
        f"sglang-xpu-lora {report['plugin']}",
        f"  SGLang        {report['sglang'] or 'not installed'} (supported {report['sglang_supported']})",
        f"  torch         {report['torch']}",
        f"  kernel build  {report['kernel_build']}",
        f"  XPU visible   {'yes' if report['xpu_visible'] else 'no'} (serving device: {report['device']})",
        f"  SGLANG_XPU_LORA_KERNELS={report['kernels']}",
        "",
        "LoRA ops (provider outside / inside XPU graphs; safe to record in a graph; why):",
        *render_ops(report["ops"]),
    ]
    if "pool_layout" in report:
        lines.append(f"  LoRA pool layout: {report['pool_layout']}")
    probe = report.get("graph_probe")
    if isinstance(probe, list):
        lines.append(f"  Capture probe ({PROBE_TOKENS} tokens, {PROBE_SLOTS} slots): {len(probe)} native ops tried")
        lines += [f"    {row['op']}: {'runs natively' if row['capture_safe'] else 'falls back'} ({row['ms']} ms)" for row in probe]
    elif probe:
        lines.append(f"  Capture probe: {probe}")
    lines += ["", *render_plugins(report)]
    found = sum(p["found"] for p in report["patch_points"])
    lines += ["", f"SGLang patch points: {found}/{len(report['patch_points'])} found"]
    lines += [f"  missing: {p['symbol']}" for p in report["patch_points"] if not p["found"] and not p.get("import_failed")]
    behind = sum(bool(p.get("import_failed")) for p in report["patch_points"])
    lines += [f"  {behind} in modules that fail to import (the import error is below)"] if behind else []
    lines.append(f"PEFT adapter checks at load: {report['adapter_checks']}")
    lines.append("")
    if report["can_serve"]:
        lines.append("OK: --lora-backend intel_xpu can serve on this machine.")
    else:
        lines.append("CANNOT SERVE --lora-backend intel_xpu:")
        lines += [f"  - {problem}" for problem in report["problems"]]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console script ``sglang-xpu-lora``; returns the exit status."""
    from sglang_xpu_lora import __version__

    parser = argparse.ArgumentParser(prog="sglang-xpu-lora", description="sglang-xpu-lora tools")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    doctor = commands.add_parser("doctor", help="check whether this machine can serve --lora-backend intel_xpu")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    missing = missing_host_packages()
    if missing:
        if args.json:
            print(json.dumps({"plugin": __version__, "can_serve": False, "problems": missing}, indent=2))
        else:
            print(render_missing_host(missing))
        return 1
    with quiet_host_imports():
        report = collect()
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0 if report["can_serve"] else 1


if __name__ == "__main__":
    sys.exit(main())
