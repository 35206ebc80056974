"""Megatron's tensor-parallel layers: each holds 1/tp of a logical weight.

A column-parallel linear splits the output features, a row-parallel one the input features, so
an attention or MLP block needs one all-reduce forward (or, with sequence parallelism, an
all-gather before and a reduce-scatter after). Layers record how they split each parameter in
its `ParamSpec` (specs.py); the model initialises every logical tensor whole from the seed and
keeps its slice, so any tp starts identical. Their matmuls are `ops.linear` (megalite.kernels:
the seam for another implementation, an FP8 one say); the fused ones (`fused_column_linear`)
run an autograd function of their own when that is F.linear, which keeps for backward what
Megatron's keep: the weights, and with sequence parallelism the input's local rows.

With sequence parallelism, --tp-comm-overlap (`overlap=True`) cuts the layers' collectives
into tp chunks along the sequence: a fused block's matmul runs on each chunk of its gathered
input while the next chunk's all-gather is in flight, a row-parallel layer reduce-scatters each
chunk of its output while it computes the next (and backward mirrors both). A fused block's
backward always reduce-scatters its input gradient behind its weight gradients' matmuls.
"""

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from megalite.kernels import TORCH_OPS, override
from megalite.kernels.fp8_linear import NO_FP8
from megalite.parallel import comm
from megalite.parallel.comm import Group
from megalite.parallel.specs import mark


def shard_spec(group: Group, split_dim=None, partial_grad=False, **fields) -> dict:
    """mark()'s arguments for a tensor split along `split_dim` over the TP group (None: whole
    on every rank; `partial_grad`: each rank computes part of its gradient, summed over TP)."""
    sync = ("tp",) if partial_grad and group.size > 1 else ()
    return {"split_dim": split_dim, "split_size": group.size, "split_index": group.rank,
            "grad_sum": sync, **fields}  # fmt: skip


def _max_over(t: torch.Tensor, group: Group):
    comm.all_reduce(t, group, op=dist.ReduceOp.MAX)


def own_linear(ops, **shards):
    """`ops` with this layer's own FP8 `linear` when `ops.fp8_linear` makes one (kernels/fp8.py),
    told which group shards each dim ("in", "out") so that its amaxes are those of the whole
    tensor (every layout quantises like one process); else `ops` unchanged."""
    make = getattr(ops, "fp8_linear", None)
    linear = None if make is None else make(shards, _max_over)
    if linear is None:
        return ops
    return override(ops, linear=linear, fp8_linear=NO_FP8)


class SequenceParallel:
    """Whether the activations between TP regions are split along the sequence: one switch that
    a model chunk owns (`chunk.sequence_parallel`) and hands to each of its layers as their
    env's `sequence_parallel`, so turning it off for inference (`GPTChunk.full_sequences`)
    reaches them all. Anything that takes `sequence_parallel` accepts it or a plain bool (a
    layer built on its own)."""

    def __init__(self, on: bool):
        self.on = bool(on)

    def __bool__(self) -> bool:
        return self.on


def enter_tp_region(x: torch.Tensor, group: Group, sequence_parallel: bool) -> torch.Tensor:
    """Input of column-parallel layers: (b, s/t, h) all-gathered with sequence parallelism,
    else (b, s, h) as is (its gradient is all-reduced over TP in backward)."""
    if sequence_parallel:
        return comm.gather_from_sequence(x, group)
    return comm.copy_to_group(x, group)


