"""Causal self-attention with grouped-query heads."""

import torch
import torch.nn.functional as F


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """q (b, hq, s, d), k and v (b, hkv, s, d) with hq a multiple of hkv -> (b, hq, s, d)."""
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
