"""The global gradient norm over every rank, each logical element counted once, and clipping."""

import torch

from megalite.parallel import comm
from megalite.parallel.comm import Group


def global_norm(counted: list[torch.Tensor], checked: list[torch.Tensor], group: Group):
    """(norm, found_inf): the 2-norm of the `counted` gradient pieces summed over `group`, and
    whether any piece, `counted` or only `checked`, on any rank of the group is inf or nan.

    One all-reduce carries both, so every rank takes the same skip decision.
    """
    dtype = torch.float64
    device = group.device or next((g.device for g in [*counted, *checked]), None)
    sumsq = torch.zeros((), dtype=dtype, device=device)
    for g in counted:
        sumsq += torch.linalg.vector_norm(g).to(dtype) ** 2
    # A sum is non-finite iff some element is (finite fp32 gradients cannot overflow fp64).
    total = sum((g.sum(dtype=dtype) for g in checked), torch.zeros((), dtype=dtype, device=device))
    stats = torch.stack([sumsq, (~torch.isfinite(total)).to(dtype)])
    comm.all_reduce(stats, group)
    found_inf = bool(stats[1] > 0) or not bool(torch.isfinite(stats[0]))
    return float(stats[0].sqrt()), found_inf


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor torch.nn.utils.clip_grad_norm_ applies (1.0 when not clipping)."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))
