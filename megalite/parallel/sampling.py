"""Sampling the next token from vocabulary-parallel logits (each TP rank holds a slice of the
vocabulary), without gathering anything of vocabulary size.

Sampling follows transformers' order: temperature, top-k, then top-p over the renormalised
top-k. Across vocabulary shards nothing of vocabulary size is gathered: greedy gathers each
shard's best (value, index), top-k each shard's k best values, top-p finds the nucleus
threshold by a search over the float's bits (six all-reduces of (b, 4095) masses), and the
token is drawn by inverse CDF: one uniform per row from the caller's generator, located in
vocabulary order across the shards. Every TP rank draws the same uniforms and ends with the same
all-reduced token, and the result does not depend on the layout (up to float rounding).
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite.errors import MegaliteError
from megalite.parallel import comm
from megalite.parallel.comm import Group


@dataclass(frozen=True)
class Sampling:
    """temperature 0: greedy (the likeliest token); else sample from softmax(logits / T),
    restricted to the top_k likeliest (0: all) and then to the top_p nucleus (1.0: all)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def check(self):
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise MegaliteError(
                f"bad sampling temperature={self.temperature} top_k={self.top_k} "
                f"top_p={self.top_p}; use temperature >= 0, top_k >= 0, 0 < top_p <= 1"
            )


GREEDY = Sampling()
# The nucleus search splits its bracket 4096 ways per round: 6 rounds narrow the 62 bits of the
# doubles in [0, 1] to one value (widths 2^62 -> 2^50 -> 2^38 -> 2^26 -> 2^14 -> 5 -> 1).
_PROBES, _ROUNDS = 4095, 6
_ONE = torch.tensor(1.0, dtype=torch.float64).view(torch.int64).item()


def gathered(t: torch.Tensor, tp: Group) -> torch.Tensor:
    """(tp, *t.shape): every TP rank's t, in rank (= vocabulary) order."""
    if tp.size == 1:
        return t[None]
    out = t.new_empty((tp.size * t.shape[0], *t.shape[1:]))
    comm.all_gather(out, t, tp)
    return out.view(tp.size, *t.shape)


def _argmax(logits, start, tp) -> torch.Tensor:
    """The first index of the largest logit over all shards, as torch.argmax on the whole."""
    v, i = logits.max(-1)  # (b,) each; max returns the first maximal index
    best = gathered(torch.stack([v.double(), (i + start).double()], -1), tp)  # (tp, b, 2)
    top = best[..., 0].max(0).values  # (b,)
    idx = torch.where(best[..., 0] == top, best[..., 1], float("inf")).min(0).values
    return idx.long()


def _kth_largest(logits, k, tp) -> torch.Tensor:
    """(b, 1): the k-th largest logit over all shards (each contributes its k best)."""
    local = logits.topk(min(k, logits.shape[-1]), dim=-1).values  # (b, k')
    cand = gathered(local, tp).permute(1, 0, 2).flatten(1)  # (b, tp*k')
    return cand.topk(min(k, cand.shape[-1]), dim=-1).values[:, -1:]


def _softmax(logits, tp) -> torch.Tensor:
    """Probabilities (fp64) of this shard under the softmax over every shard."""
    m = logits.max(-1, keepdim=True).values
    comm.all_reduce(m, tp, op=dist.ReduceOp.MAX)
    e = (logits.double() - m.double()).exp()
    z = e.sum(-1, keepdim=True)
    comm.all_reduce(z, tp)
    return e / z


def _nucleus_floor(probs, top_p, tp) -> torch.Tensor:
    """(b, 1) q*: the smallest probability in the top-p nucleus. A token is kept when the mass
    of the likelier tokens is below top_p; equivalently q* is the largest q whose mass at or
    above it, M(q), reaches top_p. M falls as q rises and only changes at token values, so
    searching the int64 bits of non-negative doubles (ordered as the values) finds q* exactly:
    each round all-reduces M at 4095 probes and keeps the bracket [lo: M >= p, hi: M < p)."""
    asc = probs.sort(-1).values  # (b, V/t)
    above = torch.cat([asc.flip(-1).cumsum(-1).flip(-1), asc.new_zeros(asc.shape[0], 1)], -1)
    b = probs.shape[0]
    lo = torch.zeros(b, dtype=torch.int64, device=probs.device)
    hi = torch.full_like(lo, _ONE + 1)  # nothing is above 1
    j = torch.arange(1, _PROBES + 1, device=probs.device)
    for _ in range(_ROUNDS):
        width = (hi - lo + _PROBES) // (_PROBES + 1)
        probes = torch.minimum(lo[:, None] + j * width[:, None], hi[:, None] - 1)  # (b, P)
        mass = above.gather(1, torch.searchsorted(asc, probes.view(torch.float64)))
        comm.all_reduce(mass, tp)
        n = (mass >= top_p).sum(-1, keepdim=True)  # probes reaching p: a prefix
        lo = torch.where(n > 0, probes.gather(1, (n - 1).clamp(min=0)), lo[:, None])[:, 0]
        hi = torch.where(n < _PROBES, probes.gather(1, n.clamp(max=_PROBES - 1)), hi[:, None])
        hi = hi[:, 0]
    return lo.view(torch.float64)[:, None]


