"""Which rank orthogonalises each of Muon's matrices, and what moves so that it can: a plan
computed from the bucket layout alone (names, shapes, offsets), the same on every rank that
shares a matrix and in the planner (plan/traffic.py), so the collectives pair up without a
message and the planned bytes are the ones sent.

A matrix (a parameter, or one expert of an expert weight) is held by the ranks of its bucket's
group (the replicas, or edp for experts), each its ZeRO shard of the flat bucket (all of it at
stage 0), and for a dense matrix at tp > 1 by the TP peers too (a column/row-parallel slice
each, "split", or a whole copy: k/v replicated over tp, "copy"). Experts have no TP stage:
their edp group holds the TP peers already. Each matrix gets one owner (d, t) among them; a
step moves its Nesterov update in three hops, each one `all_to_all` per bucket:

  A. over the bucket's group: every holder sends its shard's piece to replica d (nothing at
     ZeRO-0, where d holds the bucket already), so d has the matrix's local tensor whole;
  B. over tp at replica d ("split" only): the slices to TP rank t, which orthogonalises the
     whole matrix, then sends each TP peer its slice back ("copy": the whole result);
  C. over the bucket's group: replica d sends each holder the piece of the result in its shard.

Owners are chosen longest first (the Newton-Schulz cost of the matrix) onto the least loaded
slot, loads carried over the buckets of a buffer, ties to the lowest (d, t)."""

import dataclasses
from dataclasses import dataclass

from megalite.parallel.specs import ParamSpec


@dataclass(frozen=True)
class Matrix:
    """One matrix Newton-Schulz runs on: [lo, hi) of the flat buffer (this rank's local
    tensor of it), its local `shape`, `parts` row blocks orthogonalised apart (gate_up: 2)."""

    name: str
    lo: int
    hi: int
    shape: tuple
    parts: int
    tp: str | None  # "split" (split_dim: the TP slices), "copy" (TP peers hold it whole), None
    split_dim: int | None
    cost: int  # multiply-adds of one Newton-Schulz step on the whole matrix
    owner: tuple = (0, 0)  # (index in the bucket's group, index in tp)

    @property
    def numel(self) -> int:
        return self.hi - self.lo


