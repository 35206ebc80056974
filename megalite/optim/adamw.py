"""AdamW over flat shards through torch's fused kernel (`torch._fused_adamw_`, what
`torch.optim.AdamW(fused=True)` calls, on CPU and CUDA): one pass over each shard's weights,
gradients and moments per step, where the multi-tensor path makes seven and keeps a temporary
the size of the state. The weight-decayed and the other pieces of the shards are two calls."""

import torch

from megalite.config import OptimizerConfig


@torch.no_grad()
def adamw(weights, grads, exp_avg, exp_avg_sq, decay, lr: float, step: int, o: OptimizerConfig):
    """One AdamW step (step counts from 1) of `weights` in place, with their gradients and
    moments (lists of 1-D tensors of the same sizes); `decay[i]`: the (lo, hi) pieces of
    `weights[i]` that weight decay applies to (sorted, not overlapping)."""
    if not weights:
        return
    parts = {True: ([], [], [], []), False: ([], [], [], [])}  # decayed?: w, g, m, v pieces
    for i, w in enumerate(weights):
        decayed = decay[i] if o.weight_decay else []
        pieces = [(s, True) for s in decayed] + [(s, False) for s in complement(decayed, w.numel())]
        for (lo, hi), d in pieces:
            for out, t in zip(parts[d], (w, grads[i], exp_avg[i], exp_avg_sq[i])):
                out.append(t[lo:hi])
    step_t = torch.full((), float(step), dtype=torch.float32, device=weights[0].device)
    for decayed, (w, g, m, v) in parts.items():
        if w:
            torch._fused_adamw_(
                w, g, m, v, [], [step_t] * len(w), lr=lr, beta1=o.adam_beta1,
                beta2=o.adam_beta2, weight_decay=o.weight_decay if decayed else 0.0,
                eps=o.adam_eps, amsgrad=False, maximize=False,
            )  # fmt: skip


def complement(segments: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """The pieces of [0, n) outside the sorted, disjoint `segments`."""
    out, at = [], 0
    for lo, hi in segments:
        if lo > at:
            out.append((at, lo))
        at = hi
    return out + ([(at, n)] if at < n else [])
