"""--fp8-param-gather: ZeRO-3 gathers the weights of FP8 linears as FP8 data and a scale.

An FP8 linear (kernels/fp8_linear.py `Fp8Linear`) quantises the weight it multiplies by anyway, with
one scale per tensor under the tensorwise and delayed recipes. Gathering that weight in FP8 (1
byte per element instead of bf16's 2 or fp32's 4) hands the linear the very FP8 values it would
have computed from the gathered weight, provided the scale is the whole weight's: each rank
takes the amax of its shard of every weight in the bucket, the amaxes are max-reduced over the
gather group in one small all-reduce (then over tp by the linear, as for any weight), each rank
casts its shard with that scale, and the FP8 shards are all-gathered. The same FP8 operand bit
for bit, so a run equals the same FP8 run without the flag (tests/distributed/test_zero3.py).

Fused layers (q, k, v; gate, up: tensor_parallel.fused_column_linear) are quantised as one
concatenated weight by the first layer's linear: their weights form one group with one scale,
laid out one after the other in the unit's FP8 bucket, so the group is one contiguous FP8 view
(and `Fp8Linear.concat` stands in for the concatenation without reading the weights).

The shards the optimizer updates (fp32 masters, `--precision` shards) are untouched; only what
travels is FP8. The high-precision weights of an FP8 bucket are gathered only where something
reads them whole (`Zero3Buffer.gathered`: checkpoints, tests).
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megalite.kernels.fp8 import Quantised
from megalite.kernels.fp8_linear import Fp8Linear
from megalite.parallel import comm
from megalite.parallel.buckets import Bucket
from megalite.parallel.comm import Group
from megalite.parallel.tensor_parallel import ColumnParallelLinear


@dataclass(eq=False)
class WeightGroup:
    """Weights one FP8 linear quantises as one tensor (fused layers' concatenation, or one
    layer's weight), and where they sit in their bucket."""

    linear: Fp8Linear
    params: list
    start: int = 0  # offset in the bucket
    shape: tuple = field(default=())
    data: torch.Tensor | None = None  # its FP8 data in the bucket's FP8 copy

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


def weight_groups(chunks, check: bool = True) -> list[WeightGroup]:
    """Every group of weights an FP8 linear quantises together: the column-parallel layers of
    one parent that share its input (`enter=False`, fused by the parent's forward) are one group
    under the first one's linear; any other FP8 layer's weight is a group of its own. `check`:
    refuse a recipe whose backward needs the high-precision weight (rowwise, mxfp8)."""
    groups = []
    for chunk in chunks:
        for parent in chunk.modules():
            fused = []
            for child in parent.children():
                lin = getattr(getattr(child, "ops", None), "linear", None)
                if not isinstance(lin, Fp8Linear):
                    continue
                if check and not lin.recipe.transposable:
                    raise ValueError(f"--fp8-param-gather needs a per-tensor FP8 recipe "
                                     f"(tensorwise, delayed), not {lin.recipe.name}")  # fmt: skip
                if isinstance(child, ColumnParallelLinear) and not child.enter:
                    fused.append(child)
                else:
                    groups.append(WeightGroup(lin, [child.weight]))
            if fused:
                groups.append(WeightGroup(fused[0].ops.linear, [c.weight for c in fused]))
    return groups


class Fp8Gather:
    """The FP8 side of one ZeRO-3 bucket that holds FP8 weights (`groups`): its FP8 copy
    `full8` (bytes; its storage freed and re-allocated like the bucket's full tensor) and the
    cast and gather of this rank's `shard` of the parameters into it. `offset_of`: parameter
    -> flat offset."""

    def __init__(self, bucket: Bucket, shard: torch.Tensor, groups: list[WeightGroup],
                 offset_of: dict):  # fmt: skip
        self.bucket, self.shard, self.groups = bucket, shard, groups
        self.full8 = torch.zeros(bucket.numel, dtype=torch.uint8, device=shard.device)
        for g in groups:
            g.start = offset_of[g.params[0]] - bucket.start
            at = g.start
            for p in g.params:  # one contiguous FP8 view per group
                if offset_of[p] - bucket.start != at:
                    raise ValueError("the weights of fused FP8 layers must be consecutive")
                at += p.numel()
            g.shape = (sum(p.shape[0] for p in g.params), *g.params[0].shape[1:])
            # the group's FP8 view of full8's storage, with a version counter of its own: the
            # gathers write full8 in place, and backward reads the view it saved in forward
            # once the unit is gathered again (as autograd's saved weights, docs/zero3.md)
            dtype = g.linear.recipe.format.forward
            g.data = torch.empty(0, dtype=dtype, device=self.full8.device)
            g.data.set_(self.full8.untyped_storage(), g.start, g.shape)

    def start(self, group: Group, record: bool):
        """Cast this rank's shard to FP8 with each weight's whole-tensor scale and start the
        all-gather into `full8` (returns its work). `record`: delayed scaling counts the amax
        (a training forward's gather, not backward's or an evaluation's)."""
        b = self.bucket
        lo, hi = b.dp_start - b.start, b.shard_end - b.start
        shard = self.shard.detach()
        spans = [(max(g.start, lo) - lo, min(g.start + g.numel, hi) - lo) for g in self.groups]
        zero = torch.zeros((), dtype=torch.float32, device=shard.device)
        amax = torch.stack([shard[a:z].abs().amax().float() if a < z else zero for a, z in spans])
        comm.all_reduce(amax, group, op=dist.ReduceOp.MAX)  # each weight's amax over the shards
        out = torch.zeros(hi - lo, dtype=torch.uint8, device=shard.device)
        for g, (a, z), m in zip(self.groups, spans, amax):
            r = g.linear.recipe
            dtype = r.format.forward
            scale = r.scale(g.linear, m.clone(), "w", dtype, ("out", "in"), record)
            if a < z:
                out[a:z] = g.linear.casts.cast(shard[a:z], scale, dtype).view(torch.uint8)
            g.linear.gathered = Quantised(g.data, scale.reciprocal())
        return comm.all_gather(self.full8, out, group, async_op=True)

    def release(self):
        """The linears quantise the weights they are called with again (gathered whole, or
        freed: then gathered again by the unit's hooks before any use)."""
        for g in self.groups:
            g.linear.gathered = None


def fp8_buckets(shards: dict, groups: list[WeightGroup], offset_of: dict) -> dict:
    """Bucket -> its Fp8Gather, for the buckets that hold the groups' weights. `shards`:
    bucket -> this rank's shard of its parameters."""
    bucket_of = {p: b for b in shards for p in b.params}
    per = {}
    for g in groups:
        per.setdefault(bucket_of[g.params[0]], []).append(g)
    return {b: Fp8Gather(b, shards[b], gs, offset_of) for b, gs in per.items()}
