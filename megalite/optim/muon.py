"""Muon (Keller Jordan's MomentUm Orthogonalized by Newton-Schulz; Moonlight's update-RMS
scaling): the matrix parameters take their momentum orthogonalised, the rest AdamW.

Which parameters are matrices (`muon_parts`): every hidden 2-D weight (attention q, k, v and
output projections, the MLP's gate, up and down) and each expert of a (E, out, in) expert
weight. AdamW keeps what is not a linear map of the hidden state, as Moonlight and Megatron do:
the embeddings and the output layer (their rows are per-token lookups, vocabulary-sized), norms
and biases (vectors), and the router (a small classifier whose rows are independent logits).
q, k and v are parameters of their own in megalite, so they are orthogonalised separately, as
Megatron's Muon splits its fused qkv; an expert's fused gate_up is cut into gate and up rows
for the same reason (the dense MLP holds them apart).

The update of a matrix W (m, n) with gradient G at step t:

  M = beta M + (1 - beta) G                (the momentum, as torch.optim.Muon: lerp)
  U = G + beta (M - G)  (Nesterov)  or  M
  O = NS5(U)                               (5 quintic Newton-Schulz steps, fp32 at least)
  W = W (1 - lr wd) - lr s O,  s = 0.2 sqrt(max(m, n)) ("rms": the update's RMS near AdamW's,
                                   Moonlight), or sqrt(max(1, m/n)) ("shape": Keller Jordan)

Sharded, every layout computes the single-process update (DistributedOptimizer):
the momentum lives with the AdamW moments in the ZeRO shards (it is elementwise). Each matrix
(an expert: each expert) has one owner among the ranks holding a part of it, over the bucket's
group and tp, chosen from the layout alone (muon_owners.py); bucket by bucket (one bucket's
update is alive at a time) the Nesterov update of each rank's pieces goes to the owner, which
orthogonalises the whole matrix once and sends every holder its piece of the result. The
AdamW second moment exists only for the AdamW elements.
"""

import math

import torch

from megalite.config import OptimizerConfig
from megalite.lr_schedule import Rates
from megalite.optim.adamw import adamw
from megalite.optim.muon_owners import (
    Owners,
    bounds,
    cut,
    extent,
    gather_sizes,
    matrices,
    moves,
    scatter_sizes,
    tp_sizes,
)
from megalite.parallel import comm
from megalite.parallel.specs import ParamSpec, spec_of

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the quintic's, maximising the slope at zero
NS_EPS = 1e-7


def muon_parts(name: str, spec: ParamSpec) -> int:
    """How many matrices of equal rows each matrix of this parameter holds (an expert's
    gate_up: 2), 0 where AdamW updates it (see the module docstring)."""
    dims = len(spec.shape)
    if dims < 2 or spec.vocab_dim is not None or spec.tied_to or "router" in name:
        return 0
    if name.split(".")[0] in ("embedding", "output"):  # a position table, any head
        return 0
    if spec.expert:  # (E, out, in): E matrices; an expert bias (E, out) is E vectors
        return (2 if name.endswith("gate_up.weight") else 1) if dims == 3 else 0
    return 1 if dims == 2 else 0


def newton_schulz(x: torch.Tensor, steps: int) -> torch.Tensor:
    """The quintic Newton-Schulz iteration on each matrix of x (..., m, n): an approximate
    U V^T of its SVD, in fp32 at least (fp64 stays fp64)."""
    a, b, c = NS_COEFFICIENTS
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    tall = x.size(-2) > x.size(-1)
    if tall:  # iterate on the smaller Gram matrix
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)  # spectral norm <= 1
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def scale(rows: int, cols: int, mode: str) -> float:
    """The factor of the orthogonalised update of one (rows, cols) matrix."""
    if mode == "rms":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


