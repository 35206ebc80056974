"""Megatron's tensor-parallel layers: each holds 1/tp of a logical weight.

A column-parallel linear splits the output features, a row-parallel one the input features, so
an attention or MLP block needs one all-reduce forward (or, with sequence parallelism, an
all-gather before and a reduce-scatter after). Layers record how they split each parameter in
its `ParamSpec` (specs.py); the model initialises every logical tensor whole from the seed and
keeps its slice, so any tp starts identical. Their matmuls are `ops.linear` (megalite.kernels:
the seam for another implementation, an FP8 one say); the fused ones (`fused_column_linear`)
run an autograd function of their own when that is F.linear, which keeps for backward what
Megatron's keep: the weights, and with sequence parallelism the input's local rows.
"""

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
    a model chunk builds and hands to each of its layers, so turning it off for inference
    (`GPTChunk.full_sequences`) reaches them all. Anything that takes `sequence_parallel`
    accepts it or a plain bool (a layer built on its own)."""

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
    fewer query groups than TP ranks); its gradient is then summed over TP.
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
    ):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
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
    """Whether `_JoinedLinear`'s backward must make the gradient of its tensor input i (x, the
    weights, the bias): it needs one and the engine runs the node it goes to (a split
    backward's I wants the input's only, its W the weights': pipeline/split_backward.py), as
    torch's own matmul backward decides."""
    if not ctx.needs_input_grad[2 + i]:  # after `group` and `n`
        return False
    if torch.compiler.is_compiling():  # a compiled backward is whole (compile.py): make it
        return True
    try:
        return torch._C._will_engine_execute_node(ctx.next_functions[i][0])
    except RuntimeError:  # autograd.grad towards a leaf: the engine cannot tell; make it
        return True


class _JoinedLinear(torch.autograd.Function):
    """y = x [w_1; ...; w_n]^T + b in one matmul, keeping for backward the weights themselves
    (not their concatenation: that would be a copy per micro-batch) and x, or with `group`
    (x gathered along the sequence over it) only this rank's (b, s/t, h) rows: backward gathers
    them again (counted in comm.py), overlapped with the input gradient's matmul, as Megatron
    does. The gradients are F.linear's on the concatenated weight."""

    @staticmethod
    def forward(ctx, group, n, x, *params):  # params: n weights, then the joined bias if any
        weights, b = params[:n], (params[n] if len(params) > n else None)
        y = F.linear(x, torch.cat(weights), b)  # (b, s, sum of out)
        keep = x
        if group is not None:  # a copy of this rank's rows (s/t, b, h), the layout the gather
            rows = x.shape[1] // group.size  # fills (at b = 1 contiguous() would keep a view)
            keep = x.narrow(1, group.rank * rows, rows).transpose(0, 1)
            keep = keep.clone(memory_format=torch.contiguous_format)
        ctx.group, ctx.n, ctx.bias, ctx.x_shape = group, n, b is not None, x.shape
        ctx.save_for_backward(keep, *weights)
        return y

    @staticmethod
    def backward(ctx, g):
        keep, *weights = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])  # (tokens, sum of out)
        want_w = [_wanted(ctx, 1 + i) for i in range(ctx.n)]
        x, work = keep, None
        if ctx.group is not None and any(want_w):
            x = keep.new_empty((keep.shape[0] * ctx.group.size, *keep.shape[1:]))  # (s, b, h)
            work = comm.all_gather(x, keep, ctx.group, async_op=True)
        gx = None
        if _wanted(ctx, 0):  # the joined weight again, for this matmul only
            gx = (g2 @ torch.cat(weights)).view(ctx.x_shape)
        if work is not None:
            work.wait()
        if ctx.group is not None:
            x = x.transpose(0, 1)  # (b, s, h)
        x2 = x.reshape(-1, x.shape[-1])  # (tokens, h)
        parts = g2.split([w.shape[0] for w in weights], dim=1)
        gw = [p.t() @ x2 if want else None for p, want in zip(parts, want_w)]
        gb = [g2.sum(0) if _wanted(ctx, 1 + ctx.n) else None] if ctx.bias else []
        return None, None, gx, *gw, *gb


_joined_linear = _JoinedLinear.apply
# with a group its backward gathers: eager under torch.compile, as comm.py's collectives
_joined_linear_gathered = torch.compiler.disable(_JoinedLinear.apply)


def fused_column_linear(x: torch.Tensor, layers) -> tuple[torch.Tensor, ...]:
    """One matmul for column-parallel layers that read the same input x, the block's input
    entered into the TP region (q, k, v; gate, up), each keeping its own logical parameter; the
    output is split into views. With `ops.linear` F.linear (the torch and Triton ops) and
    autograd on, backward keeps the weights themselves and, with sequence parallelism, this
    rank's rows of x only (`_JoinedLinear`). Another linear (FP8's, which joins the weights its
    own way: `concat`) runs on the concatenated weights, which its backward may keep."""
    linear = layers[0].ops.linear
    weights = [layer.weight for layer in layers]
    bias = () if layers[0].bias is None else (torch.cat([layer.bias for layer in layers]),)
    if linear is F.linear and torch.is_grad_enabled():
        group = layers[0].group
        if layers[0].sequence_parallel and group.size > 1:
            y = _joined_linear_gathered(group, len(weights), x, *weights, *bias)
        else:
            y = _joined_linear(None, len(weights), x, *weights, *bias)
    else:
        join = getattr(linear, "concat", torch.cat)
        y = linear(x, join(weights), *bias)
    return y.split([w.shape[0] for w in weights], dim=-1)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W (out, in) split along in: x arrives split (b, s, in/tp), the partial
    products are summed over TP (reduce-scattered along the sequence with sequence parallelism)."""

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
    ):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
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
        y = exit_tp_region(self.ops.linear(x, self.weight), self.group, self.sequence_parallel)
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
