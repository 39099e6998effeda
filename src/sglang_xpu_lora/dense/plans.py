"""Plan tables: which kernels, tiles and overlap the dense tier runs for each linear call.

A plan is SGLang 0.5.23's ``DensePlan`` (``srt/lora/dense/plan.py``): the shrink family
(``grouped`` split-K, ``per_row``, ``all_slots``), the expand family (``grouped``, ``per_row``), the
overlap with the base GEMM (``none``, ``a``, ``ab_delta``), the route's block size and the tiles;
or the project's :class:`~sglang_xpu_lora.dense.fused.FusedPlan` (shrink and expand in one kernel,
per token, for decode). A table is a JSON file in SGLang's ``plans.json`` schema:
``{"rows": [row, ...]}``, each row ``{"name", "phase", "kinds", "max_tokens", "max_rank",
"min_in_features", "max_in_features", "min_out_features", "max_out_features", "spec"}`` (every
selector optional; ``spec`` as ``DensePlan``'s fields, or, the one addition to SGLang's schema,
``{"fused": "per_row", "tiles": {"BLOCK_SIZE_N", "BLOCK_SIZE_K", "num_warps", "num_stages"},
"overlap": "none" | "ab_delta"}``),
and the first row whose selectors all match wins. The selectors: phase
(``decode``/``prefill``; TARGET_VERIFY runs as prefill), kind (``linear``; ``embedding`` and
``lm_head`` are served by the per-op tier), tokens of the call (``max_tokens``), the pool's rank
(``max_rank``, i.e. ``--max-lora-rank``), the shrink's input width K and the total output width N.

Where a call's plan comes from, first match wins:

1. the file named by ``SGLANG_XPU_LORA_PLANS`` (a table the user measured, e.g. with
   ``examples/xpu/measure.sh``), when set;
2. the table shipped for the device family (``configs/<family>.plans.json``: ``sm90`` for
   Hopper, tuned on an H200 by ``benchmarks/plan_sweep.py``);
3. SGLang's own table for the device (``DensePlanTable``: ``sm90``/``sm100`` on CUDA, ``default``
   elsewhere) and, past its rows, SGLang's defaults.

Tables are read and checked once, when the backend is built: a missing file or a bad row raises
there, naming the file and the row.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Union

import torch
from sglang.srt.lora.dense.plan import AFamily, BFamily, DenseLoraKind, DensePlan, DensePlanTable, Overlap
from sglang.srt.lora.utils import Phase, architecture_for_capability

from sglang_xpu_lora.dense.fused import FusedPlan
from sglang_xpu_lora.settings import PLANS_ENV

CONFIG_DIR = Path(__file__).parent / "configs"
_SELECTORS = {
    "name", "phase", "kinds", "max_tokens", "max_rank",
    "min_in_features", "max_in_features", "min_out_features", "max_out_features", "spec",
}
_INT_SELECTORS = ("max_tokens", "max_rank", "min_in_features", "max_in_features", "min_out_features", "max_out_features")


def device_family(device: torch.device) -> str:
    """The plan-table family of ``device``: ``sm<major><minor>`` for a CUDA GPU (``sm90`` on
    Hopper), the device type otherwise (``xpu``, ``cpu``)."""
    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"sm{major}{minor}"
    return device.type


def sglang_architecture(device: torch.device) -> str:
    """The name of SGLang's plan table for ``device``, as ``DenseLoraRunner`` picks it: by compute
    capability on CUDA (``architecture_for_capability``: ``sm90``, ``sm100``), ``default`` elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        return architecture_for_capability(torch.cuda.get_device_capability(device)[0])
    return "default"


def plan_from_spec(spec: dict) -> Union[DensePlan, FusedPlan]:
    """The plan of a row's ``spec`` (JSON values: family and overlap names): SGLang's ``DensePlan``,
    or, for a spec with a ``fused`` key, the project's :class:`~sglang_xpu_lora.dense.fused.FusedPlan`.

    Raises:
        ValueError: an unknown key or value, or a plan ``DensePlan`` or ``FusedPlan`` refuses (their
            own checks: tile powers of two, all-slots shrink only with the per-row expand, a fused
            plan's overlap ``none`` or ``ab_delta``, ...).
    """
    if "fused" in spec:
        if not isinstance(spec.get("tiles"), dict):
            raise ValueError("a fused spec needs 'tiles', an object")
        # The form before the keys: a row of the retired grouped form (with its block_size) is
        # refused naming the forms that remain.
        plan = FusedPlan(form=spec["fused"], overlap=Overlap(spec.get("overlap", "none")), tiles=dict(spec["tiles"]))
        unknown = set(spec) - {"fused", "tiles", "overlap"}
        if unknown:
            raise ValueError(f"a fused spec takes 'fused', 'tiles' and 'overlap', not {sorted(unknown)}")
        return plan
    unknown = set(spec) - {"a_family", "b_family", "overlap", "block_size", "a_tiles", "b_tiles"}
    if unknown:
        raise ValueError(f"unknown spec keys {sorted(unknown)}")
    fields = dict(spec)
    for key, enum in (("a_family", AFamily), ("b_family", BFamily), ("overlap", Overlap)):
        if key in fields:
            fields[key] = enum(fields[key])
    if "a_tiles" in fields:
        fields["a_tiles"] = dict(fields["a_tiles"])
    if "b_tiles" in fields:
        fields["b_tiles"] = dict(fields["b_tiles"])
    return DensePlan(**fields)