def orthogonalise(u: torch.Tensor, parts: int, o: OptimizerConfig) -> tuple[torch.Tensor, float]:
    """(NS of each matrix of u (..., rows, cols), cut into `parts` row blocks; their scale)."""
    *lead, rows, cols = u.shape
    x = u.reshape(*lead, parts, rows // parts, cols)
    out = newton_schulz(x, o.muon_ns_steps).reshape(u.shape)
    return out, scale(rows // parts, cols, o.muon_scale)


def muon_on(o: OptimizerConfig) -> bool:
    """Whether the run updates its matrices with Muon (the one place that reads the flag)."""
    return o.optimizer == "muon"


def muon_state(o: OptimizerConfig, buffer, tp, dtype: torch.dtype, decay) -> "MuonState | None":
    """Muon's state over `buffer` under --optimizer muon, None under AdamW."""
    return MuonState(buffer, tp, o, dtype, decay) if muon_on(o) else None


class MuonState:
    """Muon's state and step over a gradient buffer's shards: the momentum of the matrices and
    the AdamW first moment share the flat `exp_avg` shards, the AdamW second moment
    `exp_avg_sq` is compact (only AdamW elements). `decay(range)`: weight decay applies.
    Each matrix is orthogonalised by one owner (muon_owners.py's plan, `self.plans`)."""

    def __init__(self, buffer, tp, o: OptimizerConfig, dtype: torch.dtype, decay):
        self.buffer, self.tp, self.o = buffer, tp, o
        index = {b: i for i, b in enumerate(buffer.buckets)}
        self.matrices = []  # (range, bucket index, shard slice, scale, decay) with a piece here
        self.adam = []  # (bucket index, lo, hi, offset into exp_avg_sq, decay, embedding)
        self._sq_at = {}  # range name -> (bucket index, offset of its piece in exp_avg_sq)
        held = [0] * len(buffer.buckets)
        in_bucket = [[] for _ in buffer.buckets]  # (name, offset, numel, spec) per bucket
        for r in buffer.ranges:
            i, s, spec = index[r.bucket], r.shard_slice(), spec_of(r.param)
            in_bucket[i].append((r.name, r.offset, r.param.numel(), spec))
            parts = muon_parts(r.name, spec)
            if s is None:
                continue
            if parts:
                rows, cols = spec.shape[-2:]
                s_ = scale(rows // parts, cols, o.muon_scale)
                self.matrices.append((r, i, s, s_, decay(r)))
                continue
            # (the vocabulary's tensors take --decoupled-lr, as AdamW's embedding and output)
            emb = o.decoupled_lr is not None and spec.vocab_dim is not None
            self.adam.append((i, s[0], s[1], held[i], decay(r), emb))
            self._sq_at[r.name] = (i, held[i] - s[0])
            held[i] += s[1] - s[0]
        self.matrices_of = {}  # bucket index -> its entries of self.matrices
        for entry in self.matrices:
            self.matrices_of.setdefault(entry[1], []).append(entry)
        # Per bucket holding a matrix anywhere (not only in this rank's shard; every member of
        # its group takes part in its hops): the plan, and each member's flat range.
        self.plans, self.shards, owners = {}, {}, {}
        for i, b in enumerate(buffer.buckets):
            mats = matrices(in_bucket[i], tp.size, muon_parts)
            if not mats:
                continue
            g, experts = buffer.group_of(b), spec_of(b.params[0]).expert  # (their own buffer)
            owner = owners.setdefault(experts, Owners(g.size, tp.size))  # loads over a buffer
            self.plans[i] = owner.assign(mats)
            sharded = b.shard_end - b.shard_start < b.numel
            self.shards[i] = bounds(b.start, b.numel, g.size, sharded)
        shards = [buffer.param_shard(b) for b in buffer.buckets]
        self.exp_avg = [torch.zeros_like(s, dtype=dtype) for s in shards]
        self.exp_avg_sq = [torch.zeros(n, dtype=dtype, device=s.device)
                           for n, s in zip(held, shards)]  # fmt: skip

    @staticmethod
    def kinds(name: str, spec: ParamSpec) -> tuple[str, ...]:
        """The optimizer state a parameter has (the checkpoint's kinds for it)."""
        return ("momentum",) if muon_parts(name, spec) else ("exp_avg", "exp_avg_sq")

    def views(self, r, i: int, lo: int, hi: int) -> dict[str, torch.Tensor]:
        """The state of the shard piece [lo, hi) of range r (in bucket i's shard), by kind."""
        if muon_parts(r.name, spec_of(r.param)):
            return {"momentum": self.exp_avg[i][lo:hi]}
        j, at = self._sq_at[r.name]
        return {
            "exp_avg": self.exp_avg[i][lo:hi],
            "exp_avg_sq": self.exp_avg_sq[j][at + lo : at + hi],
        }

    def flat(self) -> dict[str, list[torch.Tensor]]:
        """Per kind, per-bucket tensors the size of the shards (the second moment spread out,
        zeros at the matrices' elements), for gathering whole parameters."""
        sq = [torch.zeros_like(m) for m in self.exp_avg]
        for i, lo, hi, at, _, _ in self.adam:
            sq[i][lo:hi] = self.exp_avg_sq[i][at : at + hi - lo]
        return {"momentum": self.exp_avg, "exp_avg": self.exp_avg, "exp_avg_sq": sq}

    def tensors(self) -> list[torch.Tensor]:
        return self.exp_avg + self.exp_avg_sq

    @torch.no_grad()
    def step(self, weights, grads, rates: Rates, step: int):
        """One update of `weights` (per-bucket shards, the fp32 masters where there are any)
        from `grads` (the reduced, clipped shards). Collective over DP and TP."""
        o = self.o
        w, g, m, v, decayed, emb = [], [], [], [], [], []
        for i, lo, hi, at, decay, e in self.adam:
            w.append(weights[i][lo:hi])
            g.append(grads[i][lo:hi])
            m.append(self.exp_avg[i][lo:hi])
            v.append(self.exp_avg_sq[i][at : at + hi - lo])
            decayed.append([(0, hi - lo)] if decay else [])
            emb.append([(0, hi - lo)] if e else [])
        adamw(w, g, m, v, decayed, rates, step, o, emb)
        lr, wd = rates.lr, rates.weight_decay

        # Bucket by bucket (in the same order on every member of its group, one bucket's
        # update alive at a time): the Nesterov update of this rank's pieces to each matrix's
        # owner, orthogonalised there once, the result's pieces back (muon_owners.py).
        for i in sorted(self.plans):
            b, mats = self.buffer.buckets[i], self.matrices_of.get(i, [])
            update = torch.zeros_like(self.exp_avg[i])
            for _, _, (lo, hi, _, _), _, _ in mats:
                mom, grad = self.exp_avg[i][lo:hi], grads[i][lo:hi].to(update.dtype)
                mom.lerp_(grad, 1 - o.muon_momentum)
                update[lo:hi] = grad.lerp(mom, o.muon_momentum) if o.muon_nesterov else mom
            group, base = self.buffer.group_of(b), b.shard_start
            whole = self._to_owners(self.plans[i], self.shards[i], group, update, base)
            results = self._ns(i, whole)
            result = self._back(self.plans[i], self.shards[i], group, results, update)
            for _, _, (lo, hi, _, _), s, decay in mats:
                piece = weights[i][lo:hi]
                if decay and wd:
                    piece.mul_(1 - lr * wd)
                piece.add_(result[lo:hi].to(piece.dtype), alpha=-lr * s)

    @staticmethod
    def _to_owners(plan, shards, group, update, base) -> dict[int, torch.Tensor]:
        """Hop A: {plan index: its local tensor, flat} for the matrices this replica owns
        (`update`: this rank's shard of the bucket, starting at flat offset `base`)."""
        me, n = group.rank, group.size
        mine = [k for k, m in enumerate(plan) if m.owner[0] == me]
        got = {}  # (member, plan index) -> its piece
        if moves(lambda j: gather_sizes(plan, shards, j), n):
            send, recv = gather_sizes(plan, shards, me)
            x = [update[a - base : b - base] for j in range(n) if j != me
                 for m in plan if m.owner[0] == j for a, b in [cut(m, *shards[me])]]  # fmt: skip
            out = comm.all_to_all(torch.cat(x) if x else update[:0], group, recv, send)
            for j, chunk in enumerate(out.split(recv)):
                sizes = [extent(cut(plan[k], *shards[j])) for k in mine] if j != me else []
                got.update(((j, k), p) for k, p in zip(mine, chunk.split(sizes)))
        whole = {}
        for k in mine:
            a, b = cut(plan[k], *shards[me])
            pieces = [update[a - base : b - base] if j == me else got.get((j, k), update[:0])
                      for j in range(n)]  # fmt: skip
            whole[k] = torch.cat(pieces) if len(set(shards)) > 1 else pieces[me]
        return whole

    def _ns(self, i: int, whole: dict) -> dict[int, torch.Tensor]:
        """Hop B and Newton-Schulz: {plan index: the result of this rank's local tensor, flat}
        for the matrices this replica owns; each orthogonalised by its owner alone."""
        plan, tp, o = self.plans[i], self.tp, self.o
        d, t, size = self.buffer.group_of(self.buffer.buckets[i]).rank, tp.rank, tp.size
        mine = [k for k in whole if plan[k].tp]  # with a TP stage
        slices = {}  # (TP rank, plan index) -> its slice, at the owner
        if moves(lambda j: tp_sizes(plan, d, j, size)[0], size):
            (send, recv), _ = tp_sizes(plan, d, t, size)
            x = [whole[k] for j in range(size) if j != t
                 for k in mine if plan[k].tp == "split" and plan[k].owner[1] == j]  # fmt: skip
            out = comm.all_to_all(torch.cat(x) if x else _empty(whole), tp, recv, send)
            ours = [k for k in mine if plan[k].tp == "split" and plan[k].owner[1] == t]
            for j, chunk in enumerate(out.split(recv)):
                if j != t:
                    sizes = [plan[k].numel for k in ours]
                    slices.update(((j, k), p) for k, p in zip(ours, chunk.split(sizes)))
        results, pieces = {}, {}  # pieces: (TP rank, plan index) -> what the owner sends it
        for k, u in whole.items():
            m = plan[k]
            if m.tp and m.owner[1] != t:
                continue  # (its result comes back below)
            local = u.view(m.shape)
            if m.tp == "split":
                parts = [slices[(j, k)].view(m.shape) if j != t else local for j in range(size)]
                local = torch.cat(parts, dim=m.split_dim)
            out = orthogonalise(local, m.parts, o)[0]
            if m.tp == "split":
                for j, p in enumerate(out.chunk(size, m.split_dim)):
                    pieces[(j, k)] = p.reshape(-1)
            else:
                pieces.update(((j, k), out.reshape(-1)) for j in range(size))
            results[k] = pieces[(t, k)]
        if moves(lambda j: tp_sizes(plan, d, j, size)[1], size):
            _, (send, recv) = tp_sizes(plan, d, t, size)
            x = [pieces[(j, k)] for j in range(size) if j != t
                 for k in mine if plan[k].owner[1] == t]  # fmt: skip
            out = comm.all_to_all(torch.cat(x) if x else _empty(whole), tp, recv, send)
            for j, chunk in enumerate(out.split(recv)):
                theirs = [k for k in mine if plan[k].owner[1] == j] if j != t else []
                results.update(zip(theirs, chunk.split([plan[k].numel for k in theirs])))
        return results

    @staticmethod
    def _back(plan, shards, group, results, update) -> torch.Tensor:
        """Hop C: this rank's shard of the bucket's orthogonalised matrices, zeros elsewhere
        (written over `update`, which hop A has read)."""
        me, n = group.rank, group.size
        lo, hi = shards[me]
        base = lo
        out = update.zero_()
        for k, r in results.items():
            a, b = cut(plan[k], lo, hi)
            out[a - base : b - base] = r[a - plan[k].lo : b - plan[k].lo]
        if moves(lambda j: scatter_sizes(plan, shards, j), n):
            send, recv = scatter_sizes(plan, shards, me)
            x = [results[k][a - m.lo : b - m.lo] for j in range(n) if j != me
                 for k, m in enumerate(plan) if m.owner[0] == me
                 for a, b in [cut(m, *shards[j])]]  # fmt: skip
            got = comm.all_to_all(torch.cat(x) if x else out[:0], group, recv, send)
            for j, chunk in enumerate(got.split(recv)):
                theirs = [m for m in plan if m.owner[0] == j] if j != me else []
                spans = [cut(m, lo, hi) for m in theirs]
                for (a, b), p in zip(spans, chunk.split([extent(s) for s in spans])):
                    out[a - base : b - base] = p
        return out


def _empty(tensors: dict) -> torch.Tensor:
    return next(iter(tensors.values()))[:0]


def adam_elements(ranges, lo: int, hi: int) -> int:
    """(the planner) AdamW elements in the flat range [lo, hi) of a bucket layout's
    `ranges` [(name, offset, numel, spec)]: those with a second moment under Muon."""
    return sum(max(0, min(hi, o + n) - max(lo, o)) for name, o, n, spec in ranges
               if not muon_parts(name, spec))  # fmt: skip


def second_moments(o: OptimizerConfig, ranges, lo: int, hi: int) -> int:
    """(the planner) Elements of the flat range [lo, hi) of a bucket (this rank's shard) that
    have an AdamW second moment: all of them under AdamW (padding too, as its shards), under
    Muon only the AdamW parameters'. `ranges` [(name, offset, numel, spec)]."""
    return adam_elements(ranges, lo, hi) if muon_on(o) else hi - lo
