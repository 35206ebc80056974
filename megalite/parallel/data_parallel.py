"""Data parallelism: gradients in contiguous buckets, reduced over DP while backward still runs.

Every parameter of this rank (all its pipeline chunks) becomes a view into one flat parameter
buffer, so ZeRO can all-gather updated shards straight into the model. Gradients accumulate in
a flat gradient buffer of the same layout (fp32 when parameters are bf16/fp16, so micro-batch
sums keep their bits), Megatron's `main_grad`. The layout is cut into buckets of about
`bucket_size_mb`; a bucket never spans two chunks and is padded to a multiple of the DP size,
so each bucket splits into DP shards, the unit of the ZeRO optimizer.

A post-accumulate-grad hook moves each parameter's fresh `.grad` into the buffer. Once every
parameter of a bucket has its gradient for the last micro-batch of the step (earlier micro-batches
only accumulate: no_sync), the bucket's reduction is launched asynchronously, so it overlaps
the rest of backward. Gradients are divided by the DP size before they are summed (a mean).
Where gradients live and how a bucket is reduced is the ZeRO stage's (zero.py). Without a
gradient buffer (ZeRO-2) a micro-batch's bucket is staged only while it is reduced: it is freed
as soon as its reduce-scatter lands (at most the stage's `in_flight` + 1 staged at once).

With sharded optimizer state each rank updates its shard of every bucket, then the buckets are
all-gathered back into the parameter buffer. `all_gather_params(overlap=True)` launches the
gathers in forward order and returns; a forward pre-hook on each module waits for the buckets
holding that module's parameters (a plain container's, such as the untied head's, when they are
read from it), so the gathers of later layers overlap the forward of earlier ones (Megatron's
--overlap-param-gather). `wait_params` waits for all (checkpoints).

"DP" here is the group of ranks holding the same parameters (`ProcessGroups.replicas`: dp, or
the product of every replicated axis).
"""

from collections import deque
from contextlib import contextmanager

import torch
from torch import nn

from megalite.parallel import comm
from megalite.parallel.buckets import (
    ALIGN,
    Bucket,
    ParamRange,
    bucket_layout,
    grad_dtype,
    trainable,
)
from megalite.parallel.comm import Group
from megalite.parallel.param_gather import wait_before_use
from megalite.parallel.zero import ZERO


