"""AdamW over flat shards through torch's fused kernel (`torch._fused_adamw_`, what
`torch.optim.AdamW(fused=True)` calls, on CPU and CUDA): one pass over each shard's weights,
gradients and moments per step, where the multi-tensor path makes seven and keeps a temporary
the size of the state. The weight-decayed and the other pieces of the shards are two calls."""

import torch

from megalite.config import OptimizerConfig
from megalite.lr_schedule import Rates


@torch.no_grad()
def adamw(weights, grads, exp_avg, exp_avg_sq, decay, rates: Rates | float, step: int,
          o: OptimizerConfig, embedding=None):  # fmt: skip
    """One AdamW step (step counts from 1) of `weights` in place, with their gradients and
    moments (lists of 1-D tensors of the same sizes); `decay[i]`: the (lo, hi) pieces of
    `weights[i]` that weight decay applies to, `embedding[i]` (optional) those of the embedding
    and output layer, which take `rates.embedding_lr` (sorted, not overlapping). `rates`: the
    step's learning rates and weight decay (a float: that lr with --weight-decay)."""
    if not weights:
        return
    if not isinstance(rates, Rates):
        rates = Rates(rates, o.weight_decay, rates)
    # (decayed?, embedding?) -> w, g, m, v pieces: one fused call each
    parts = {}
    for i, w in enumerate(weights):
        decayed = decay[i] if rates.weight_decay else []
        for lo, hi, d, e in _label(w.numel(), decayed, embedding[i] if embedding else []):
            out = parts.setdefault((d, e), ([], [], [], []))
            for t, x in zip(out, (w, grads[i], exp_avg[i], exp_avg_sq[i])):
                t.append(x[lo:hi])
    step_t = torch.full((), float(step), dtype=torch.float32, device=weights[0].device)
    for (decayed, emb), (w, g, m, v) in parts.items():
        torch._fused_adamw_(
            w, g, m, v, [], [step_t] * len(w), lr=rates.embedding_lr if emb else rates.lr,
            beta1=o.adam_beta1, beta2=o.adam_beta2,
            weight_decay=rates.weight_decay if decayed else 0.0,
            eps=o.adam_eps, amsgrad=False, maximize=False,
        )  # fmt: skip


def _label(n: int, a: list, b: list) -> list[tuple[int, int, bool, bool]]:
    """[0, n) cut into pieces (lo, hi, in a, in b) for the sorted, disjoint segments a and b."""
    if not b:  # (the common case: no --decoupled-lr)
        return [(lo, hi, True, False) for lo, hi in a] + [
            (lo, hi, False, False) for lo, hi in complement(a, n)]  # fmt: skip
    cuts = sorted({0, n, *(x for s in a + b for x in s)})
    out, ia, ib = [], 0, 0
    for lo, hi in zip(cuts, cuts[1:]):
        while ia < len(a) and a[ia][1] <= lo:
            ia += 1
        while ib < len(b) and b[ib][1] <= lo:
            ib += 1
        label = (ia < len(a) and a[ia][0] <= lo, ib < len(b) and b[ib][0] <= lo)
        if out and out[-1][2:] == label:
            out[-1] = (out[-1][0], hi, *label)
        else:
            out.append((lo, hi, *label))
    return out


def complement(segments: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """The pieces of [0, n) outside the sorted, disjoint `segments`."""
    out, at = [], 0
    for lo, hi in segments:
        if lo > at:
            out.append((at, lo))
        at = hi
    return out + ([(at, n)] if at < n else [])
