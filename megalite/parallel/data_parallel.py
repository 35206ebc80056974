"""Data parallelism: gradients in contiguous buckets, reduced over DP while backward still runs.

Every parameter of this rank (all its pipeline chunks) becomes a view into one flat parameter
buffer, so ZeRO can all-gather updated shards straight into the model. Gradients accumulate in
a flat gradient buffer of the same layout (fp32 when parameters are bf16/fp16, so micro-batch
sums keep their bits), Megatron's `main_grad`. The layout is cut into buckets of about
`bucket_size_mb`; a bucket never spans two chunks and is padded to a multiple of the DP size,
so each bucket splits into DP shards, the unit of the ZeRO optimizer.

A post-accumulate-grad hook hands each parameter's fresh `.grad` to the reducer the ZeRO stage
picks (zero.py, reducers.py). Once every parameter of a bucket has its gradient for the last
micro-batch of the step (earlier micro-batches only accumulate: no_sync), the bucket's reduction
is launched asynchronously, so it overlaps the rest of backward. Gradients are divided by the DP
size before they are summed (a mean). Without a gradient buffer (ZeRO-2) a micro-batch's bucket
is staged only while it is reduced: it is freed as soon as its reduce-scatter lands (at most the
stage's `in_flight` + 1 staged at once).

`build_buffers` (at the end) is where the build step applies data parallelism: it picks the
buffers for the stage (GradBuffer; GradBuffers with experts; zero3.Zero3Buffer) and hands them
to the optimizer, which reads them through parallel/buffers.Buffers.

With sharded optimizer state each rank updates its shard of every bucket, then the buckets are
all-gathered back into the parameter buffer. `all_gather_params(overlap=True)` launches the
gathers in forward order and returns; a forward pre-hook on each module waits for the buckets
holding that module's parameters (a plain container's, such as the untied head's, when they are
read from it), so the gathers of later layers overlap the forward of earlier ones (Megatron's
--overlap-param-gather). `wait_params` waits for all (checkpoints).

"DP" here is the group of ranks ZeRO shards over (`ProcessGroups.zero_shard`: dp, or the product
of every replicated axis that shards). Hybrid sharding (--dp-replicate) adds `shard_copies`, the
copies of that group holding the same shards: after the reductions over DP each rank's shard
is all-reduced over its copies (reducers.StepReducer.finish), the parameters are gathered over
DP alone, and the gradients are divided by dp x shard_copies (the mean over every replica).
"""

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from megalite.config import Config
from megalite.parallel import comm
from megalite.parallel.buckets import (
    ALIGN,
    Bucket,
    ParamRange,
    bucket_layout,
    bucket_numel,
    grad_dtype,
    trainable,
)
from megalite.parallel.buffers import (
    Buffers,
    from_reducer,
    gather_shards,
    nbytes,
    place,
    saves,
    solo,
)
from megalite.parallel.comm import Group
from megalite.parallel.groups import ProcessGroups
from megalite.parallel.param_gather import wait_before_use, wait_gathers
from megalite.parallel.specs import spec_of
from megalite.parallel.zero import ZERO
from megalite.parallel.zero3 import Zero3Buffer


@dataclass(eq=False)
class Gather:
    """A bucket's parameter all-gather: `gather` is (work, source) from its launch
    (GradBuffer.all_gather_params) until it is waited for (param_gather.wait_gathers)."""

    gather: tuple | None = None


