"""The stacked projections of SGLang's LoRA layers on one batch route: a shrink, then the expand of
its slices (``run_qkv_lora``, ``run_gate_up_lora``), also for prefix-partition layers whose LoRA
covers only their leading output columns (:func:`onto_leading_columns`).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from sglang_xpu_lora.backend.batch_routes import BatchRoute


def stacked_projection(
    route: BatchRoute, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, output_offset: torch.Tensor,
    max_out_dim: int, base_output: Optional[torch.Tensor], n_slices: int,
) -> torch.Tensor:
    """``n_slices`` bands (q/k/v, or 2 and 4 for MLA and GDN) on ``route``.

    x: (s, K); lora_a: (L, n_slices * R, K); lora_b: (L, sum of bands, R); output_offset:
    (n_slices + 1,) device int32 band boundaries; max_out_dim: widest band. Returns (s, sum of
    bands), or ``base_output`` (s, N_total) with the bands in its leading columns when it is wider.
    """
    lora_a_output = route.shrink(x, lora_a, n_slices)
    if base_output is not None and base_output.shape[-1] != lora_b.shape[-2]:
        return onto_leading_columns(
            base_output, route.expand_slices, lora_a_output, lora_b, output_offset, max_out_dim, n_slices
        )
    return route.expand_slices(lora_a_output, lora_b, output_offset, max_out_dim, n_slices, base_output)


def gate_up_projection(
    route: BatchRoute, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, base_output: Optional[torch.Tensor],
) -> torch.Tensor:
    """Fused gate/up with two equal bands on ``route``. x: (s, K); lora_a: (L, 2R, K); lora_b:
    (L, 2N, R) -> (s, 2N), or ``base_output`` with them in its leading columns when it is wider."""
    lora_a_output = route.shrink(x, lora_a, 2)
    lora_dim = lora_b.shape[-2]
    if base_output is not None and base_output.shape[-1] != lora_dim:
        return onto_leading_columns(base_output, route.expand_gate_up, lora_a_output, lora_b, lora_dim // 2)
    return route.expand_gate_up(lora_a_output, lora_b, lora_dim // 2, base_output)


def onto_leading_columns(
    base_output: torch.Tensor, expand: Callable[..., torch.Tensor], x: torch.Tensor, weights: torch.Tensor, *args
) -> torch.Tensor:
    """``expand(x, weights, *args, base)`` for a layer whose LoRA covers only its first output
    partitions.

    SGLang's prefix-partition layers (``MergedColumnParallelLinearWithLoRA`` with fewer LoRA slices
    than base partitions: Mamba2 ``in_proj``, LFM2 ``in_proj``) pass ``base_output`` of shape
    ``(s, N_total)`` while LoRA-B (``weights``, ``(L, lora_dim, R)``) spans only the first
    ``lora_dim`` columns. SGLang's Triton kernels (``qkv_lora_b_fwd``, ``gate_up_lora_b_fwd``) serve
    them by writing through ``base_output``'s strides: the LoRA delta lands in columns
    ``[0, lora_dim)`` in place, the other columns pass through, and ``base_output`` is returned.
    This does the same around every provider's ops, whose results are ``(s, lora_dim)`` (new tensors
    from the native ops, the base handed to them from the Triton and portable ones): the leading
    columns are handed to the op as a contiguous ``(s, lora_dim)`` base and its result is copied
    back into them. Called only when ``base_output`` is wider than LoRA-B. Shapes only, no host sync, capture-safe.
    """
    leading = base_output[:, : weights.shape[-2]]
    leading.copy_(expand(x, weights, *args, leading.contiguous()))
    return base_output
