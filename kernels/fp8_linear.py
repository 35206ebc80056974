"""FP8 linear layers: an `ops.linear` whose three GEMMs run on FP8 operands, in the recipes of
kernels/fp8.py (formats, scales, casts, the scaled GEMM).

y = x w^T runs on e4m3 x and w; backward's grad_x = g w and grad_w = g^T x run on the output
gradient g in e5m2 (`hybrid`) or e4m3. A `Fp8Linear` knows which group shards each logical dim
of its GEMMs and max-reduces an amax over them before a scale is computed (`reduce_max`,
injected by the layer: this file imports nothing from megalite.parallel), so every layout
quantises like one process. `Fp8Maker` is `ops.fp8_linear`: the linear of a layer, or none
(`NO_FP8`, the default); `end_step` closes delayed scaling's step.
"""

from types import SimpleNamespace

import torch
from megalite.kernels.fp8 import TORCH_CASTS, AmaxHistory, Quantised, Recipe, TorchCasts


class _Fp8Matmul(torch.autograd.Function):
    """x (m, in) @ w (out, in)^T on FP8 operands; backward's two GEMMs on FP8 too."""

    @staticmethod
    def forward(ctx, x, w, op):
        r, fwd = op.recipe, op.recipe.format.forward
        xq = r.quantise(op, x, "x", fwd, ("tokens", "in"))
        wq = op.gathered or r.quantise(op, w, "w", fwd, ("out", "in"))
        if wq.data.shape != w.shape:
            raise RuntimeError(f"FP8 gathered weight {tuple(wq.data.shape)} is not the "
                               f"weight {tuple(w.shape)} this linear was called with")  # fmt: skip
        ctx.op = op
        if r.transposable:  # keep the FP8 copies (a quarter of fp32's bytes)
            ctx.save_for_backward(xq.data, xq.scale, wq.data, wq.scale)
        else:
            ctx.save_for_backward(x, w)
        ctx.dtypes = (x.dtype, w.dtype)
        return r.gemm(xq, wq, x.dtype)  # (m, out)

    @staticmethod
    def backward(ctx, g):
        op = ctx.op
        op.recording = True  # a backward belongs to a training step
        r, fwd, bwd = op.recipe, op.recipe.format.forward, op.recipe.format.backward
        g = g.contiguous()
        if r.transposable:
            xd, xs, wd, ws = ctx.saved_tensors
            gq = r.quantise(op, g, "g", bwd, ("tokens", "out"))
            w_t, g_t, x_t = Quantised(wd, ws).t(), gq.t(), Quantised(xd, xs).t()
        else:
            x, w = ctx.saved_tensors
            gq = r.quantise(op, g, "g", bwd, ("tokens", "out"))
            w_t = r.quantise(op, w.t().contiguous(), "w_t", fwd, ("in", "out"))
            g_t = r.quantise(op, g.t().contiguous(), "g_t", bwd, ("out", "tokens"))
            x_t = r.quantise(op, x.t().contiguous(), "x_t", fwd, ("in", "tokens"))
        gx = r.gemm(gq, w_t, ctx.dtypes[0])  # (m, out) @ (out, in) -> (m, in)
        gw = r.gemm(g_t, x_t, ctx.dtypes[1])  # (out, m) @ (m, in) -> (out, in)
        return gx, gw, None


class _Unread(torch.autograd.Function):
    """torch.cat's shape and gradient without reading the weights (an expanded zero)."""

    @staticmethod
    def forward(ctx, *weights):
        ctx.rows = [w.shape[0] for w in weights]
        w = weights[0]
        return w.new_zeros(()).expand(sum(ctx.rows), *w.shape[1:])

    @staticmethod
    def backward(ctx, g):
        return g.split(ctx.rows)