class PlanRow:
    """One row of a table: its selectors and its plan (see the module docstring)."""

    def __init__(self, raw: dict):
        if not isinstance(raw, dict) or "name" not in raw:
            raise ValueError("a row must be an object with a 'name'")
        self.name = raw["name"]
        unknown = set(raw) - _SELECTORS
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)}")
        self.phase = Phase(raw["phase"]) if raw.get("phase") is not None else None
        self.kinds = None if raw.get("kinds") is None else frozenset(DenseLoraKind(k) for k in raw["kinds"])
        for key in _INT_SELECTORS:
            value = raw.get(key)
            if value is not None and (type(value) is not int or value < 0):
                raise ValueError(f"{key} must be a non-negative integer, not {value!r}")
            setattr(self, key, value)
        self.plan = plan_from_spec(raw.get("spec", {}))

    def matches(self, kind: DenseLoraKind, phase: Phase, tokens: int, max_rank: int, in_features: int, out_features: int) -> bool:
        """Whether every selector of the row admits the call."""
        return (
            (self.phase is None or self.phase is phase)
            and (self.kinds is None or kind in self.kinds)
            and (self.max_tokens is None or tokens <= self.max_tokens)
            and (self.max_rank is None or max_rank <= self.max_rank)
            and (self.min_in_features is None or in_features >= self.min_in_features)
            and (self.max_in_features is None or in_features <= self.max_in_features)
            and (self.min_out_features is None or out_features >= self.min_out_features)
            and (self.max_out_features is None or out_features <= self.max_out_features)
        )


def read_rows(path: Path) -> list[PlanRow]:
    """The rows of the table file ``path``.

    Raises:
        ValueError: the file is missing, not JSON, not ``{"rows": [...]}``, or a row is bad (the
            message names the file and the row).
    """
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"dense LoRA plan table {path}: {exc}") from None
    if not isinstance(raw, dict) or set(raw) != {"rows"} or not isinstance(raw["rows"], list):
        raise ValueError(f'dense LoRA plan table {path}: expected {{"rows": [...]}} (SGLang\'s plans.json schema)')
    rows = []
    for index, row in enumerate(raw["rows"]):
        try:
            rows.append(PlanRow(row))
        except (ValueError, TypeError) as exc:
            name = row.get("name", f"#{index}") if isinstance(row, dict) else f"#{index}"
            raise ValueError(f"dense LoRA plan table {path}, row {name!r}: {exc}") from None
    return rows


class PlanTable:
    """The plans of one backend: its own rows (the ``SGLANG_XPU_LORA_PLANS`` file, then the shipped
    table of the device family), then SGLang's table for ``architecture`` (module docstring).

    Args:
        device: the serving device (picks the shipped table).
        architecture: SGLang's table name for the device (``DenseLoraRunner.architecture``).
        rows: the own rows, instead of reading them (tests, the plan sweep).

    Raises:
        ValueError: a bad or missing table file (:func:`read_rows`).
    """

    def __init__(self, device: torch.device, architecture: str, rows: Optional[list[PlanRow]] = None):
        self.architecture = architecture
        self.sources: list[str] = []
        if rows is None:
            rows = []
            user = os.environ.get(PLANS_ENV, "").strip()
            if user:
                rows += read_rows(Path(user))
                self.sources.append(f"{PLANS_ENV}={user}")
            shipped = CONFIG_DIR / f"{device_family(device)}.plans.json"
            if shipped.is_file():
                rows += read_rows(shipped)
                self.sources.append(f"{shipped.name} (shipped)")
        else:
            self.sources.append("given rows")
        self.sources.append(f"SGLang's {architecture}")
        self.rows = rows
        self._bounds = sorted({row.max_tokens for row in rows if row.max_tokens is not None})
        self._own: dict = {}  # (kind, phase, token bucket, rank, K, N) -> own plan or None
        self._sglang: dict = {}  # pool rank -> SGLang's DensePlanTable

    def plan_for(self, kind: DenseLoraKind, phase: Phase, tokens: int, max_rank: int, in_features: int, out_features: int) -> Union[DensePlan, FusedPlan]:
        """The plan of one call: ``tokens`` rows of input, pool rank ``max_rank``, shrink input
        width ``in_features`` (K), total output width ``out_features`` (N)."""
        # Within one bucket of the rows' token bounds every own row matches alike.
        bucket = next((bound for bound in self._bounds if tokens <= bound), 1 << 62)
        key = (kind, phase, bucket, max_rank, in_features, out_features)
        if key not in self._own:
            self._own[key] = next(
                (row.plan for row in self.rows if row.matches(kind, phase, tokens, max_rank, in_features, out_features)), None
            )
        plan = self._own[key]
        if plan is not None:
            return plan
        table = self._sglang.get(max_rank)
        if table is None:
            table = self._sglang[max_rank] = DensePlanTable(self.architecture, max_rank)
        return table.plan_for(kind, phase, tokens, in_features, out_features)
