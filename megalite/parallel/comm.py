"""The small vocabulary of communication: named, autograd-aware collectives, each counted.

Layers never call torch.distributed themselves. Each function here takes the one `Group` it
needs; a group of one rank makes every function the identity (and costs nothing). Every call
is recorded in the group's `CommLedger` as bus bytes per rank, the traffic a ring algorithm
moves: all-reduce 2(n-1)/n of the tensor, all-gather and reduce-scatter (n-1)/n of the full
tensor, point-to-point the tensor itself.
"""

import pickle
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megalite.parallel.ledger import CommLedger, clock_start

# torch 2.13 renamed the single-tensor collectives (the old names still work there, deprecated);
# setup.py's oldest torch (2.6) has only the old ones (tests/unit/test_torch_version.py). Looked
# up at each call, so a wrapper put on torch.distributed (the fake world's recorder) sees them.


def _all_gather_single(*args, **kw):
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kw)


def _reduce_scatter_single(*args, **kw):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(*args, **kw)


@dataclass
class Group:
    """One process group and where this rank sits in it."""

    kind: str
    ranks: list
    rank: int  # this process's index in `ranks`
    pg: object = None  # torch ProcessGroup; None when the group is this rank alone
    ledger: CommLedger = field(default_factory=CommLedger)
    device: torch.device | None = None  # where the backend's tensors live (None: unchecked)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def check(self, t: torch.Tensor):
        """A collective's tensor must live where the backend works (NCCL: the rank's GPU)."""
        d = self.device
        if d is not None and (
            t.device.type != d.type
            or (d.index is not None and t.device.index not in (None, d.index))
        ):
            raise RuntimeError(
                f"a {self.kind} collective was handed a tensor on {t.device}; the group works on "
                f"{d}: create it with device=... (a bug in megalite)"
            )


def _enter(group: Group, op: str, t: torch.Tensor | None = None):
    """Note the collective in the ledger's `entered` record before it can block; its start."""
    group.ledger.enter(group.kind, op)
    return clock_start(t)


def _record(group: Group, nbytes: float, t0):
    group.ledger.add(group.kind, nbytes)
    group.ledger.add_span(group.kind, t0)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---- plain (non-autograd) collectives, counted -------------------------------------------


def all_reduce(t: torch.Tensor, group: Group, op=dist.ReduceOp.SUM, async_op=False):
    """In-place all-reduce of t over the group."""
    group.check(t)
    if group.size == 1:
        return None
    t0 = _enter(group, "all_reduce", t)
    work = dist.all_reduce(t, op=op, group=group.pg, async_op=async_op)
    _record(group, 2 * (group.size - 1) / group.size * _nbytes(t), t0)
    return work


def all_gather(out: torch.Tensor, t: torch.Tensor, group: Group, async_op=False):
    """Concatenate every rank's t along dim 0 into out."""
    group.check(t)
    if group.size == 1:
        out.copy_(t)
        return None
    t0 = _enter(group, "all_gather", t)
    work = _all_gather_single(out, t.contiguous(), group=group.pg, async_op=async_op)
    _record(group, (group.size - 1) / group.size * _nbytes(out), t0)
    return work


def reduce_scatter(
    out: torch.Tensor, t: torch.Tensor, group: Group, op=dist.ReduceOp.SUM, async_op=False
):
    """Sum t over the group and keep this rank's 1/n slice along dim 0 in out."""
    group.check(t)
    if group.size == 1:
        out.copy_(t)
        return None
    t0 = _enter(group, "reduce_scatter", t)
    work = _reduce_scatter_single(out, t.contiguous(), op=op, group=group.pg, async_op=async_op)
    _record(group, (group.size - 1) / group.size * _nbytes(t), t0)
    return work


def broadcast(t: torch.Tensor, src_index: int, group: Group):
    """Broadcast t from the group's member at index src_index."""
    group.check(t)
    if group.size == 1:
        return
    t0 = _enter(group, "broadcast", t)
    dist.broadcast(t, src=group.ranks[src_index], group=group.pg)
    _record(group, _nbytes(t), t0)


def all_gather_object(obj, group: Group) -> list:
    """Every member's small Python object (messages, index entries, timelines), in group order.
    Between our own processes only: nothing read from disk goes through here."""
    if group.size == 1:
        return [obj]
    t0 = _enter(group, "all_gather_object")
    out = [None] * group.size
    dist.all_gather_object(out, obj, group=group.pg)
    _record(group, (group.size - 1) * len(pickle.dumps(obj)), t0)
    return out


def gather_object(obj, group: Group) -> list | None:
    """Every member's small Python object on the group's first member (None elsewhere)."""
    if group.size == 1:
        return [obj]
    t0 = _enter(group, "gather_object")
    out = [None] * group.size if group.rank == 0 else None
    dist.gather_object(obj, out, dst=group.ranks[0], group=group.pg)
    _record(group, len(pickle.dumps(obj)), t0)
    return out


# ---- along a dimension -------------------------------------------------------------------


