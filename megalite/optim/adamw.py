"""AdamW over flat shards as a few foreach ops: torch.optim.AdamW's update (its multi-tensor
path: the single-tensor one's arithmetic, element for element), whatever the number of buckets.

The shards are cut into groups of at most `ADAM_GROUP` elements: each group is a handful of
kernel launches, and the one temporary (the denominator) stays bounded."""

import torch

from megalite.config import OptimizerConfig

# 256 MiB of fp32 state for the temporary of one group
ADAM_GROUP = 2**26


@torch.no_grad()
def adamw(weights, grads, exp_avg, exp_avg_sq, decayed, lr: float, step: int, o: OptimizerConfig):
    """One AdamW step (step counts from 1) of `weights` in place, with their gradients and
    moments (lists of 1-D tensors of the same sizes); `decayed`: the views of `weights` that
    weight decay applies to."""
    beta1, beta2 = o.adam_beta1, o.adam_beta2
    step_size = lr / (1 - beta1**step)
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    if o.weight_decay and decayed:
        torch._foreach_mul_(decayed, 1 - lr * o.weight_decay)
    for group in pieces([w.numel() for w in weights], ADAM_GROUP):
        w, g, m, v = ([t[i][lo:hi] for i, lo, hi in group]
                      for t in (weights, grads, exp_avg, exp_avg_sq))  # fmt: skip
        torch._foreach_lerp_(m, g, 1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, g, g, value=1 - beta2)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, o.adam_eps)
        torch._foreach_addcdiv_(w, m, denom, value=-step_size)
        del denom


def pieces(sizes: list[int], cap: int) -> list[list[tuple[int, int, int]]]:
    """Tensors of `sizes` cut into groups of pieces (tensor index, lo, hi), at most `cap`
    elements a group, in order."""
    out, group, held = [], [], 0
    for i, n in enumerate(sizes):
        lo = 0
        while lo < n:
            hi = min(n, lo + cap - held)
            group.append((i, lo, hi))
            held += hi - lo
            lo = hi
            if held == cap:
                out.append(group)
                group, held = [], 0
    return out + ([group] if group else [])
