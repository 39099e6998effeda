"""``sglang-xpu-lora doctor``: can this machine serve ``--lora-backend intel_xpu``, and how?

Checks what a server start needs, in the order a start meets it, and prints each part as soon as
it is known (a first line at once, then one part per step; importing SGLang with its plugins is
the slow step): torch and what it sees of an XPU; SGLang's version, whether its plugin loading
registered ``intel_xpu`` and every SGLang patch point was found, the ``sglang.lora_backends``
plugins and their distributions; the serving device (``--device``, or the one SGLang picks
without it, and why) and what serving there needs (on an XPU: that torch sees it; on the CPU:
SGLang's CPU engine switch, an importable ``sgl_kernel`` and pinned host memory); which provider
(native, triton, torch) each of the seven LoRA ops uses outside and inside graphs, each reason
once with the ops it applies to (on a CUDA/XPU device after a trial capture of each native op, as
at graph set-up); the LoRA pool layout; which adapters are checked at load. Then the verdict: exit
status 0 when ``intel_xpu`` can serve, 1 otherwise with each problem once. Every line fits
:data:`WIDTH` columns.

``--json`` prints the same report as one JSON object at the end. Without torch or SGLang it says
what to install instead of failing with a traceback; ``sglang-xpu-lora --version`` prints the
plugin version.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import logging
import os
import platform
import sys
import textwrap
import time
import warnings
from typing import Any, Callable, Iterable, Optional, Sequence

from sglang_xpu_lora import __version__

#: Columns every line of the text report fits in.
WIDTH = 100


def wrap(text: str, indent: str = "", subsequent: Optional[str] = None) -> list[str]:
    """``text`` as lines of at most :data:`WIDTH` columns, the first indented by ``indent``, the
    others by ``subsequent`` (default: ``indent`` and two spaces)."""
    subsequent = indent + "  " if subsequent is None else subsequent
    return textwrap.wrap(
        text, WIDTH, initial_indent=indent, subsequent_indent=subsequent, break_on_hyphens=False
    ) or [indent.rstrip()]


# ---------------------------------------------------------------------------------------------
# The steps, each adding to the report; :data:`STEPS` pairs each with the lines it prints.


def check_torch(report: dict[str, Any], device: Optional[str]) -> None:
    """torch's version and what it sees of an XPU."""
    import torch

    from sglang_xpu_lora.upstream import devices

    xpu = getattr(torch, "xpu", None)
    report["torch"] = torch.__version__
    report["xpu_visible"] = bool(xpu is not None and xpu.is_available())
    report["xpu_seen"] = devices.device_seen("xpu")


def check_sglang(report: dict[str, Any], device: Optional[str]) -> None:
    """Import SGLang and run its plugin loading, as every SGLang process does (so kernel builds or
    shims that plugins register are seen exactly as the server sees them); what the plugins print
    on stderr is kept back and written once, without what the report says itself."""
    from sglang_xpu_lora.upstream import compat, targets

    started = time.perf_counter()
    captured = io.StringIO()
    with contextlib.redirect_stderr(captured):
        from sglang.srt.plugins import load_plugins

        load_plugins()
    report["sglang_seconds"] = round(time.perf_counter() - started, 1)
    version = compat.sglang_version()
    report["sglang"] = str(version) if version else None
    report["sglang_supported"] = compat.SUPPORTED_SGLANG_RANGE
    add_plugin_report(report)
    missing = compat.unresolved_targets() if report["problems"] else {}
    report["patch_points"] = [{"symbol": target, "found": target not in missing} for target in targets.ALL]
    for point in report["patch_points"]:
        if point["symbol"] in missing and (failure := compat.import_failure(point["symbol"])):
            point["import_failed"] = failure.module  # the root cause is one of the problems, once
    said = report["problems"] + report["plugin_errors"]
    for line in captured.getvalue().splitlines():
        if line.strip() and not any(text in line for text in said):
            print(line, file=sys.stderr)