class GradBuffer:
    """The flat parameter and gradient buffers of one rank, their buckets and DP reduction."""

    def __init__(
        self,
        chunks: list[nn.Module],
        dp: Group,
        zero_stage: int = 0,
        bucket_size_mb: float | None = None,
        own_bucket=lambda name, p: False,
        select=lambda name, p: True,
        scale: float | None = None,
        shard_copies: Group | None = None,
        bf16_grads: bool = False,
    ):
        """`select(name, p)`: the parameters this buffer holds (default all); `scale`: what
        gradients are multiplied by before the sum over `dp` (default 1/(dp x shard_copies): a
        mean over the replicas; expert gradients, summed over fewer ranks than the replicas,
        take 1/replicas); `shard_copies`: the copies of the `dp` group (hybrid sharding; default
        none); `bf16_grads`: bf16 gradients (--grad-reduce-in-bf16, buckets.grad_dtype)."""
        named, self.param_dtype = trainable(chunks, select)
        params = [x for c in named for x in c]
        self.dp, self.zero = dp, ZERO[zero_stage]
        self.shard_copies = shard_copies or solo(dp)
        if self.zero.shard_params:
            raise ValueError("ZeRO-3 shards the parameters: build a zero3.Zero3Buffer")
        self.scale = 1.0 / (dp.size * self.shard_copies.size) if scale is None else scale
        self.grad_dtype = grad_dtype(self.param_dtype, bf16_grads)
        size = torch.empty((), dtype=self.grad_dtype).element_size()
        per_bucket = bucket_numel(bucket_size_mb, dp.size, size)
        by_name = dict(params)
        chunk_of = {n: c for c, named_c in enumerate(named) for n, _ in named_c}
        layout = bucket_layout(
            [[(n, p.numel(), own_bucket(n, p)) for n, p in c] for c in named],
            per_bucket, dp.size * ALIGN,
        )  # fmt: skip
        self.numel = layout[-1][1] if layout else 0
        device = params[0][1].device
        self.param_buffer = torch.zeros(self.numel, dtype=self.param_dtype, device=device)
        grads = self.grad_buffer = None
        if self.zero.grad_buffer:
            grads = self.grad_buffer = torch.zeros(self.numel, dtype=self.grad_dtype, device=device)

        def shard_grad(lo: int, hi: int) -> torch.Tensor:  # a view of the buffer, else its own
            if grads is not None:
                return grads[lo:hi]
            return torch.zeros(hi - lo, dtype=self.grad_dtype, device=device)

        self.buckets: list[Bucket] = []
        self.ranges: list[ParamRange] = []
        for start, end, ranges in layout:
            b = place(start, end, [by_name[n] for n, _, _ in ranges], chunk_of[ranges[0][0]],
                      dp, self.shard_copies, self.zero.shard_state, shard_grad)  # fmt: skip
            self.buckets.append(b)
            self.ranges += [ParamRange(n, by_name[n], o, b) for n, o, _ in ranges]
        with torch.no_grad():
            for r in self.ranges:
                view = self.param_buffer[r.offset : r.offset + r.param.numel()].view_as(r.param)
                view.copy_(r.param)
                r.param.data = view  # the model now reads the flat buffer
        grad_is_view = self.grad_buffer is not None and self.grad_dtype == self.param_dtype
        self.reducer = self.zero.reducer(
            self.buckets, self.ranges, dp, self.scale, self.zero.in_flight, self.grad_buffer,
            grad_is_view, shard_copies=self.shard_copies,
        )  # fmt: skip
        # nothing to reduce and `.grad` a view of the buffer: autograd's accumulation is all
        # (else finish() "reduces" the buffer as it is)
        if dp.size * self.shard_copies.size > 1 or not grad_is_view:
            for r in self.ranges:
                r.param.register_post_accumulate_grad_hook(self.reducer.on_grad)
        self.gathers = {b: Gather() for b in self.buckets}  # in flight after a step
        if self.zero.shard_state and dp.size > 1:
            self._wait_before_forward(chunks)
        self.zero_grad(1)

    def _wait_before_forward(self, chunks: list[nn.Module]):
        """Each parameter's gather is waited for right before it is read (param_gather.py)."""
        order = {self.gathers[b]: i for i, b in enumerate(self._forward_order())}
        wait_before_use(chunks, {r.param: self.gathers[r.bucket] for r in self.ranges}, order)

    def _forward_order(self) -> list[Bucket]:
        """The buckets in the order the forward reads them: chunk by chunk, each chunk's
        buckets from the last laid out (layout runs backward)."""
        return sorted(self.buckets, key=lambda b: (b.chunk, -b.start))

    # ---- the step's life cycle (the reducer's) -------------------------------------------

    staged_bytes = from_reducer("staged_bytes")  # gradient buckets staged now (no buffer)
    peak_staged_bytes = from_reducer("peak_staged_bytes")  # the most staged at once so far

    def zero_grad(self, microbatches: int):
        """Start a step of `microbatches` backward passes per parameter."""
        self.reducer.zero_grad(microbatches)

    def wait(self):
        self.reducer.wait()

    def finish(self):
        """Reduce whatever backward did not launch (unused parameters, fewer passes than
        expected, a partly staged bucket) and wait for every reduction (and the copies')."""
        self.reducer.finish()

    def launch_rest(self):
        """Launch the reductions backward did not (finish() without the wait)."""
        self.reducer.launch_rest()

    # ---- ZeRO helpers ---------------------------------------------------------------------

    def group_of(self, b: Bucket) -> Group:
        """The group a bucket is reduced and sharded over."""
        return self.dp

    def param_shard(self, b: Bucket) -> torch.Tensor:
        return self.param_buffer[b.shard_start : b.shard_end]

    def all_gather_params(self, overlap: bool = False):
        """Every rank updated its shards; give every rank every bucket (sharded state). With
        `overlap` the gathers are launched in forward order and waited for by the modules that
        read them (or `wait_params`); otherwise waited for here."""
        if not self.zero.shard_state or self.dp.size == 1:
            return
        for b in self._forward_order():
            # The shard is part of the output: gather from a copy rather than rely on the
            # backend handling overlapping input and output.
            src = self.param_shard(b).clone()
            out = self.param_buffer[b.start : b.end]
            self.gathers[b].gather = (comm.all_gather(out, src, self.dp, async_op=True), src)
        if not overlap:
            self.wait_params()

    def wait_params(self):
        """Wait for every parameter gather still in flight."""
        wait_gathers(self.gathers.values())

    # ---- what the optimizer and checkpoints ask every buffer ------------------------------

    @contextmanager
    def gathered(self, write_back: bool = False):
        """Every parameter whole in the block: here the flat parameter buffer always is, once
        its gathers have landed (a Zero3Buffer gathers its shards; `write_back` is for it)."""
        self.wait_params()
        yield

    def memory_bytes(self) -> dict:
        """Bytes this rank holds for parameters and gradients."""
        grads = [self.grad_buffer] if self.grad_buffer is not None else [
            b.shard_grad for b in self.buckets]  # fmt: skip
        return {"param_bytes": nbytes([self.param_buffer]), "grad_bytes": nbytes(grads)}

    def saves(self, b: Bucket) -> bool:
        return saves(b, self.dp, self.shard_copies)

    def gather_shards(self, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        """Full-bucket tensors from this rank's per-bucket shards (collective over DP)."""
        return gather_shards(self.buckets, shards, self.dp) if self.zero.shard_state else shards


class GradBuffers:
    """Several gradient buffers seen as one by the optimizer, their buckets in order: with
    experts, the dense parameters reduced (and ZeRO-sharded) over the replicas and the expert
    parameters over their expert-data-parallel group (`groups.edp`)."""

    def __init__(self, parts: list[GradBuffer]):
        self.parts = parts
        self.buckets = [b for p in parts for b in p.buckets]
        self.ranges = [r for p in parts for r in p.ranges]
        self._owner = {b: p for p in parts for b in p.buckets}
        self.param_dtype, self.grad_dtype = parts[0].param_dtype, parts[0].grad_dtype
        if any(p.param_dtype != self.param_dtype for p in parts):
            raise ValueError("all parameters must share one dtype")

    def group_of(self, b: Bucket) -> Group:
        return self._owner[b].dp

    def param_shard(self, b: Bucket) -> torch.Tensor:
        return self._owner[b].param_shard(b)

    @property
    def staged_bytes(self) -> int:
        return sum(p.staged_bytes for p in self.parts)

    @property
    def peak_staged_bytes(self) -> int:
        return sum(p.peak_staged_bytes for p in self.parts)

    def zero_grad(self, microbatches: int):
        for p in self.parts:
            p.zero_grad(microbatches)

    def finish(self):
        for p in self.parts:  # launch every part's reductions before waiting for any
            p.launch_rest()
        for p in self.parts:
            p.finish()

    def wait(self):
        for p in self.parts:
            p.wait()

    def all_gather_params(self, overlap: bool = False):
        for p in self.parts:
            p.all_gather_params(overlap)

    def wait_params(self):
        for p in self.parts:
            p.wait_params()

    @contextmanager
    def gathered(self, write_back: bool = False):
        self.wait_params()  # (parts are GradBuffers: ZeRO-3 has no expert buffer)
        yield

    def memory_bytes(self) -> dict:
        out = {}
        for p in self.parts:
            for k, v in p.memory_bytes().items():
                out[k] = out.get(k, 0) + v
        return out

    def saves(self, b: Bucket) -> bool:
        return self._owner[b].saves(b)

    def gather_shards(self, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        out, i = [], 0
        for p in self.parts:
            out += p.gather_shards(shards[i : i + len(p.buckets)])
            i += len(p.buckets)
        return out


def build_buffers(chunks: list[nn.Module], groups: ProcessGroups, cfg: Config) -> Buffers:
    """Data parallelism applied to this rank's `chunks` at the configured ZeRO stage: every
    parameter becomes a view of its bucket and hooks hand its gradients to the stage's reducer;
    the optimizer steps what this returns. Dense parameters are reduced and sharded over the
    replicas; with MoE, expert parameters in a buffer of their own over their
    expert-data-parallel group. Expert gradients hold the tokens of the whole ep group, so they
    are summed over edp and divided by the replicas (the mean over data-parallel ranks, as dense
    gradients). With --dp-replicate the dense buffer shards over `groups.zero_shard` and
    all-reduces each shard over its copies (`groups.shard_copies`); the expert buffer is not
    hybrid (edp).
    ZeRO-3: a Zero3Buffer, its parameters kept gathered for the step under pp (1F1B interleaves
    micro-batches), from forward to backward with --zero3-keep-params, else freed after each
    use; with --fp8-param-gather the FP8 linears' weights are gathered in FP8
    (parallel/fp8_gather.py)."""
    # Tied halves get a bucket of their own: both stages then shard them identically, so the
    # sum over `embed` can run on the DP shards.
    own = lambda name, p: "embed" in spec_of(p).grad_sum  # noqa: E731
    expert = lambda name, p: spec_of(p).expert  # noqa: E731
    params = [(n, p) for c in chunks for n, p in c.named_parameters() if p.requires_grad]
    o = cfg.optimizer
    zero_stage, bucket_mb = o.zero_stage, o.bucket_size_mb
    low = cfg.training.grad_reduce_in_bf16  # Megatron's bf16 main_grad (buckets.grad_dtype)
    zero = ZERO[zero_stage]
    if zero.shard_params:
        if any(expert(n, p) for n, p in params):
            raise ValueError("ZeRO-3 does not shard expert parameters (validate() refuses it)")
        reshard = zero.reshard(groups.pp.size > 1, o.zero3_keep_params)
        fp8_gather = cfg.training.fp8_param_gather
        return Zero3Buffer(chunks, groups.zero_shard, reshard, own, fp8_gather, groups.shard_copies,
                           bf16_grads=low)  # fmt: skip
    if not any(expert(n, p) for n, p in params):
        return GradBuffer(chunks, groups.zero_shard, zero_stage, bucket_mb, own,
                          shard_copies=groups.shard_copies, bf16_grads=low)  # fmt: skip
    dense = GradBuffer(chunks, groups.zero_shard, zero_stage, bucket_mb, own,
                       shard_copies=groups.shard_copies, select=lambda n, p: not expert(n, p),
                       bf16_grads=low)  # fmt: skip
    experts = GradBuffer(chunks, groups.edp, zero_stage, bucket_mb, select=expert,
                         scale=1.0 / groups.replica.size, bf16_grads=low)  # fmt: skip
    return GradBuffers([dense, experts])
