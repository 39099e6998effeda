"""Stand-in package for benchmarks on a GPU machine without SGLang (see benchmarks/triton_peers.py)."""