def check_device(report: dict[str, Any], device: Optional[str]) -> None:
    """The serving device (``device``, or SGLang's pick) and what serving there needs, as
    ``intel_xpu`` is refused at argument resolution (:func:`~sglang_xpu_lora.patches.validation.device_refusal`)."""
    from sglang_xpu_lora.backend.registration import INTEL_XPU
    from sglang_xpu_lora.patches.validation import device_refusal
    from sglang_xpu_lora.providers import kernel_build
    from sglang_xpu_lora.upstream import devices

    report["kernel_build"] = kernel_build()[1]
    given = device
    if given is None:
        device, why = devices.picked_device()
        report["device_source"] = f"SGLang's pick without --device: {why}"
    else:
        report["device_source"] = "--device given"
    report["device"] = device
    try:
        refusal = device_refusal(INTEL_XPU, device, given)
    except ValueError as exc:
        refusal = str(exc)
    if refusal:
        report["problems"].append(refusal)
    if device == "cpu":
        report["problems"].extend(devices.cpu_engine_problems())


def check_ops(report: dict[str, Any], device: Optional[str]) -> None:
    """Which provider each LoRA op uses outside and inside graphs, and why; the pool layout; which
    adapters are checked at load."""
    from sglang_xpu_lora import providers

    device = ops_device(report)
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
        report["pool_layout"] = selection.pool_layout
        try:
            report["dense_tier"] = dense_tier_report(selection, device)
        except ValueError as exc:  # a bad plan table or threshold: the server would refuse to start
            report["problems"].append(str(exc))
    add_adapter_checks(report)


def ops_device(report: dict[str, Any]) -> str:
    """The device the LoRA ops are selected for: the serving device, or ``cpu`` where none was found."""
    return report["device"] or "cpu"


def dense_tier_report(selection, device: str) -> Optional[dict[str, Any]]:
    """Where the linears run on the dense tier (SGLang's ``triton_v2`` kernels; :mod:`sglang_xpu_lora.dense`):
    the modes whose shrink the selection gives to SGLang's Triton kernels, the eager token threshold,
    whether smaller eager batches launch from compiled handles (``direct_launches``,
    :func:`~sglang_xpu_lora.providers.triton_launch.launches_like_jit_run`), and the plan tables
    read, in order; None when the dense tier serves no batch. The threshold is checked either way,
    as the backend reads it whatever the selection; the plan tables only where the tier serves, as
    the backend reads them.

    Raises:
        ValueError: a bad ``SGLANG_XPU_LORA_PLANS`` table or ``SGLANG_XPU_LORA_EAGER_DENSE_MIN_TOKENS``.
    """
    import torch

    from sglang_xpu_lora.backend.xpu import eager_dense_min_tokens
    from sglang_xpu_lora.dense.plans import PlanTable, sglang_architecture
    from sglang_xpu_lora.providers.triton_launch import launches_like_jit_run

    eager_min_tokens = eager_dense_min_tokens()
    modes = [mode for mode, use_graph in (("eager", False), ("graphs", True)) if selection.dense_tier_serves(use_graph)]
    if not modes:
        return None
    device = torch.device(device)
    return {
        "modes": modes,
        "eager_min_tokens": eager_min_tokens,
        "direct_launches": launches_like_jit_run(),
        "plans": PlanTable(device, sglang_architecture(device)).sources,
    }


def render_torch(report: dict[str, Any]) -> list[str]:
    return [f"  torch         {report['torch']}", *wrap(report["xpu_seen"], "  XPU           ", " " * 16)]


def render_sglang(report: dict[str, Any]) -> list[str]:
    found = sum(p["found"] for p in report["patch_points"])
    lines = wrap(
        f"{report['sglang'] or 'not installed'} (supported {report['sglang_supported']}), imported with its "
        f"plugins in {report['sglang_seconds']} s", "  SGLang        ", " " * 16,
    )
    behind = sum(bool(p.get("import_failed")) for p in report["patch_points"])
    lines.append(
        f"  patch points  {found}/{len(report['patch_points'])} found"
        + (f" ({behind} in modules that fail to import: the import error is below)" if behind else "")
    )
    return lines + render_plugins(report)