class GradBuffer:
    """The flat parameter and gradient buffers of one rank, their buckets and DP reduction."""

    def __init__(
        self,
        chunks: list[nn.Module],
        dp: Group,
        zero_stage: int = 0,
        bucket_size_mb: float = 25.0,
        own_bucket=lambda name, p: False,
        select=lambda name, p: True,
        scale: float | None = None,
    ):
        """`select(name, p)`: the parameters this buffer holds (default all); `scale`: what
        gradients are multiplied by before the sum over `dp` (default 1/dp: a mean over the
        replicas; expert gradients, summed over fewer ranks than the replicas, take 1/replicas)."""
        named, self.param_dtype = trainable(chunks, select)
        params = [x for c in named for x in c]
        self.dp, self.zero = dp, ZERO[zero_stage]
        if self.zero.shard_params:
            raise ValueError("ZeRO-3 shards the parameters: build a zero3.Zero3Buffer")
        self.scale = 1.0 / dp.size if scale is None else scale
        self.grad_dtype = grad_dtype(self.param_dtype)
        size = torch.empty((), dtype=self.grad_dtype).element_size()
        bucket_numel = max(1, int(bucket_size_mb * 2**20 / size))
        by_name = dict(params)
        chunk_of = {n: c for c, named_c in enumerate(named) for n, _ in named_c}
        layout = bucket_layout(
            [[(n, p.numel(), own_bucket(n, p)) for n, p in c] for c in named],
            bucket_numel, dp.size * ALIGN,
        )  # fmt: skip
        self.buckets: list[Bucket] = []
        self.ranges: list[ParamRange] = []
        for start, end, ranges in layout:
            b = Bucket(start, end, [by_name[n] for n, _, _ in ranges], chunk_of[ranges[0][0]])
            self.buckets.append(b)
            self.ranges += [ParamRange(n, by_name[n], o, b) for n, o, _ in ranges]
        self.numel = layout[-1][1] if layout else 0
        device = params[0][1].device

        self.param_buffer = torch.zeros(self.numel, dtype=self.param_dtype, device=device)
        with torch.no_grad():
            for r in self.ranges:
                view = self.param_buffer[r.offset : r.offset + r.param.numel()].view_as(r.param)
                view.copy_(r.param)
                r.param.data = view  # the model now reads the flat buffer
        self.grad_buffer = None
        if self.zero.grad_buffer:
            self.grad_buffer = torch.zeros(self.numel, dtype=self.grad_dtype, device=device)
        for b in self.buckets:
            shard = b.numel // dp.size
            b.dp_start = b.start + dp.rank * shard
            b.shard_start, b.shard_end = b.start, b.end
            if self.zero.shard_state:
                b.shard_start, b.shard_end = b.dp_start, b.dp_start + shard
            if self.grad_buffer is not None:
                b.grad = self.grad_buffer[b.start : b.end]
                b.shard_grad = self.grad_buffer[b.shard_start : b.shard_end]
            else:
                b.shard_grad = torch.zeros(shard, dtype=self.grad_dtype, device=device)
        self._range_of = {r.param: r for r in self.ranges}
        self._grad_is_view = self.grad_buffer is not None and self.grad_dtype == self.param_dtype
        # nothing to reduce and `.grad` a view of the buffer: autograd's accumulation is all
        hooked = dp.size > 1 or not self._grad_is_view
        for r in self.ranges:
            # stages 0/1 keep the bucket buffer for good: each parameter's view of it, once
            r.view = self._grad_view(r) if self.grad_buffer is not None else None
            if r.view is not None:
                r.param.main_grad = r.view
            if hooked:  # (else finish() "reduces" the buffer, leaving it as it is)
                r.param.register_post_accumulate_grad_hook(self._on_grad)
        self._in_flight: deque = deque()
        self.staged_bytes = self.peak_staged_bytes = 0  # gradient buckets staged (no buffer)
        self.staged_buckets = 0
        if self.zero.shard_state and dp.size > 1:
            self._wait_before_forward(chunks)
        self.zero_grad(1)

    def _wait_before_forward(self, chunks: list[nn.Module]):
        """Each parameter's gather is waited for right before it is read (param_gather.py)."""
        order = {b: i for i, b in enumerate(self._forward_order())}
        wait_before_use(chunks, {r.param: r.bucket for r in self.ranges}, order)

    def _forward_order(self) -> list[Bucket]:
        """The buckets in the order the forward reads them: chunk by chunk, each chunk's
        buckets from the last laid out (layout runs backward)."""
        return sorted(self.buckets, key=lambda b: (b.chunk, -b.start))

    def _grad_view(self, r: ParamRange) -> torch.Tensor:
        o = r.offset - r.bucket.start
        return r.bucket.grad[o : o + r.param.numel()].view_as(r.param)

    # ---- the step's life cycle ----------------------------------------------------------

    def zero_grad(self, microbatches: int):
        """Start a step of `microbatches` backward passes per parameter."""
        self.wait()
        self.microbatches = microbatches
        if self.grad_buffer is not None:
            self.grad_buffer.zero_()
        self.staged_bytes = self.staged_buckets = 0  # nothing in flight: what is staged goes
        for b in self.buckets:
            if self.grad_buffer is None:
                b.shard_grad.zero_()
                b.grad, b.staged = None, None
            b.pending, b.passes, b.launched, b.reduced = len(b.params), 0, False, False
        for r in self.ranges:
            r.param.grad = r.view if self._grad_is_view else None

    @torch.no_grad()
    def _on_grad(self, p: nn.Parameter):
        r = self._range_of[p]
        b = r.bucket
        if b.launched:
            raise RuntimeError(
                f"{r.name} got a gradient after its bucket was reduced: more backward passes than "
                f"the {self.microbatches} micro-batches this step was started with"
            )
        if b.grad is None:  # no gradient buffer: stage this pass's bucket
            self._stage(b, p.device)
        view = r.view if r.view is not None else self._grad_view(r)
        if b.staged is not None and p not in b.staged:
            # a staged bucket starts empty: a parameter's first gradient of the pass is copied
            # in (0 + g, without zeroing the bucket first), any later one added
            view.copy_(p.grad)
            b.staged.add(p)
        elif p.grad.data_ptr() != view.data_ptr():
            view.add_(p.grad)
        # With one dtype and a gradient buffer, `.grad` stays a view of the buffer, so autograd adds the
        # next micro-batch's gradient in place (DDP's gradient_as_bucket_view; backward with
        # create_graph, which replaces .grad, is not supported); otherwise drop autograd's
        # copy: the buffer holds the gradient now.
        p.grad = view if self._grad_is_view else None
        b.pending -= 1
        if not b.pending:
            b.passes += 1
            b.pending = len(b.params)
            if self.zero.reduce_each_microbatch or b.passes == self.microbatches:
                self._launch(b)

    def _stage(self, b: Bucket, device):
        """A bucket for one pass's gradients, left uninitialised but for its padding (the hooks
        write every parameter's part; `_launch` zeroes those of a partial pass): at most
        zero.in_flight + 1 staged (being filled or reduced). Two buckets can fill at once where
        gradients arrive out of layout order, so room is made here."""
        while self._in_flight and self.staged_buckets > self.zero.in_flight:
            self._complete(*self._in_flight.popleft())
        b.grad = torch.empty(b.numel, dtype=self.grad_dtype, device=device)
        b.grad[b.used :].zero_()
        b.staged = set()
        self.staged_buckets += 1
        self.staged_bytes += b.grad.numel() * b.grad.element_size()
        self.peak_staged_bytes = max(self.peak_staged_bytes, self.staged_bytes)

    def _launch(self, b: Bucket):
        g = b.grad
        if b.staged is not None:
            if len(b.staged) < len(b.params):  # a partial pass: the missing gradients are 0
                for r in self.ranges:
                    if r.bucket is b and r.param not in b.staged:
                        self._grad_view(r).zero_()
            b.staged = None
        if self.scale != 1.0:
            g.mul_(self.scale)
        out = None
        if self.zero.shard_state:
            if self.zero.reduce_each_microbatch and not b.reduced:
                out = b.shard_grad  # the step's first reduction lands in the accumulator itself
            else:
                out = torch.empty(b.shard_end - b.shard_start, dtype=g.dtype, device=g.device)
            b.reduced = True
        work = self.zero.launch(g, out, self.dp)
        self._in_flight.append((work, b, g, out))
        if self.zero.reduce_each_microbatch:
            b.grad = None  # the next micro-batch stages afresh
            # free what has landed (without waiting), and wait once too much is in flight
            while self._in_flight and (
                len(self._in_flight) > self.zero.in_flight or _landed(self._in_flight[0][0])
            ):
                self._complete(*self._in_flight.popleft())
        else:
            b.launched = True

    def _complete(self, work, b: Bucket, g: torch.Tensor, out: torch.Tensor | None):
        if work is not None:
            work.wait()
        if out is None:
            return  # reduced in place
        if self.zero.reduce_each_microbatch:
            if out is not b.shard_grad:
                b.shard_grad.add_(out)
            self.staged_bytes -= g.numel() * g.element_size()  # dropped with this tuple
            self.staged_buckets -= 1
        else:
            b.shard_grad.copy_(out)

    def wait(self):
        while self._in_flight:
            self._complete(*self._in_flight.popleft())

    def finish(self):
        """Reduce whatever backward did not launch (unused parameters, fewer passes than
        expected, a partly staged bucket) and wait for every reduction."""
        self.launch_rest()
        self.wait()

    def launch_rest(self):
        """Launch the reductions backward did not (finish() without the wait)."""
        for b in self.buckets:
            if self.zero.reduce_each_microbatch:
                if b.grad is not None:
                    self._launch(b)
            elif not b.launched:
                self._launch(b)

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
            b.gather = (comm.all_gather(out, src, self.dp, async_op=True), src)
        if not overlap:
            self.wait_params()

    def wait_params(self):
        """Wait for every parameter gather still in flight."""
        for b in self.buckets:
            if b.gather is not None:
                b.gather[0].wait()
                b.gather = None

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
        return {"param_bytes": _nbytes([self.param_buffer]), "grad_bytes": _nbytes(grads)}

    def saves(self, b: Bucket) -> bool:
        """Whether this rank writes bucket `b`'s shard to a checkpoint: every rank its own
        when the state is sharded, DP rank 0 the whole bucket otherwise."""
        return b.shard_end - b.shard_start < b.numel or self.group_of(b).rank == 0

    def gather_shards(self, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        """Full-bucket tensors from this rank's per-bucket shards (collective over DP)."""
        if not self.zero.shard_state:
            return shards
        out = []
        for b, s in zip(self.buckets, shards):
            full = s.new_empty(b.numel)
            comm.all_gather(full, s, self.dp)
            out.append(full)
        return out


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
        self.wait()

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


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _landed(work) -> bool:
    return work is None or work.is_completed()
