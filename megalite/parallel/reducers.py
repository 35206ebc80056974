"""How a gradient buffer's buckets are reduced over the data-parallel replicas. The ZeRO stage
picks one of these (zero.py); a buffer (data_parallel.GradBuffer, zero3.Zero3Buffer) builds its
buckets and hands the reducer each parameter's fresh gradient (a post-accumulate-grad hook).

  AllReduce                   stage 0: gradients accumulate in the whole-model gradient buffer
                              over the step's micro-batches (no_sync); a bucket is all-reduced in
                              place once its last micro-batch has arrived, overlapping backward
  ReduceScatter               stage 1: the same, reduce-scattered: this rank's shard lands in its
                              part of the buffer
  ReduceScatterEachMicrobatch stages 2 and 3: no whole-model gradient buffer. Each micro-batch's
                              bucket is staged only while it is reduced: reduce-scattered and
                              added into a shard-sized accumulator, freed as soon as it lands (at
                              most `in_flight` + 1 staged at once)

Gradients are multiplied by the buffer's `scale` (the DP mean) before they are summed.

Hybrid sharding (--dp-replicate): the buckets are reduced as above over the shard group `dp`,
then `finish` all-reduces each rank's shard over `shard_copies`, the copies of the shard group
(1/dp of the bytes, once per step, after backward; a group of one rank makes it a no-op).
"""

from collections import deque
from dataclasses import dataclass

import torch
from torch import nn

from megalite.parallel import comm
from megalite.parallel.buckets import Bucket, ParamRange
from megalite.parallel.comm import Group


@dataclass(eq=False)
class Reduction:
    """What a bucket's reduction has reached in the step: its reducer's alone."""

    # the full-bucket gradient: the bucket's part of the gradient buffer (stages 0/1, for
    # good), or the pass's staged bucket while it is filled (stages 2/3)
    grad: torch.Tensor | None = None
    pending: int = 0  # params without a gradient in this pass yet
    passes: int = 0  # micro-batches whose gradients have all arrived
    launched: bool = False  # stage 0/1: reduction started (no more gradients may arrive)
    reduced: bool = False  # a reduction of this step has been launched
    # stage 2/3: the parameters whose gradient of this pass is in the staged `grad`
    staged: set | None = None