def _draw(probs, u, start, tp) -> torch.Tensor:
    """The token at cumulative mass u * total in vocabulary order, across shards (inverse CDF)."""
    cum = probs.cumsum(-1)  # (b, V/t)
    mass = gathered(cum[:, -1].contiguous(), tp)  # (tp, b)
    ends = mass.cumsum(0)
    target = u * ends[-1]  # (b,)
    # the shard holding the target: the first whose end passes it (never one without mass)
    last = tp.size - 1 - (mass > 0).flip(0).long().argmax(0)
    r = torch.minimum((ends <= target).sum(0), last)  # (b,)
    t = target - (ends - mass).gather(0, r[None])[0]
    i = torch.searchsorted(cum, t[:, None], right=True)
    last_kept = torch.searchsorted(cum, cum[:, -1:].contiguous())  # where the mass stops growing
    i = torch.minimum(i, last_kept)[:, 0]
    token = torch.where(r == tp.rank, i + start, -1)
    comm.all_reduce(token, tp, op=dist.ReduceOp.MAX)
    return token


def sample(logits, tp: Group, vocab_size: int, sampling: Sampling, generator) -> torch.Tensor:
    """Token ids (b,) from this rank's vocabulary slice of the logits (b, V_padded/t); the same
    ids on every TP rank. Consumes b uniforms of `generator` unless greedy."""
    start = tp.rank * logits.shape[-1]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if start + logits.shape[-1] > vocab_size:  # padding rows of the vocabulary are never drawn
        real = torch.arange(start, start + logits.shape[-1], device=logits.device) < vocab_size
        logits = logits.masked_fill(~real, float("-inf"))
    if sampling.greedy:
        return _argmax(logits, start, tp)
    logits = logits / sampling.temperature
    if sampling.top_k > 0:
        logits = logits.masked_fill(logits < _kth_largest(logits, sampling.top_k, tp), -torch.inf)
    probs = _softmax(logits, tp)
    if sampling.top_p < 1.0:
        probs = probs.masked_fill(probs < _nucleus_floor(probs, sampling.top_p, tp), 0.0)
    u = torch.rand(logits.shape[0], generator=generator, dtype=torch.float64)
    return _draw(probs, u.to(logits.device), start, tp)


def logprobs(logits, tp: Group, vocab_size: int, targets, k: int):
    """Log-probabilities under softmax(logits) over every shard, on every TP rank: of `targets`
    (...,) ids, and the k likeliest tokens (..., k) as (values, ids), likeliest first. `logits`
    (..., V_padded/t) is this rank's slice; only (..., k) candidates per rank are gathered."""
    n = logits.shape[-1]
    start = tp.rank * n
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if start + n > vocab_size:  # padding rows of the vocabulary have no probability
        real = torch.arange(start, start + n, device=logits.device) < vocab_size
        logits = logits.masked_fill(~real, float("-inf"))
    m = logits.max(-1, keepdim=True).values
    comm.all_reduce(m, tp, op=dist.ReduceOp.MAX)
    z = (logits - m).exp().sum(-1, keepdim=True)
    comm.all_reduce(z, tp)
    lse = (m + z.log())[..., 0]
    mine = (targets >= start) & (targets < start + n)
    local = (targets - start).clamp(0, n - 1)[..., None]
    chosen = torch.where(mine, logits.gather(-1, local)[..., 0], 0.0)
    comm.all_reduce(chosen, tp)
    k = min(k, vocab_size)
    if k == 0:
        return chosen - lse, logits.new_empty((*lse.shape, 0)), targets.new_empty((*lse.shape, 0))
    v, i = logits.topk(min(k, n), dim=-1)
    v, i = gathered(v.contiguous(), tp), gathered((i + start).contiguous(), tp)  # (tp, ..., k')
    v, i = torch.movedim(v, 0, -2).flatten(-2), torch.movedim(i, 0, -2).flatten(-2)
    top, at = v.topk(k, dim=-1)  # ties: the lower shard first (stable over the gathered order)
    return chosen - lse, top - lse[..., None], i.gather(-1, at)