def ns_cost(rows: int, cols: int, parts: int = 1) -> int:
    """Multiply-adds of one quintic step on `parts` (rows/parts, cols) matrices: X X^T, A A
    and B X on the smaller side m of each, 2 m^2 n + m^3."""
    m, n = sorted((rows // parts, cols))
    return parts * (2 * m * m * n + m**3)


def matrices(ranges, tp: int, parts_of) -> list[Matrix]:
    """The matrices of a bucket's `ranges` [(name, offset, numel, ParamSpec)], in flat order;
    `parts_of(name, spec)`: muon.muon_parts."""
    out = []
    for name, offset, numel, spec in ranges:
        parts = parts_of(name, spec)
        if not parts:
            continue
        rows, cols = spec.shape[-2:]
        cost = ns_cost(rows, cols, parts)
        if spec.expert:  # (E, out, in): each expert its own matrix, whole on its ep rank
            count, shape, mode = spec.local_shape[0], tuple(spec.local_shape[1:]), None
        else:
            count, shape = 1, tuple(spec.local_shape)
            mode = None if tp == 1 else ("split" if _tp_split(spec) else "copy")
        dim = spec.split_dim if mode == "split" else None
        size = numel // count
        for e in range(count):
            lo = offset + e * size
            out.append(Matrix(name, lo, lo + size, shape, parts, mode, dim, cost))
    return out


def _tp_split(spec: ParamSpec) -> bool:
    return spec.split_axis == "tp" and spec.split_size > 1


class Owners:
    """Assigns owners over a buffer's buckets, in order (`assign`), `n` ranks in the bucket's
    group, `tp` TP ranks for the matrices with a TP stage."""

    def __init__(self, n: int, tp: int):
        self.n, self.tp = n, tp
        self.load: dict[tuple, int] = {}

    def assign(self, mats: list[Matrix]) -> list[Matrix]:
        """`mats` (one bucket's, in flat order) with their owners."""
        out = list(mats)
        for k in sorted(range(len(mats)), key=lambda k: (-mats[k].cost, k)):
            m = mats[k]
            slots = [(d, t) for d in range(self.n) for t in range(self.tp if m.tp else 1)]
            best = min(slots, key=lambda s: (self.load.get(s, 0), s))
            self.load[best] = self.load.get(best, 0) + m.cost
            out[k] = dataclasses.replace(m, owner=best)
        return out


def bounds(start: int, numel: int, n: int, sharded: bool) -> list[tuple[int, int]]:
    """The flat range each of the `n` ranks of the bucket's group updates."""
    if not sharded:
        return [(start, start + numel)] * n
    s = numel // n
    return [(start + j * s, start + (j + 1) * s) for j in range(n)]


def cut(m: Matrix, lo: int, hi: int) -> tuple[int, int]:
    """The part of m inside the flat range [lo, hi) (empty: lo == hi)."""
    a, b = max(m.lo, lo), min(m.hi, hi)
    return (a, b) if a < b else (a, a)


def gather_sizes(mats, shards, me: int) -> tuple[list, list]:
    """Hop A on member `me` of the bucket's group (`shards`: each member's flat range):
    (elements it sends to each member, elements it receives from each), a member's message
    holding its pieces in the plan's matrix order. Nothing moves at ZeRO-0 (all equal)."""
    n = len(shards)
    send, recv = [0] * n, [0] * n
    if len(set(shards)) == 1:
        return send, recv
    for m in mats:
        d = m.owner[0]
        if d != me:
            send[d] += extent(cut(m, *shards[me]))
        else:
            for j in range(n):
                recv[j] += extent(cut(m, *shards[j])) if j != me else 0
    return send, recv


def scatter_sizes(mats, shards, me: int) -> tuple[list, list]:
    """Hop C: the reverse of hop A, to each member's whole range at ZeRO-0."""
    n = len(shards)
    send, recv = [0] * n, [0] * n
    for m in mats:
        d = m.owner[0]
        if d == me:
            for j in range(n):
                send[j] += extent(cut(m, *shards[j])) if j != me else 0
        else:
            recv[d] += extent(cut(m, *shards[me]))
    return send, recv


def tp_sizes(mats, d: int, t: int, tp: int) -> tuple[tuple, tuple]:
    """Hop B on TP rank `t` at replica `d`: (sent, received) per TP rank of the gather to
    each matrix's owner, then of the scatter back."""
    g_send, g_recv, s_send, s_recv = ([0] * tp for _ in range(4))
    for m in mats:
        if m.tp is None or m.owner[0] != d:
            continue
        o, gathered = m.owner[1], m.numel if m.tp == "split" else 0
        if o == t:
            for j in range(tp):
                s_send[j] += m.numel if j != t else 0
                g_recv[j] += gathered if j != t else 0
        else:
            s_recv[o] += m.numel
            g_send[o] += gathered
    return (g_send, g_recv), (s_send, s_recv)


def moves(sizes, members: int) -> bool:
    """Whether a hop moves anything in its group: `sizes(j)` -> (sent, received) of member j.
    Every member computes the same answer, so all skip an empty hop together."""
    return members > 1 and any(sum(sizes(j)[0]) for j in range(members))


def extent(span: tuple[int, int]) -> int:
    return span[1] - span[0]


def sent_elements(mats, shards, d: int, t: int, tp: int) -> tuple[int, int]:
    """(the planner) Elements rank (d, t) hands to all_to_all for one bucket in a step: over
    the bucket's group (hops A and C), over tp (hop B)."""
    a = sum(gather_sizes(mats, shards, d)[0]) + sum(scatter_sizes(mats, shards, d)[0])
    (g_send, _), (s_send, _) = tp_sizes(mats, d, t, tp)
    return a, sum(g_send) + sum(s_send)