class StepReducer:
    """Stages 0/1: every micro-batch's gradient added into the bucket's part of the gradient
    buffer (`views`), the bucket reduced once per step. `grad_is_view`: the parameters' `.grad`
    stays a view of the buffer, so autograd adds the next micro-batch's gradient in place (DDP's
    gradient_as_bucket_view; backward with create_graph, which replaces .grad, is not
    supported); otherwise autograd's copy is dropped once the buffer holds it."""

    each_microbatch = False  # reduces once per step (the planner: ZeroStage.collectives)
    sharded = False  # a rank keeps the whole reduced gradient

    def __init__(self, buckets: list[Bucket], ranges: list[ParamRange], dp: Group, scale: float,
                 in_flight: int, grad_buffer: torch.Tensor | None = None,
                 grad_is_view: bool = False, on_launch=None,
                 shard_copies: Group | None = None):  # fmt: skip
        """`on_launch(b, more)`: called once bucket `b`'s reduction has started, `more` whether
        more passes of the step follow (ZeRO-3 frees the unit whose buckets are all reduced);
        `shard_copies`: the copies of the `dp` group each shard is all-reduced over in `finish`
        (None: none). Each bucket's reduced gradient lands in its `shard_grad`."""
        self.buckets, self.dp, self.scale, self.in_flight = buckets, dp, scale, in_flight
        self.shard_copies = shard_copies
        self.grad_buffer, self.grad_is_view, self.on_launch = grad_buffer, grad_is_view, on_launch
        self.range_of = {r.param: r for r in ranges}
        self.ranges = ranges
        self.state = {b: Reduction() for b in buckets}
        self.views = {}  # parameter -> its gradient's view of the gradient buffer (stages 0/1)
        if grad_buffer is not None:  # kept for good: each bucket's part, each parameter's view
            for b in buckets:
                self.state[b].grad = grad_buffer[b.start : b.end]
            self.views = {r.param: self.grad_view(r) for r in ranges}
        self.microbatches = 1
        self._in_flight: deque = deque()
        self.staged_bytes = self.peak_staged_bytes = 0  # gradient buckets staged (no buffer)
        self.staged_buckets = 0

    # ---- the step's life cycle ----------------------------------------------------------

    def zero_grad(self, microbatches: int):
        """Start a step of `microbatches` backward passes per parameter."""
        self.wait()
        self.microbatches = microbatches
        if self.grad_buffer is not None:
            self.grad_buffer.zero_()
        self.staged_bytes = self.staged_buckets = 0  # nothing in flight: what is staged goes
        for b in self.buckets:
            s = self.state[b]
            self._reset(b, s)
            s.pending, s.passes, s.launched, s.reduced = len(b.params), 0, False, False
        for r in self.ranges:
            r.param.grad = self.views[r.param] if self.grad_is_view else None

    def _reset(self, b: Bucket, s: Reduction):
        pass  # the gradient buffer was zeroed whole

    def grad_view(self, r: ParamRange) -> torch.Tensor:
        """Parameter `r`'s part of its bucket's gradient, shaped as the parameter."""
        o = r.offset - r.bucket.start
        return self.state[r.bucket].grad[o : o + r.param.numel()].view_as(r.param)

    @torch.no_grad()
    def on_grad(self, p: nn.Parameter):
        """The post-accumulate-grad hook: `p.grad` into the bucket; a bucket all of whose
        parameters have their gradient of the pass is launched when due."""
        r = self.range_of[p]
        b = r.bucket
        s = self.state[b]
        if s.launched:
            raise RuntimeError(
                f"{r.name} got a gradient after its bucket was reduced: more backward passes than "
                f"the {self.microbatches} micro-batches this step was started with"
            )
        self._accumulate(r, p, s)
        s.pending -= 1
        if not s.pending:
            s.passes += 1
            s.pending = len(b.params)
            if self._due(s):
                self.launch(b)

    def _accumulate(self, r: ParamRange, p: nn.Parameter, s: Reduction):
        view = self.views[p]
        if p.grad.data_ptr() != view.data_ptr():
            view.add_(p.grad)
        p.grad = view if self.grad_is_view else None

    def _due(self, s: Reduction) -> bool:
        return s.passes == self.microbatches

    def launch(self, b: Bucket):
        """Start reducing bucket `b` (asynchronously)."""
        s = self.state[b]
        g = s.grad
        if self.scale != 1.0:
            g.mul_(self.scale)
        out = self._out(b, s, g)
        work = self._reduce(g, out)
        self._in_flight.append((work, b, g, out))
        self._launched(s)
        if self.on_launch is not None:
            self.on_launch(b, s.passes < self.microbatches)

    def _out(self, b: Bucket, s: Reduction, g: torch.Tensor) -> torch.Tensor | None:
        return None  # in place

    def _reduce(self, g: torch.Tensor, out: torch.Tensor | None):
        return comm.all_reduce(g, self.dp, async_op=True)

    def _launched(self, s: Reduction):
        s.launched = True  # no more gradients may arrive this step

    def _complete(self, work, b: Bucket, g: torch.Tensor, out: torch.Tensor | None):
        if work is not None:
            work.wait()
        if out is not None:
            b.shard_grad.copy_(out)

    def wait(self):
        while self._in_flight:
            self._complete(*self._in_flight.popleft())

    def launch_rest(self):
        """Launch the reductions backward did not (unused parameters, fewer passes than
        expected, a partly staged bucket)."""
        for b in self.buckets:
            if not self.state[b].launched:
                self.launch(b)

    def finish(self):
        """Launch the rest, wait for every reduction over `dp`, then sum each shard over the
        copies of the group (`shard_copies`): `shard_grad` holds the step's mean gradient."""
        self.launch_rest()
        self.wait()
        if self.shard_copies is None:
            return
        works = [comm.all_reduce(b.shard_grad, self.shard_copies, async_op=True)
                 for b in self.buckets]  # fmt: skip
        for w in works:
            if w is not None:
                w.wait()


