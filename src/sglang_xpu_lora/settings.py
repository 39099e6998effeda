"""The environment variables sglang-xpu-lora reads, by name, and how a choice among values is read
(:func:`env_choice`); no torch, no SGLang: the entry points and ``doctor`` name them before
anything heavy is imported.

* :data:`KERNELS_ENV`: which provider runs the LoRA ops (:mod:`sglang_xpu_lora.providers.selection`).
* :data:`GRAPH_NATIVE_ENV`: whether native ops run inside graphs: ``probe`` (default, decided by a
  trial capture at graph set-up), ``never`` or ``always`` (:mod:`sglang_xpu_lora.providers.capture_probe`).
* :data:`EAGER_DENSE_MIN_TOKENS_ENV`: from how many tokens an eager batch runs its linears on the
  dense tier (:mod:`sglang_xpu_lora.backend.xpu`; default 2048, 1: every batch).
* :data:`PLANS_ENV`: a dense-tier plan table file read before the shipped ones
  (:mod:`sglang_xpu_lora.dense.plans`).
* :data:`ADAPTER_CHECKS_ENV`: which backends' adapters are checked at load
  (:mod:`sglang_xpu_lora.adapters.checked_backends`).
* :data:`STARTUP_REPORT_ENV`, :data:`STARTUP_LAUNCHER_ENV`: set by the plugin itself, not by
  users: the file SGLang's scheduler processes report a start-up failure to, and the pid of the
  process that launched them (:mod:`sglang_xpu_lora.patches.startup_failure`).
"""

from __future__ import annotations

import os

KERNELS_ENV = "SGLANG_XPU_LORA_KERNELS"
GRAPH_NATIVE_ENV = "SGLANG_XPU_LORA_GRAPH_NATIVE"
ADAPTER_CHECKS_ENV = "SGLANG_XPU_LORA_ADAPTER_CHECKS"
PLANS_ENV = "SGLANG_XPU_LORA_PLANS"
EAGER_DENSE_MIN_TOKENS_ENV = "SGLANG_XPU_LORA_EAGER_DENSE_MIN_TOKENS"
STARTUP_REPORT_ENV = "SGLANG_XPU_LORA_STARTUP_REPORT"
STARTUP_LAUNCHER_ENV = "SGLANG_XPU_LORA_STARTUP_LAUNCHER"


def env_choice(name: str, choices: tuple[str, ...], advice: str = "") -> str:
    """The value of the environment variable ``name``, one of ``choices``: stripped and
    lower-cased, the first choice (the default) when unset or empty.

    Raises:
        ValueError: for any other value, naming the variable, the value as set and the accepted
            values, then ``advice`` (what to do instead) when given.
    """
    raw = os.environ.get(name)
    value = (raw or "").strip().lower() or choices[0]
    if value not in choices:
        raise ValueError(f"{name}={raw!r} is not one of {', '.join(choices)}" + (f"; {advice}" if advice else ""))
    return value


def env_count(name: str, default: int) -> int:
    """The environment variable ``name`` as a positive integer, ``default`` when unset or empty.

    Raises:
        ValueError: for anything but a positive integer, naming the variable and the value as set.
    """
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name}={raw!r} is not a positive integer; unset it for the default ({default})")
    return value
