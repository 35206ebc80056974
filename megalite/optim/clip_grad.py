"""The global gradient norm over every rank, each logical element counted once, and clipping.

What the host must know after backward (the norm for clipping, whether any gradient is inf or
nan, and whatever the caller adds, such as a preemption signal) travels in one small float64
status tensor: one all-reduce over the world, then one host read per step.
"""

import torch

from megalite.parallel import comm
from megalite.parallel.comm import Group


def step_status(counted: list[torch.Tensor], checked: list[torch.Tensor], group: Group,
                flags=()) -> list[float]:  # fmt: skip
    """[sum of squares of the `counted` gradient pieces, how many ranks hold a non-finite
    piece (`counted` or only `checked`), *flags (floats or 0-d tensors)], each summed over
    `group`: one all-reduce and the step's one read of the device. Every rank gets the same values."""
    dtype = torch.float64
    device = group.device or next((g.device for g in [*counted, *checked]), None)
    sumsq = torch.zeros((), dtype=dtype, device=device)
    for g in counted:
        sumsq += torch.linalg.vector_norm(g).to(dtype) ** 2
    # A sum is non-finite iff some element is (finite fp32 gradients cannot overflow fp64).
    total = sum((g.sum(dtype=dtype) for g in checked), torch.zeros((), dtype=dtype, device=device))
    nonfinite = (~torch.isfinite(total) | ~torch.isfinite(sumsq)).to(dtype)
    # flags: host floats, or 0-d device tensors (the trainer's loss) joining the same reduction.
    # The host floats travel in one pinned, non-blocking copy: a tensor made on the device from
    # a host value (torch.as_tensor(f, device=...)) would wait for the device's queue each time.
    host = [float(f) for f in flags if not isinstance(f, torch.Tensor)]
    values = iter(_to_device(torch.tensor(host, dtype=dtype), device).unbind() if host else ())
    extra = [
        f.to(dtype).reshape(()) if isinstance(f, torch.Tensor) else next(values) for f in flags
    ]
    status = torch.stack([sumsq, nonfinite, *extra])
    comm.all_reduce(status, group)
    return status.tolist()


def _to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on `device` without waiting for it (pinned memory on CUDA)."""
    if device is not None and torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device) if device is not None else t


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor torch.nn.utils.clip_grad_norm_ applies (1.0 when not clipping)."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))
