"""Stub submodule `sgl_kernel.kvcacheio` (CPU development only); see `sgl_kernel.__init__`."""

from sgl_kernel import __getattr__  # noqa: F401  (resolves *_cpu names only)