def render_device(report: dict[str, Any]) -> list[str]:
    device = report["device"] or "none found"
    return [
        *wrap(report["kernel_build"], "  kernel build  ", " " * 16),
        *wrap(f"{device} ({report['device_source']})", "  device        ", " " * 16),
    ]


def render_ops_section(report: dict[str, Any]) -> list[str]:
    lines = ["", *wrap(
        f"LoRA ops for device {ops_device(report)} (SGLANG_XPU_LORA_KERNELS={report['kernels']}; "
        "provider outside / inside graphs):"
    )]
    lines += render_ops(report["ops"])
    if "pool_layout" in report:
        lines.append(f"LoRA pool layout: {report['pool_layout']}")
    dense = report.get("dense_tier")
    if dense:
        where = " and ".join(
            "inside graphs" if mode == "graphs" else f"outside graphs from {dense['eager_min_tokens']} tokens"
            for mode in dense["modes"]
        )
        lines += wrap(f"Linears on the dense tier (SGLang's triton_v2 kernels) {where}; plans from {', '.join(dense['plans'])}")
        if "eager" in dense["modes"]:
            how = ("launched from compiled handles" if dense["direct_launches"]
                   else "launched through Triton's JIT (this Triton's JITFunction.run launches otherwise)")
            lines += wrap(f"Linears of smaller eager batches: SGLang's triton kernels {how}")
    probe = report.get("graph_probe")
    if isinstance(probe, list):
        lines.append(f"Capture probe ({PROBE_TOKENS} tokens, {PROBE_SLOTS} slots): {len(probe)} native ops tried")
        lines += [f"  {row['op']}: {'runs natively' if row['capture_safe'] else 'falls back'} ({row['ms']} ms)" for row in probe]
    elif probe:
        lines += wrap(f"Capture probe: {probe}")
    lines += wrap(f"PEFT adapter checks at load: {report['adapter_checks']}")
    return lines


#: ``(step, its lines)`` in the order a server start meets them; :func:`main` prints each step's
#: lines as soon as it finished.
STEPS: tuple[tuple[Callable[[dict, Optional[str]], None], Callable[[dict], list[str]]], ...] = (
    (check_torch, render_torch),
    (check_sglang, render_sglang),
    (check_device, render_device),
    (check_ops, render_ops_section),
)


def collect(device: Optional[str] = None, emit: Optional[Callable[[list[str]], None]] = None) -> dict[str, Any]:
    """The report as a JSON-serialisable dict (see module docstring).

    :param device: the ``--device`` the server will get; None: the one SGLang picks without it.
    :param emit: called with each step's text lines as soon as the step finished.
    """
    report: dict[str, Any] = {"plugin": __version__, "problems": []}
    for step, render_step in STEPS:
        step(report, device)
        if emit is not None:
            emit(render_step(report))
    report["problems"] = list(dict.fromkeys(report["problems"]))  # each once, in the order found
    report["can_serve"] = not report["problems"]
    return report


#: Sizes of doctor's trial captures: a decode graph of 64 tokens, 8 slots, rank 16, bfloat16.
PROBE_TOKENS, PROBE_SLOTS = 64, 8


def capture_probe_report(selection, device: str) -> tuple[Any, dict]:
    """``(report entry, verdicts)``: on a device with graphs, each native op the selection would run
    inside graphs tried in a trial capture, as graph set-up does (:data:`PROBE_TOKENS` tokens,
    :data:`PROBE_SLOTS` slots); elsewhere, or with nothing to try, a sentence and no verdicts."""
    from sglang_xpu_lora.providers import capture_probe

    if not selection.graph_candidates:
        return "no native op to try inside graphs", {}
    choice = capture_probe.graph_native_choice()
    if choice != "probe":
        return f"not tried ({capture_probe.GRAPH_NATIVE_ENV}={choice})", {}
    graphs, why_not = capture_probe.device_graphs(device)
    if graphs is None:
        return f"not tried here ({why_not}): decided by a trial capture at graph set-up on the serving device", {}
    case = capture_probe.ProbeCase.for_graph_setup(device, PROBE_TOKENS, PROBE_SLOTS)
    verdicts = capture_probe.CaptureProbe(graphs).try_ops(selection.graph_candidates, case, selection.bind_trial)
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
            "provider": choice.provider.name,
            "kernel": getattr(choice.kernel, "kernel_name", None),
            "capture_safe": choice.capture_safe,
            "graph_provider": selection.graph_choices[op].provider.name,
            "reason": choice.reason,
            "graph_reason": selection.graph_choices[op].reason,
        }
        for op, choice in selection.choices.items()
    ]


