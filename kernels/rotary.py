"""Rotary position embedding, rotate-half convention (as Hugging Face Llama stores q/k)."""

import torch


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (b, s, heads, d); cos, sin: (s, d/2). Rotates pairs (i, i + d/2)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[None, :, None, :].float(), sin[None, :, None, :].float()
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