def exit_tp_region(x: torch.Tensor, group: Group, sequence_parallel: bool) -> torch.Tensor:
    """Output of row-parallel layers: partial sums (b, s, h) reduced, and with sequence
    parallelism scattered along the sequence to (b, s/t, h)."""
    if sequence_parallel:
        return comm.reduce_scatter_to_sequence(x, group)
    return comm.reduce_from_group(x, group)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W (out, in) split along out: this rank computes out/tp features.

    `enter=False` when the caller has already entered the TP region once for several layers
    sharing one input (q, k, v; gate, up), so the input is gathered/reduced once, not per layer.
    `split=False` keeps the whole weight on every rank (k/v heads replicated when there are
    fewer query groups than TP ranks); its gradient is then summed over TP. `overlap`
    (--tp-comm-overlap): read by `fused_column_linear`, the path of the fused blocks.
    """

    def __init__(
        self,
        in_features,
        out_features,
        group: Group,
        bias=True,
        sequence_parallel=False,
        enter=True,
        gather_output=False,
        split=True,
        dtype=None,
        device=None,
        ops=TORCH_OPS,
        overlap=False,
    ):
        super().__init__()
        self.group, self.sequence_parallel, self.overlap = group, sequence_parallel, overlap
        self.ops = own_linear(ops, out=group if split else None)
        self.enter, self.gather_output = enter, gather_output
        tp = group.size if split else 1
        if out_features % tp:
            raise ValueError(f"out_features={out_features} is not divisible by tp={tp}")
        kw = {"dtype": dtype, "device": device}
        spec = shard_spec(group, 0 if split else None, partial_grad=not split)
        self.weight = mark(nn.Parameter(torch.empty(out_features // tp, in_features, **kw)), **spec)
        self.bias = None
        if bias:
            self.bias = mark(nn.Parameter(torch.zeros(out_features // tp, **kw)), **spec,
                             no_weight_decay=True)  # fmt: skip

    def forward(self, x):
        if self.enter:
            x = enter_tp_region(x, self.group, self.sequence_parallel)
        y = self.ops.linear(x, self.weight, self.bias)  # (b, s, out/tp)
        if self.gather_output:
            y = comm.gather_from_group(y, self.group, dim=-1)
        return y


def _wanted(ctx, i: int) -> bool:
    """Whether a backward below must make the gradient of its tensor input i (x, then the
    weights, then the bias): it needs one and the engine runs the node it goes to (a split
    backward's I wants the input's only, its W the weights': pipeline/split_backward.py), as
    torch's own matmul backward decides. `ctx.lead`: the non-tensor arguments before x."""
    if not ctx.needs_input_grad[ctx.lead + i]:
        return False
    if torch.compiler.is_compiling():  # a compiled backward is whole (compile.py): make it
        return True
    try:
        return torch._C._will_engine_execute_node(ctx.next_functions[i][0])
    except RuntimeError:  # autograd.grad towards a leaf: the engine cannot tell; make it
        return True


def _pieces(group: Group, rows: int, overlap: bool) -> int:
    """Pieces each sequence-parallel collective is cut into: tp under --tp-comm-overlap (fewer
    where they do not divide this rank's `rows`), else one."""
    return math.gcd(rows, group.size) if overlap else 1


def _gather_pieces(x: torch.Tensor, group: Group, n: int) -> list:
    """x (b, r, ...) cut into n pieces of its r rows, each all-gathered at once (async): a list
    of (work, (t * r/n, b, ...) buffer), the members' pieces one after another."""
    rows = x.shape[1] // n
    out = []
    for j in range(n):
        piece = x.narrow(1, j * rows, rows).transpose(0, 1)  # (r/n, b, ...)
        buf = x.new_empty((group.size * rows, *piece.shape[1:]))
        out.append((comm.all_gather(buf, piece, group, async_op=True), buf))
    return out


def _sequence_rows(buf: torch.Tensor, t: int) -> torch.Tensor:
    """A gathered piece (t * r, b, ...) as (b, t, r, ...): batch first, member by member."""
    return buf.unflatten(0, (t, -1)).movedim(2, 0)


def _joined(weights) -> torch.Tensor:
    """The fused layers' weights as one (sum of out, in) matrix: a copy, unless there is one."""
    return weights[0] if len(weights) == 1 else torch.cat(weights)


def _matmul_gathered(x: torch.Tensor, w: torch.Tensor, b, group: Group, n: int) -> torch.Tensor:
    """F.linear(x gathered along the sequence over group, w, b): x (b, s/t, h) -> (b, s, out),
    its n pieces' matmuls each behind the next piece's all-gather."""
    pieces = _gather_pieces(x, group, n)
    if n == 1:
        work, buf = pieces[0]
        work.wait()
        return F.linear(buf.transpose(0, 1), w, b)
    t, bsz = group.size, x.shape[0]
    y = x.new_empty((bsz, t, n, x.shape[1] // n, w.shape[0]))  # sequence: member, piece, row
    for j, (work, buf) in enumerate(pieces):
        work.wait()
        y[:, :, j] = F.linear(_sequence_rows(buf, t), w, b)
    return y.view(bsz, -1, w.shape[0])


class _JoinedLinear(torch.autograd.Function):
    """y = x [w_1; ...; w_n]^T + b in one matmul, keeping for backward the weights themselves
    (not their concatenation: that would be a copy per micro-batch) and x. With `group`, x is
    this rank's (b, s/t, h) rows, all-gathered along the sequence here (in `pieces`, each
    matmul behind the next one's gather: --tp-comm-overlap); backward gathers them again,
    behind the input gradient's matmul, and reduce-scatters that gradient behind the weight
    gradients' matmuls, as Megatron does. The gradients are F.linear's on the joined weight."""

    @staticmethod
    def forward(ctx, group, pieces, n, x, *params):  # params: n weights, then the joined bias
        weights, b = params[:n], (params[n] if len(params) > n else None)
        w = _joined(weights)
        if group is None:
            y = F.linear(x, w, b)
        else:
            y = _matmul_gathered(x, w, b, group, pieces)  # (b, s, sum of out)
        ctx.group, ctx.lead, ctx.n, ctx.bias = group, 3, n, b is not None
        ctx.save_for_backward(x, *weights)
        return y

    @staticmethod
    def backward(ctx, g):
        x, *weights = ctx.saved_tensors
        group, bsz = ctx.group, g.shape[0]
        g2 = g.reshape(-1, g.shape[-1])  # (tokens, sum of out)
        want_w = [_wanted(ctx, 1 + i) for i in range(ctx.n)]
        gather = scatter = None
        if group is not None and any(want_w):  # x's rows again: (s, b, h)
            [(gather, x)] = _gather_pieces(x, group, 1)
            x = x.transpose(0, 1)
        gx = None
        if _wanted(ctx, 0):  # the joined weight again, for this matmul only
            w = _joined(weights)
            gx = (g2 @ w).view(bsz, -1, w.shape[1])  # (b, s, h)
            if group is not None:  # summed over TP, this rank's rows kept: behind gw's matmuls
                full = gx.transpose(0, 1)  # (s, b, h)
                gx = full.new_empty((full.shape[0] // group.size, *full.shape[1:]))
                scatter = comm.reduce_scatter(gx, full, group, async_op=True)
        if gather is not None:
            gather.wait()
        x2 = x.reshape(-1, x.shape[-1])  # (tokens, h)
        parts = g2.split([w.shape[0] for w in weights], dim=1)
        gw = [p.t() @ x2 if want else None for p, want in zip(parts, want_w)]
        gb = [g2.sum(0) if _wanted(ctx, 1 + ctx.n) else None] if ctx.bias else []
        if scatter is not None:
            scatter.wait()
            gx = gx.transpose(0, 1).contiguous()  # (b, s/t, h)
        return None, None, None, gx, *gw, *gb


_joined_linear = _JoinedLinear.apply
# with a group it communicates: eager under torch.compile, as comm.py's collectives
_joined_linear_gathered = comm.graph_break(_JoinedLinear.apply)


def fused_column_linear(x: torch.Tensor, layers, fused: bool = True) -> tuple[torch.Tensor, ...]:
    """The outputs of column-parallel layers that read the same input x, the block's input not
    yet entered into the TP region (q, k, v; gate, up; a GeLU MLP's up alone), each keeping its
    own logical parameter.
    `fused` (training): one matmul, its output split into views; with `ops.linear` F.linear
    (the torch and Triton ops) and autograd on, backward keeps the weights themselves and, with
    sequence parallelism, this rank's rows of x only (`_JoinedLinear`). Another linear (FP8's,
    which joins the weights its own way: `concat`) runs on the concatenated weights, which its
    backward may keep. Not `fused` (decoding): each layer on its own, no weight copy."""
    first = layers[0]
    group, sequence_parallel, linear = first.group, first.sequence_parallel, first.ops.linear
    weights = [layer.weight for layer in layers]
    bias = () if first.bias is None else (torch.cat([layer.bias for layer in layers]),)
    joined = fused and linear is F.linear and torch.is_grad_enabled()  # `_JoinedLinear`
    if joined and sequence_parallel and group.size > 1:
        n = _pieces(group, x.shape[1], first.overlap)
        y = _joined_linear_gathered(group, n, len(weights), x, *weights, *bias)
        return y.split([w.shape[0] for w in weights], dim=-1)
    x = enter_tp_region(x, group, sequence_parallel)
    if joined:
        y = _joined_linear(None, 1, len(weights), x, *weights, *bias)
    elif fused and len(layers) > 1:
        y = linear(x, getattr(linear, "concat", torch.cat)(weights), *bias)
    else:
        return [layer(x) for layer in layers]
    return y.split([w.shape[0] for w in weights], dim=-1)


class _RowScattered(torch.autograd.Function):
    """y = x W^T reduce-scattered along the sequence over `group` (a row-parallel layer with
    sequence parallelism), in `pieces`: x (b, s, in/t) -> (b, s/t, out), each piece's rows (of
    every member's share) reduce-scattered while the next piece's matmul runs. Backward
    all-gathers the output gradient piece by piece, each piece's input gradient made while the
    next one arrives, and the weight gradient in one matmul once all are in."""

    @staticmethod
    def forward(ctx, group, pieces, x, w):
        t, bsz = group.size, x.shape[0]
        xs = x.unflatten(1, (t, pieces, -1))  # (b, t, pieces, r, in/t)
        out = x.new_empty((pieces, xs.shape[3], bsz, w.shape[0]))  # this rank's rows, by piece
        works = []
        for j in range(pieces):
            part = F.linear(xs[:, :, j], w).permute(1, 2, 0, 3).flatten(0, 1)  # (t * r, b, out)
            works.append(comm.reduce_scatter(out[j], part, group, async_op=True))
        for work in works:
            work.wait()
        ctx.group, ctx.lead, ctx.pieces = group, 2, pieces
        ctx.save_for_backward(x, w)
        return out.permute(2, 0, 1, 3).reshape(bsz, -1, w.shape[0])

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        group, t, n = ctx.group, ctx.group.size, ctx.pieces
        pieces = _gather_pieces(g, group, n)  # each (t * r, b, out)
        xs = x.unflatten(1, (t, n, -1))
        gx = x.new_empty(xs.shape) if _wanted(ctx, 0) else None
        for j, (work, buf) in enumerate(pieces):
            work.wait()
            if gx is not None:
                gx[:, :, j] = _sequence_rows(buf, t) @ w
        gw = None
        if _wanted(ctx, 1):  # (pieces, t, r, b, ...) on both sides: one matmul, in x's precision
            gs = torch.stack([buf for _, buf in pieces]).flatten(0, -2)
            gw = gs.t() @ xs.permute(2, 1, 3, 0, 4).reshape(gs.shape[0], -1)
        return None, None, None if gx is None else gx.view_as(x), gw


_row_scattered = comm.graph_break(_RowScattered.apply)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W (out, in) split along in: x arrives split (b, s, in/tp), the partial
    products are summed over TP (reduce-scattered along the sequence with sequence parallelism,
    piece by piece behind the matmul with `overlap`: --tp-comm-overlap)."""

    def __init__(
        self,
        in_features,
        out_features,
        group: Group,
        bias=True,
        sequence_parallel=False,
        dtype=None,
        device=None,
        ops=TORCH_OPS,
        overlap=False,
    ):
        super().__init__()
        self.group, self.sequence_parallel, self.overlap = group, sequence_parallel, overlap
        self.ops = own_linear(ops, **{"in": group})
        if in_features % group.size:
            raise ValueError(f"in_features={in_features} is not divisible by tp={group.size}")
        kw = {"dtype": dtype, "device": device}
        self.weight = mark(
            nn.Parameter(torch.empty(out_features, in_features // group.size, **kw)),
            **shard_spec(group, 1),
        )
        self.bias = None
        if bias:
            # added after the reduction: replicated; with SP each rank adds it to its own rows only
            self.bias = mark(nn.Parameter(torch.zeros(out_features, **kw)),
                             **shard_spec(group, None, sequence_parallel, no_weight_decay=True))  # fmt: skip

    def forward(self, x):
        g = self.group
        n = _pieces(g, x.shape[1] // g.size, self.overlap) if self.sequence_parallel else 1
        if n > 1 and self.ops.linear is F.linear:  # --tp-comm-overlap
            y = _row_scattered(g, n, x, self.weight)
        else:
            y = exit_tp_region(self.ops.linear(x, self.weight), g, self.sequence_parallel)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding table (V, h) split by rows: rank r holds tokens [r V/tp, (r+1) V/tp). Tokens
    outside the slice look up zeros; the sum over TP gives every token its row."""

    def __init__(
        self, num_embeddings, dim, group: Group, sequence_parallel=False, dtype=None, device=None
    ):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        if num_embeddings % group.size:
            raise ValueError(f"num_embeddings={num_embeddings} is not divisible by tp={group.size}")
        self.per_rank = num_embeddings // group.size
        self.start = group.rank * self.per_rank
        self.weight = mark(
            nn.Parameter(torch.empty(self.per_rank, dim, dtype=dtype, device=device)),
            **shard_spec(group, 0, vocab_dim=0),
        )

    def forward(self, ids):  # (b, s) -> (b, s, h), or (b, s/tp, h) with sequence parallelism
        if self.group.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return exit_tp_region(out, self.group, self.sequence_parallel)