class Fp8Linear:
    """`ops.linear` in FP8 for one layer: `(x, w, b=None)` with F.linear's meaning. It holds the
    layer's delayed-scaling state and `shards`: logical dim ("tokens", "in", "out") -> the group
    that splits it, whose ranks `reduce_max(amax, group)` max-reduces an amax over in place."""

    def __init__(self, recipe: Recipe, shards: dict | None = None, reduce_max=None,
                 casts: TorchCasts = TORCH_CASTS):  # fmt: skip
        self.recipe, self.reduce_max, self.recording = recipe, reduce_max, True
        self.casts = casts  # amax and cast: torch, or the fused Triton kernels on CUDA
        # --fp8-param-gather: the FP8 weight (Quantised) ZeRO-3 gathered (parallel/fp8_gather.py),
        # used instead of quantising the weight it is called with, which is then never read
        self.gathered = None
        self.shards = {k: g for k, g in (shards or {}).items() if g is not None and g.size > 1}
        fmt = recipe.format
        roles = {"x": fmt.forward, "w": fmt.forward, "g": fmt.backward}
        self.state = {k: recipe.new_state(k, d) for k, d in roles.items()}

    def reduce(self, amax: torch.Tensor, dims):
        """amax over the given logical dims, made global: max over each group sharding one."""
        for d in dims:
            if d in self.shards:
                self.reduce_max(amax, self.shards[d])

    def __call__(self, x, w, b=None):
        # read here: inside the autograd Function grad mode is always off
        self.recording = torch.is_grad_enabled()
        y = _Fp8Matmul.apply(x.reshape(-1, x.shape[-1]), w, self)
        y = y.view(*x.shape[:-1], w.shape[0])
        return y if b is None else y + b

    def concat(self, weights: list) -> torch.Tensor:
        """The weights of fused layers (q, k, v; gate, up) as this linear's one weight: their
        concatenation, or with a gathered FP8 weight a stand-in of its shape that reads none of
        them (their storage is not gathered) and passes the gradient back to each."""
        if self.gathered is None:
            return torch.cat(weights)
        return _Unread.apply(*weights)

    def histories(self) -> list:
        return list(self.named_histories().values())

    def named_histories(self) -> dict:
        """{role ("x", "w", "g"): AmaxHistory} of delayed scaling (empty for other recipes)."""
        return {k: s for k, s in self.state.items() if isinstance(s, AmaxHistory)}


def covers(layer: int, num_layers: int, first_last_high: bool) -> bool:
    """Whether transformer layer `layer` (of `num_layers`) runs its linears in FP8 when FP8 is
    on: all but the first and last with --fp8-first-last-layers-bf16 (`first_last_high`)."""
    return not (first_last_high and layer in (0, num_layers - 1))


class Fp8Maker:
    """What `ops.fp8_linear` holds: builds each FP8-eligible layer's own `Fp8Linear` from the
    groups that shard its weight's dims (`shards`) and the layer's collective
    (`reduce_max(amax, group)`); `tokens` is the group that splits every activation's tokens
    (context parallelism); `casts`: how operands are quantised (`ops.fp8_casts`: TORCH_CASTS, or
    the fused Triton kernels of kernels/fp8_cast.py on CUDA)."""

    def __init__(self, recipe: Recipe | None = None, tokens=None, first_last_high=False,
                 casts: TorchCasts = TORCH_CASTS):  # fmt: skip
        self.recipe, self.tokens, self.first_last_high = recipe, tokens, first_last_high
        self.casts = casts

    def covers(self, layer: int, num_layers: int) -> bool:
        """Whether transformer layer `layer` (of `num_layers`) runs its linears in FP8."""
        return covers(layer, num_layers, self.first_last_high)

    def __call__(self, shards: dict, reduce_max=None) -> Fp8Linear | None:
        """The layer's FP8 linear; None without a recipe (NO_FP8): it keeps `ops.linear`."""
        if self.recipe is None:
            return None
        return Fp8Linear(self.recipe, {"tokens": self.tokens, **shards}, reduce_max, self.casts)


NO_FP8 = Fp8Maker()  # the default `ops.fp8_linear`: every layer keeps `ops.linear`


def layer_ops(ops, layer: int, num_layers: int):
    """The ops of transformer layer `layer`: `fp8_linear` NO_FP8 where the maker keeps that
    layer in high precision (`--fp8-first-last-layers-bf16`), else `ops` itself."""
    make = getattr(ops, "fp8_linear", NO_FP8)
    if make.covers(layer, num_layers):
        return ops
    return SimpleNamespace(**{**vars(ops), "fp8_linear": NO_FP8})


def fp8_linears(modules) -> list[Fp8Linear]:
    """Every distinct Fp8Linear the modules' layers call (their `ops.linear`)."""
    seen = {}
    for m in modules:
        lin = getattr(getattr(m, "ops", None), "linear", None)
        if isinstance(lin, Fp8Linear):
            seen[id(lin)] = lin
    return list(seen.values())


def end_step(linears, reduce=None):
    """After the optimizer step: every delayed-scaling tensor's amax of the step, max-reduced at
    once (`reduce(t)` in place: over the ranks that hold the same layers, in one collective),
    pushed into its history, and the next step's scales. A no-op for the other recipes."""
    states = [(lin.recipe, s) for lin in linears for s in lin.histories()]
    if not states:
        return
    amax = torch.stack([s.pending for _, s in states])
    if reduce is not None:
        reduce(amax)
    for (recipe, s), a in zip(states, amax):
        recipe.push(s, a)
