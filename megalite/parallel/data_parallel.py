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

  stage 0  all-reduce: every rank keeps the whole reduced gradient
  stage 1  reduce-scatter: this rank's shard of the gradient buffer holds the reduced gradient
  stage 2  no full gradient buffer: every micro-batch's bucket is staged in a transient buffer,
           reduce-scattered and added into a shard-sized accumulator (m times the DP traffic,
           4 * (1 - 1/dp) bytes per parameter less memory)
"""

from collections import deque
from dataclasses import dataclass

import torch
from torch import nn

from megalite.parallel import comm
from megalite.parallel.comm import Group

# Buckets are padded to a multiple of dp * ALIGN elements so every shard starts aligned.
ALIGN = 64
# Stage 2 keeps at most this many staged buckets in flight before waiting for the oldest.
MAX_IN_FLIGHT = 2


@dataclass(eq=False)
class Bucket:
    start: int  # [start, end) in the flat buffers, end - start a multiple of dp
    end: int
    params: list
    shard_start: int = 0  # the part of the bucket this rank updates (all of it at stage 0)
    shard_end: int = 0
    dp_start: int = 0  # this rank's 1/dp of the bucket (= the shard at stage >= 1)
    grad: torch.Tensor | None = None  # full-bucket gradient (a buffer view; staged at stage 2)
    shard_grad: torch.Tensor | None = None  # the reduced gradient of this rank's shard
    pending: int = 0  # params without a gradient in this pass yet
    passes: int = 0  # micro-batches whose gradients have all arrived
    launched: bool = False  # stage 0/1: reduction started (no more gradients may arrive)

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass
class ParamRange:
    """Where a parameter sits: its name, flat offset and bucket."""

    name: str
    param: nn.Parameter
    offset: int
    bucket: Bucket
    view: torch.Tensor | None = None  # its gradient's view of the bucket buffer (stages 0/1)

    def overlap(self, start: int, end: int) -> tuple[int, int, int, int] | None:
        """(lo, hi, plo, phi): the part of this parameter inside the flat range [start, end),
        as flat offsets and as offsets into the flattened parameter; None when disjoint."""
        lo, hi = max(self.offset, start), min(self.offset + self.param.numel(), end)
        if lo >= hi:
            return None
        return lo, hi, lo - self.offset, hi - self.offset

    def shard_slice(self) -> tuple[int, int, int, int] | None:
        """Like overlap() for this rank's shard, with lo/hi relative to the bucket's shard."""
        s = self.overlap(self.bucket.shard_start, self.bucket.shard_end)
        if s is None:
            return None
        base = self.bucket.shard_start
        return s[0] - base, s[1] - base, s[2], s[3]


class GradBuffer:
    """The flat parameter and gradient buffers of one rank, their buckets and DP reduction."""

    def __init__(
        self,
        chunks: list[nn.Module],
        dp: Group,
        zero_stage: int = 0,
        bucket_size_mb: float = 25.0,
        own_bucket=lambda name, p: False,
    ):
        params = [(n, p) for c in chunks for n, p in c.named_parameters() if p.requires_grad]
        dtypes = {p.dtype for _, p in params}
        if len(dtypes) != 1:
            raise ValueError(f"all parameters must share one dtype, got {sorted(map(str, dtypes))}")
        names = [n for n, _ in params]
        if len(set(names)) != len(names):
            raise ValueError("parameter names repeat across chunks; logical names must be unique")
        self.dp, self.stage = dp, zero_stage
        self.param_dtype = dtypes.pop()
        low = self.param_dtype in (torch.bfloat16, torch.float16)
        self.grad_dtype = torch.float32 if low else self.param_dtype
        size = torch.empty((), dtype=self.grad_dtype).element_size()
        bucket_numel = max(1, int(bucket_size_mb * 2**20 / size))

        # Reverse registration order within each chunk: roughly the order backward produces
        # gradients, so early buckets fill (and start reducing) first.
        self.buckets: list[Bucket] = []
        self.ranges: list[ParamRange] = []
        pad = dp.size * ALIGN
        offset = 0
        for chunk in chunks:
            current: list = []
            for name, p in reversed(
                [(n, p) for n, p in chunk.named_parameters() if p.requires_grad]
            ):
                alone = own_bucket(name, p)
                if current and (alone or sum(q.numel() for _, q in current) >= bucket_numel):
                    offset = self._close(current, offset, pad)
                    current = []
                current.append((name, p))
                if alone:
                    offset = self._close(current, offset, pad)
                    current = []
            if current:
                offset = self._close(current, offset, pad)
        self.numel = offset

        self.param_buffer = torch.zeros(offset, dtype=self.param_dtype, device=params[0][1].device)
        with torch.no_grad():
            for r in self.ranges:
                view = self.param_buffer[r.offset : r.offset + r.param.numel()].view_as(r.param)
                view.copy_(r.param)
                r.param.data = view  # the model now reads the flat buffer
        self.grad_buffer = None
        if zero_stage < 2:
            self.grad_buffer = torch.zeros(
                offset, dtype=self.grad_dtype, device=self.param_buffer.device
            )
        for b in self.buckets:
            shard = b.numel // dp.size
            b.dp_start = b.start + dp.rank * shard
            b.shard_start, b.shard_end = b.start, b.end
            if zero_stage > 0:
                b.shard_start, b.shard_end = b.dp_start, b.dp_start + shard
            if self.grad_buffer is not None:
                b.grad = self.grad_buffer[b.start : b.end]
                b.shard_grad = self.grad_buffer[b.shard_start : b.shard_end]
            else:
                b.shard_grad = torch.zeros(
                    shard, dtype=self.grad_dtype, device=self.param_buffer.device
                )
        self._range_of = {r.param: r for r in self.ranges}
        for r in self.ranges:
            if self.grad_buffer is not None:
                r.param.main_grad = self._grad_view(r)
            r.param.register_post_accumulate_grad_hook(self._on_grad)
        self._grad_is_view = zero_stage < 2 and self.grad_dtype == self.param_dtype
        self._in_flight: deque = deque()
        self.zero_grad(1)

    def _close(self, named: list, offset: int, pad: int) -> int:
        b = Bucket(offset, offset, [p for _, p in named])
        for name, p in named:
            self.ranges.append(ParamRange(name, p, offset, b))
            offset += p.numel()
        b.end = -(-offset // pad) * pad
        self.buckets.append(b)
        return b.end

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
        for b in self.buckets:
            if self.grad_buffer is None:
                b.shard_grad.zero_()
                b.grad = None
            b.pending, b.passes, b.launched = len(b.params), 0, False
        for r in self.ranges:
            # stages 0/1 keep the bucket buffer all step: cache each parameter's view of it once
            r.view = self._grad_view(r) if self.grad_buffer is not None else None
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
        if b.grad is None:  # stage 2: stage this pass's bucket
            b.grad = torch.zeros(b.numel, dtype=self.grad_dtype, device=p.device)
        view = r.view if r.view is not None else self._grad_view(r)
        if p.grad.data_ptr() != view.data_ptr():
            view.add_(p.grad)
        # With one dtype (stages 0/1), `.grad` stays a view of the buffer, so autograd adds the
        # next micro-batch's gradient in place (DDP's gradient_as_bucket_view; backward with
        # create_graph, which replaces .grad, is not supported); otherwise drop autograd's
        # copy: the buffer holds the gradient now.
        p.grad = view if self._grad_is_view else None
        b.pending -= 1
        if not b.pending:
            b.passes += 1
            b.pending = len(b.params)
            if self.stage == 2 or b.passes == self.microbatches:
                self._launch(b)

    def _launch(self, b: Bucket):
        g = b.grad
        g.mul_(1.0 / self.dp.size)
        if self.stage == 0:
            work, out = comm.all_reduce(g, self.dp, async_op=True), None
        else:
            out = torch.empty(b.shard_end - b.shard_start, dtype=g.dtype, device=g.device)
            work = comm.reduce_scatter(out, g, self.dp, async_op=True)
        self._in_flight.append((work, b, g, out))
        if self.stage == 2:
            b.grad = None  # the next micro-batch stages afresh
            while len(self._in_flight) > MAX_IN_FLIGHT:
                self._complete(*self._in_flight.popleft())
        else:
            b.launched = True

    def _complete(self, work, b: Bucket, g: torch.Tensor, out: torch.Tensor | None):
        if work is not None:
            work.wait()
        if self.stage == 1:
            b.shard_grad.copy_(out)
        elif self.stage == 2:
            b.shard_grad.add_(out)

    def wait(self):
        while self._in_flight:
            self._complete(*self._in_flight.popleft())

    def finish(self):
        """Reduce whatever backward did not launch (unused parameters, fewer passes than
        expected, a partly staged bucket) and wait for every reduction."""
        for b in self.buckets:
            if self.stage == 2:
                if b.grad is not None:
                    self._launch(b)
            elif not b.launched:
                self._launch(b)
        self.wait()

    # ---- ZeRO helpers ---------------------------------------------------------------------

    def param_shard(self, b: Bucket) -> torch.Tensor:
        return self.param_buffer[b.shard_start : b.shard_end]

    def all_gather_params(self):
        """Every rank updated its shards; give every rank every bucket (stage 1/2)."""
        if self.stage == 0 or self.dp.size == 1:
            return
        works = []
        for b in self.buckets:
            # The shard is part of the output: gather from a copy rather than rely on the
            # backend handling overlapping input and output.
            src = self.param_shard(b).clone()
            works.append(
                comm.all_gather(self.param_buffer[b.start : b.end], src, self.dp, async_op=True)
            )
        for w in works:
            w.wait()

    def gather_shards(self, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        """Full-bucket tensors from this rank's per-bucket shards (collective over DP)."""
        if self.stage == 0:
            return shards
        out = []
        for b, s in zip(self.buckets, shards):
            full = s.new_empty(b.numel)
            comm.all_gather(full, s, self.dp)
            out.append(full)
        return out