def reason_clauses(reason: str) -> list[str]:
    """``reason`` split at its top-level ``"; "`` (not inside parentheses): the clauses a selection
    reason is made of ("no native op: ...", "no Triton: ...")."""
    clauses, depth, start = [], 0, 0
    for i, char in enumerate(reason):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0 and reason.startswith("; ", i):
            clauses.append(reason[start:i])
            start = i + 2
    return [clause for clause in clauses + [reason[start:]] if clause]


def grouped_reasons(ops: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Each reason clause of :func:`op_rows` once, in the order first met, with the ops it applies
    to as a phrase: ``"all 7 ops"``, or their names, an op whose clause holds only inside graphs
    marked ``(in graphs)`` unless the clause says so itself."""
    groups: dict[str, list[tuple[str, bool]]] = {}
    for op in ops:
        eager = reason_clauses(op["reason"])
        for clause in eager:
            groups.setdefault(clause, []).append((op["op"], False))
        for clause in reason_clauses(op["graph_reason"]):
            if clause not in eager:
                groups.setdefault(clause, []).append((op["op"], "inside graphs" not in clause))
    phrased = []
    for clause, members in groups.items():
        if len(members) == len(ops) and not any(graphs_only for _, graphs_only in members):
            which = f"all {len(ops)} ops"
        else:
            which = ", ".join(f"{name} (in graphs)" if graphs_only else name for name, graphs_only in members)
        phrased.append((clause, which))
    return phrased


def render_ops(ops: list[dict[str, Any]]) -> list[str]:
    """Text lines for :func:`op_rows`: per op, the providers outside / inside graphs and whether it
    is safe to record in a graph; then why, each reason once with the ops it applies to."""
    width = max((len(op["op"]) for op in ops), default=0)
    lines = []
    for op in ops:
        safe = {True: "graph-safe", False: "not graph-safe", None: "tried at graph set-up"}[op["capture_safe"]]
        lines.append(f"  {op['op']:<{width}}  {op['provider']:>6} / {op['graph_provider']:<6}  {safe}")
    if ops:
        lines.append("Why (each reason once, with the ops it applies to):")
    for clause, which in grouped_reasons(ops):
        lines += wrap(f"- {which}: {clause}", "  ", "    ")
    return lines


def add_plugin_report(report: dict[str, Any]) -> None:
    """Add the ``sglang.lora_backends`` side of the report, as this process loaded it.

    ``backends``: one entry per registered backend: ``name``, the entry point (``plugin``) that
    declared it and the ``distribution`` that ships that entry point (``name version``), so a
    user can tell which installed package serves ``--lora-backend NAME``. ``plugin_errors``: every
    ``sglang.lora_backends`` entry point that was skipped, with why (import error, misspelled hook,
    a name SGLang or another plugin already has). Problems: why sglang-xpu-lora registered nothing
    (the compatibility check, or a patch failed and everything was rolled back), or that SGLang's
    plugin loading never ran it.
    """
    from sglang_xpu_lora import plugin
    from sglang_xpu_lora.backend.registration import INTEL_XPU
    from sglang_xpu_lora.registry import get_registry

    registry = get_registry()
    report["backends"] = [
        {"name": name, "plugin": registry.owner(name),
         "distribution": registry.plugin_distributions.get(registry.owner(name), "unknown")}
        for name in registry.specs()
    ]
    report["plugin_errors"] = [f"{ep}: {error}" for ep, error in registry.load_errors.items()]
    report["problems"].extend(plugin.host_problems)
    if not plugin.host_problems and INTEL_XPU.name not in registry.specs():
        selected = os.environ.get("SGLANG_PLUGINS")
        why = (
            f"SGLANG_PLUGINS={selected} does not list intel_xpu_lora" if selected
            else "is sglang-xpu-lora installed in this Python?"
        )
        report["problems"].append(
            f"SGLang's plugin loading did not register {INTEL_XPU.name}: it never ran the plugin "
            f"(entry point intel_xpu_lora, group sglang.srt.plugins); {why}"
        )


def render_plugins(report: dict[str, Any]) -> list[str]:
    """The lines of :func:`add_plugin_report` for :func:`render`."""
    backends = [f"{b['name']} ({b['plugin']}, {b['distribution']})" for b in report["backends"]]
    lines = wrap(", ".join(backends) or "none", "  LoRA backends ", " " * 16)
    for error in report["plugin_errors"]:
        lines += wrap(f"plugin load error: {error}", "  ", "    ")
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
    from sglang_xpu_lora.upstream import compat

    return "\n".join(
        [f"sglang-xpu-lora {__version__} cannot check this Python ({sys.executable}):"]
        + [f"  - {problem}" for problem in problems]
        + wrap(
            f"Install the XPU build of torch and SGLang {compat.SUPPORTED_SGLANG_RANGE} into this environment "
            "first (README, Prerequisites), then run `sglang-xpu-lora doctor` again.", "", ""
        )
    )


@contextlib.contextmanager
def quiet_host_imports():
    """Hide what SGLang, Triton and torch print while their modules are imported and do not concern
    LoRA (SGLang's "Only CUDA, HIP and XPU support AWQ currently", its GGUF note, Triton's backend
    notes): warnings from their modules, and SGLang log records below ERROR."""
    with warnings.catch_warnings(), _quiet(logging.getLogger("sglang")):
        warnings.filterwarnings("ignore", module=r"(sglang|triton|torch)(\.|$)")
        yield


def header() -> list[str]:
    """The first line(s), printed before anything heavy is imported."""
    return wrap(f"sglang-xpu-lora {__version__} doctor: Python {platform.python_version()} at {sys.executable}")


def verdict(report: dict[str, Any]) -> list[str]:
    """The last lines: OK, or each problem once."""
    if report["can_serve"]:
        return ["", "OK: --lora-backend intel_xpu can serve on this machine."]
    lines = ["", "CANNOT SERVE --lora-backend intel_xpu:"]
    for problem in report["problems"]:
        lines += wrap(f"- {problem}", "  ", "    ")
    return lines


def render(report: dict[str, Any]) -> str:
    """The whole report as text for a person (what :func:`main` prints step by step)."""
    lines = header()
    for _, render_step in STEPS:
        lines += render_step(report)
    return "\n".join(lines + verdict(report))


def _print_lines(lines: Iterable[str]) -> None:
    for line in lines:
        print(line)
    sys.stdout.flush()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console script ``sglang-xpu-lora``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="sglang-xpu-lora", description="sglang-xpu-lora tools")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    doctor = commands.add_parser("doctor", help="check whether this machine can serve --lora-backend intel_xpu")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument(
        "--device", help="the --device the server gets (default: the one SGLang picks without it)"
    )
    args = parser.parse_args(argv)
    if not args.json:
        _print_lines(header())
    missing = missing_host_packages()
    if missing:
        if args.json:
            print(json.dumps({"plugin": __version__, "can_serve": False, "problems": missing}, indent=2))
        else:
            print(render_missing_host(missing))
        return 1
    with quiet_host_imports():
        report = collect(args.device, emit=None if args.json else _print_lines)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_lines(verdict(report))
    return 0 if report["can_serve"] else 1


if __name__ == "__main__":
    sys.exit(main())
