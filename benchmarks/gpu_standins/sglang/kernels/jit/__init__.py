"""Stand-in for ``sglang.kernels.jit``: only the package, for :mod:`.utils`."""
