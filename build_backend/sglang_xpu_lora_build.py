"""The build backend: setuptools' own (``setuptools.build_meta``), after one check of its version.

``pyproject.toml`` declares the licence the PEP 639 way (an SPDX ``license`` string and
``license-files``), which setuptools reads from 77.0 on; the older table form is deprecated there.
Built without build isolation, as distributions build, an older setuptools (Debian 12 ships 66.1,
Ubuntu 24.04 68.1) would reject the file with a 90-line schema dump that never names the version
it needs. This module stops first, with one line that does, and otherwise is
``setuptools.build_meta`` itself: every hook is setuptools' own.

Raises:
    SystemExit: on import, with setuptools older than 77.0 (the message is the one line; the
        build frontend reports the hook that stopped).
"""

import re

import setuptools

REQUIRED_SETUPTOOLS = (77, 0)


def _release(version: str) -> tuple[int, ...]:
    """The leading numeric release of ``version`` ("66.1.1" -> (66, 1, 1); "80.0.0.post1" -> (80, 0, 0))."""
    return tuple(int(part) for part in re.findall(r"\d+", re.match(r"[\d.]*", version).group()))


if _release(setuptools.__version__) < REQUIRED_SETUPTOOLS:
    raise SystemExit(
        f"sglang-xpu-lora needs setuptools>=77 to build (pyproject.toml has a PEP 639 SPDX license), "
        f"this environment has setuptools {setuptools.__version__}: upgrade it, or build with build isolation"
    )

from setuptools.build_meta import *  # noqa: E402,F401,F403 (the hooks, unchanged)
