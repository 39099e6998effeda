"""How the portable ops (:mod:`sglang_xpu_lora.providers.torch_ops`) find each row's pool slot and
run the GEMMs: :mod:`.device` (sync-free, graph-capturable), :mod:`.host` (grouped GEMMs over runs
read on the host, for CPU tensors) and :mod:`.cache` (each batch's routing computed once)."""
