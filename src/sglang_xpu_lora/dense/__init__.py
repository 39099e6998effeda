"""The dense tier: SGLang 0.5.23's ``triton_v2`` LoRA kernels behind ``forward_with_base``, on any
device with Triton (:mod:`.runner`), with plans from tables per device family (:mod:`.plans`,
``configs/``), the expand's slice geometry built on the layer's device (:mod:`.geometry`) and
scratch, routes and base-GEMM overlap on any device (:mod:`.workspace`)."""