def _split(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    return x.chunk(group.size, dim=dim)[group.rank].contiguous()


def _gather(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    if group.size == 1:
        return x
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((group.size * x.shape[0], *x.shape[1:]))
    all_gather(out, x, group)
    # contiguous: the layers that share this input then save one tensor for backward, not a copy each
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    if group.size == 1:
        return x
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // group.size, *x.shape[1:]))
    reduce_scatter(out, x, group)
    return out.movedim(0, dim).contiguous()


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group.size == 1:
        return x
    x = x.contiguous().clone()
    all_reduce(x, group)
    return x


# ---- autograd functions: forward op / backward op -----------------------------------------


class _CopyToGroup(torch.autograd.Function):
    """Identity forward, all-reduce backward (entering a column-parallel region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    """All-reduce forward, identity backward (leaving a row-parallel region)."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _AlongDim(torch.autograd.Function):
    """`fwd(x, dim, group)` forward and `bwd(grad, dim, group)` backward: the four pairs below
    (split/gather, gather/split, gather/reduce-scatter, reduce-scatter/gather)."""

    @staticmethod
    def forward(ctx, x, dim, group, fwd, bwd):
        ctx.dim, ctx.group, ctx.bwd = dim, group, bwd
        return fwd(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return ctx.bwd(g, ctx.dim, ctx.group), None, None, None, None


# torch.compile (--compile, megalite/training/compile.py): a collective ends the graph; dynamo
# runs it eagerly (the ledger, host timing and torch.distributed call) and resumes after it.
# A group of one never reaches these, so it breaks nothing.
def graph_break(apply):
    """`apply`, and under torch.compile `apply` behind torch.compiler.disable, made at its first
    compiled call (torch._disable_dynamo, as torch.optim uses it): importing torch._dynamo costs
    each process about a second, which a run without --compile never needs. (`run`: the lazy
    disable caches itself on a function, which a bound method refuses.)"""

    def run(*args):
        return apply(*args)

    disabled = torch._disable_dynamo(run)

    def call(*args):
        return disabled(*args) if torch.compiler.is_compiling() else apply(*args)

    return call


_copy_to_group = graph_break(_CopyToGroup.apply)
_reduce_from_group = graph_break(_ReduceFromGroup.apply)
_along_dim = graph_break(_AlongDim.apply)


def copy_to_group(x, group: Group):
    return x if group.size == 1 else _copy_to_group(x, group)


def reduce_from_group(x, group: Group):
    return x if group.size == 1 else _reduce_from_group(x, group)


def scatter_to_group(x, group: Group, dim: int = -1):
    """Keep this rank's slice along dim; its backward all-gathers."""
    return x if group.size == 1 else _along_dim(x, dim % x.dim(), group, _split, _gather)


def gather_from_group(x, group: Group, dim: int = -1):
    """All-gather along dim; its backward keeps this rank's slice."""
    return x if group.size == 1 else _along_dim(x, dim % x.dim(), group, _gather, _split)


def gather_from_sequence(x, group: Group, dim: int = 1):
    """(b, s/t, h) -> (b, s, h); its backward reduce-scatters the gradient."""
    return x if group.size == 1 else _along_dim(x, dim, group, _gather, _reduce_scatter)


def reduce_scatter_to_sequence(x, group: Group, dim: int = 1):
    """(b, s, h) partial sums -> (b, s/t, h) reduced; its backward all-gathers."""
    return x if group.size == 1 else _along_dim(x, dim, group, _reduce_scatter, _gather)


# ---- all-to-all with variable split sizes (expert parallelism) ---------------------------


def _all_to_all(x: torch.Tensor, group: Group, out_sizes: list, in_sizes: list) -> torch.Tensor:
    """Rows x[sum(in_sizes[:j]) : ...] go to member j; out holds the rows from each member in
    group order (out_sizes[j] of them from member j). Recorded as the bytes of the tensor this
    rank hands in, its own rows included (what a dispatch moves, whatever the routing)."""
    group.check(x)
    x = x.contiguous()
    out = x.new_empty((sum(out_sizes), *x.shape[1:]))
    t0 = _enter(group, "all_to_all", x)
    dist.all_to_all_single(out, x, out_sizes, in_sizes, group=group.pg)
    _record(group, _nbytes(x), t0)
    return out


class _AllToAll(torch.autograd.Function):
    """All-to-all forward; the reverse all-to-all (sizes swapped) backward."""

    @staticmethod
    def forward(ctx, x, group, out_sizes, in_sizes):
        ctx.group, ctx.out_sizes, ctx.in_sizes = group, out_sizes, in_sizes
        return _all_to_all(x, group, out_sizes, in_sizes)

    @staticmethod
    def backward(ctx, g):
        return _all_to_all(g, ctx.group, ctx.in_sizes, ctx.out_sizes), None, None, None


_all_to_all_apply = graph_break(_AllToAll.apply)  # as above


def all_to_all(x, group: Group, out_sizes: list[int], in_sizes: list[int]):
    """Exchange rows of x (n, ...) over the group: in_sizes[j] consecutive rows go to member j,
    out_sizes[j] rows come back from it (host lists: the receiver must know them beforehand).
    Autograd-aware: the gradient takes the way back."""
    if group.size == 1:
        return x
    return _all_to_all_apply(x, group, list(out_sizes), list(in_sizes))
