"""LayerNorm over the last dimension, statistics in fp32."""

import torch
import torch.nn.functional as F


def layer_norm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    b = None if bias is None else bias.float()
    return F.layer_norm(x.float(), x.shape[-1:], weight.float(), b, eps).to(x.dtype)