class AllReduce(StepReducer):
    """Stage 0: each bucket all-reduced in place."""


class ReduceScatter(StepReducer):
    """Stage 1: each bucket reduce-scattered; this rank's shard copied into its part of the
    buffer (`shard_grad`)."""

    sharded = True

    def _out(self, b: Bucket, s: Reduction, g: torch.Tensor) -> torch.Tensor:
        s.reduced = True
        return torch.empty(b.shard_end - b.shard_start, dtype=g.dtype, device=g.device)

    def _reduce(self, g: torch.Tensor, out: torch.Tensor):
        return comm.reduce_scatter(out, g, self.dp, async_op=True)


class ReduceScatterEachMicrobatch(ReduceScatter):
    """Stages 2/3: each pass's bucket staged, reduce-scattered as soon as it is full and added
    into the shard accumulator (`shard_grad`)."""

    each_microbatch = True

    def _reset(self, b: Bucket, s: Reduction):
        b.shard_grad.zero_()
        s.grad, s.staged = None, None

    def _accumulate(self, r: ParamRange, p: nn.Parameter, s: Reduction):
        if s.grad is None:  # stage this pass's bucket
            self._stage(r.bucket, s, p.device)
        view = self.grad_view(r)
        if p not in s.staged:
            # a staged bucket starts empty: a parameter's first gradient of the pass is copied
            # in (0 + g, without zeroing the bucket first), any later one added
            view.copy_(p.grad)
            s.staged.add(p)
        else:
            view.add_(p.grad)
        p.grad = None

    def _due(self, s: Reduction) -> bool:
        return True

    def _stage(self, b: Bucket, s: Reduction, device):
        """A bucket for one pass's gradients, left uninitialised but for its padding (the hooks
        write every parameter's part; `launch` zeroes those of a partial pass): at most
        in_flight + 1 staged (being filled or reduced). Two buckets can fill at once where
        gradients arrive out of layout order, so room is made here."""
        while self._in_flight and self.staged_buckets > self.in_flight:
            self._complete(*self._in_flight.popleft())
        s.grad = torch.empty(b.numel, dtype=b.shard_grad.dtype, device=device)
        s.grad[b.used :].zero_()
        s.staged = set()
        self.staged_buckets += 1
        self.staged_bytes += s.grad.numel() * s.grad.element_size()
        self.peak_staged_bytes = max(self.peak_staged_bytes, self.staged_bytes)

    def launch(self, b: Bucket):
        s = self.state[b]
        if len(s.staged) < len(b.params):  # a partial pass: the missing gradients are 0
            for r in self.ranges:
                if r.bucket is b and r.param not in s.staged:
                    self.grad_view(r).zero_()
        s.staged = None
        super().launch(b)

    def _out(self, b: Bucket, s: Reduction, g: torch.Tensor) -> torch.Tensor:
        if s.reduced:
            return super()._out(b, s, g)
        s.reduced = True
        return b.shard_grad  # the step's first reduction lands in the accumulator itself

    def _launched(self, s: Reduction):
        s.grad = None  # the next micro-batch stages afresh
        # free what has landed (without waiting), and wait once too much is in flight
        while self._in_flight and (
            len(self._in_flight) > self.in_flight or _landed(self._in_flight[0][0])
        ):
            self._complete(*self._in_flight.popleft())

    def _complete(self, work, b: Bucket, g: torch.Tensor, out: torch.Tensor):
        if work is not None:
            work.wait()
        if out is not b.shard_grad:
            b.shard_grad.add_(out)
        self.staged_bytes -= g.numel() * g.element_size()  # dropped with this tuple
        self.staged_buckets -= 1

    def launch_rest(self):
        for b in self.buckets:
            if self.state[b].grad is not None:
                self.launch(b)


def _landed(work) -> bool:
    return work is None or work.is_completed()
