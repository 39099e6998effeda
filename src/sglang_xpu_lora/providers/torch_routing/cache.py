"""The portable ops' routing of one batch, computed once rather than once per op (:class:`RoutingCache`).

SGLang's LoRA layers call the ops with the same index tensors (``seg_indptr``, ``weight_indices``,
``permutation``) in every layer of a forward pass. A :class:`RoutingCache` belongs to one batch: the
backend makes a new one with each batch's bound ops
(:func:`sglang_xpu_lora.providers.batch_binding.bind_table`), which hand it to the portable ops with
each call (their keyword ``routing``), so each distinct routing of the batch is built once. It
holds routing only (derived from index tensors), never weights, keyed by the identity of the index
tensors it was built from. Nothing here is process state: two backends in one process (target and
draft under speculative decoding) each have their own batches' caches, and a caller that passes
none gets routing computed for its call alone.
"""

from __future__ import annotations

from typing import Callable, Optional, TypeVar

import torch

from sglang_xpu_lora.providers.graph_capture import capturing

Routes = TypeVar("Routes")

#: Distinct routings one cache keeps at most (a batch has a handful: per batch info, row count and
#: routing kind); past it the cache starts over, so a misuse cannot grow it without bound.
MAX_CACHED_ROUTES = 64


def _identity(tensor: Optional[torch.Tensor]):
    """Identity of an index tensor for the cache: the object, or for a view its base and window
    (the backend passes a fresh ``permutation[:T]`` view in every layer)."""
    if tensor is None:
        return None
    if tensor._base is not None:
        return (id(tensor._base), tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))
    return id(tensor)


class RoutingCache:
    """The routing computed for one batch, reused by every layer of it.

    Make one per batch, after the batch's index tensors are filled (a refill in place is a new
    batch: make a new cache). Routing computed while a CUDA/XPU graph is being captured is kept
    apart from eager routing of the same tensors, so a captured graph computes its own, which it
    recomputes on every replay, rather than reading values a warm-up run left behind.
    """

    def __init__(self):
        self._routes: dict = {}  # key -> (routes, index tensors kept alive so their ids stay valid)

    def cached(self, kind: str, index_tensors: tuple, shape_key: tuple, build: Callable[[], Routes]) -> Routes:
        """``build()``, computed once per key in this batch.

        ``kind``: which routing (``"host"``, ``"device"``); ``index_tensors``: the tensors (or None)
        the routing reads, first one on the routing's device; ``shape_key``: the host values it
        depends on (row count, slot count...).
        """
        key = (kind, *(_identity(t) for t in index_tensors), *shape_key, capturing(index_tensors[0].device))
        entry = self._routes.get(key)
        if entry is None:
            if len(self._routes) >= MAX_CACHED_ROUTES:
                self._routes.clear()
            entry = self._routes[key] = (build(), index_tensors)
        return entry[0]
