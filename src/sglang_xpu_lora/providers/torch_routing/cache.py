"""The per-batch routing cache: each batch's routing computed once, not once per op.

SGLang's LoRA layers call the ops with the same index tensors (``seg_indptr``, ``weight_indices``,
``permutation``) in every layer of a forward pass. Between two :func:`begin_batch` calls each
distinct routing is built once and reused. This is the one piece of process state of the portable
ops; it holds routing only (derived from index tensors), never weights, and is keyed by the
identity of the index tensors it was built from.
"""

from __future__ import annotations

from typing import Callable, Optional, TypeVar

import torch

Routes = TypeVar("Routes")

_batch_routes: Optional[dict] = None  #: routing of the current batch; None until begin_batch()
_MAX_CACHED_ROUTES = 64


def begin_batch() -> None:
    """Start a new batch: forget the routing cached for the previous one.

    ``IntelXpuLoRABackend`` calls it whenever it prepares a batch, before the index tensors are
    refilled; routing computed while a CUDA/XPU graph is being captured is kept apart from eager
    routing, so a captured graph recomputes it on every replay. Before the first call (direct use
    of the ops) every op computes its own routing.
    """
    global _batch_routes
    _batch_routes = {}


def capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device``'s backend (``torch.cuda``, ``torch.xpu``...) is
    capturing a graph; False for devices without graphs."""
    backend = getattr(torch, device.type, None)
    is_capturing = getattr(backend, "is_current_stream_capturing", None)
    return bool(is_capturing()) if is_capturing is not None else False


def _identity(tensor: Optional[torch.Tensor]):
    """Identity of an index tensor for the cache: the object, or for a view its base and window
    (the backend passes a fresh ``permutation[:T]`` view in every layer)."""
    if tensor is None:
        return None
    if tensor._base is not None:
        return (id(tensor._base), tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))
    return id(tensor)


def cached(kind: str, index_tensors: tuple, shape_key: tuple, build: Callable[[], Routes]) -> Routes:
    """``build()``, through the batch cache when it is on (see :func:`begin_batch`).

    ``index_tensors``: the tensors (or None) the routing reads, first one on the routing's device;
    ``shape_key``: the host values it depends on (row count, slot count...). The tensors are kept
    alive with the entry, so their ids stay valid while it is cached.
    """
    if _batch_routes is None:
        return build()
    key = (kind, *(_identity(t) for t in index_tensors), *shape_key, capturing(index_tensors[0].device))
    entry = _batch_routes.get(key)
    if entry is None:
        if len(_batch_routes) >= _MAX_CACHED_ROUTES:
            _batch_routes.clear()
        entry = _batch_routes[key] = (build(), index_tensors)
    return entry[0]
