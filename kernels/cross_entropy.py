"""Cross entropy of logits against labels, one fp32 loss per token."""

import torch
import torch.nn.functional as F


def cross_entropy_ref(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """logits (..., V), labels (...) -> per-token loss (...) in fp32 (0 where ignored)."""
    flat = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=ignore_index, reduction="none")
    return flat.view(labels.shape)
