"""Runs one rank's schedule (any schedule of the registry, schedules.py) over its model chunks.

The actions are interpreted in order, dispatched on their kind (an unknown kind is refused). A
compute runs chunk `chunks[a.chunk]` on micro-batch `a.mb`. Each run of consecutive send/recv
actions is posted as one `p2p.post` batch and not waited for; a WAIT blocks until the batch
holding that receive completed, and posting batch j first waits for batch j - MAX_IN_FLIGHT, so
sends complete in the background while later computes run: exactly the semantics `verify.py`
proves deadlock-free. Where the neighbouring virtual stage is on this rank (pp == 1, or a
placement that turns back) there are no send/recv actions: a chunk's output is handed to that
chunk directly.

One rank's action list, pp=2 and m=4 micro-batches of 1F1B (`get_schedule("1f1b", 2, 1, 4, r)`
printed with `format_action`; tests/unit/test_schedules.py checks these lines are its output):

    rank 0: F0 sF0>1 F1 sF1>1 rB0<1 wB0 B0 F2 sF2>1 rB1<1 wB1 B1 F3 sF3>1 rB2<1 wB2 B2 rB3<1 wB3 B3
    rank 1: rF0<0 wF0 F0 B0 sB0>0 rF1<0 wF1 F1 B1 sB1>0 rF2<0 wF2 F2 B2 sB2>0 rF3<0 wF3 F3 B3 sB3>0

`F2`: forward of micro-batch 2; `B2` its backward; `sF2>1` post the send of its activations to
rank 1; `rB0<1` post the receive of micro-batch 0's gradient from rank 1; `wB0` wait for that
receive (consecutive sends/receives are one posted batch). Rank 0 runs pp - 1 = 1 forward
ahead (warmup), then alternates one forward and one backward.

Per (chunk, micro-batch) the executor keeps only what backward needs: the received input
(a leaf whose .grad becomes the gradient to send back) and the output (the root of backward).
Once an output is posted to the next stage its storage is released (Megatron's "deallocate
output tensor"): the posted batch keeps the sent tensor alive until it completes, the autograd
graph keeps whatever it saved itself, and backward is started from the empty-shelled output with
the received gradient.

Nothing here waits on the device: computes are timed with `Clock` marks (CUDA events on a GPU),
losses stay on the device, and a `PipelineResult` is read (one all-reduce over pp) only when the
caller asks, on logging steps. With a `timeline` every compute and every wait is recorded as a
span; without one nothing else changes.
"""

from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.autograd import Variable

from megalite.clock import Clock
from megalite.errors import MegaliteError
from megalite.parallel import comm, p2p
from megalite.pipeline.actions import (
    COMM,
    MAX_IN_FLIGHT,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    WAITS,
    B,
    F,
    I,
    W,
    format_action,
    interleaved_placement,
    owner,
)
from megalite.pipeline.split_backward import input_grad


@dataclass
class PipelineResult:
    """One step of the pipeline, unread: losses on the device, times as clock marks. Reading
    `loss` or `losses` runs one all-reduce over pp (the last stage's losses), so every pipeline
    rank must read them, at the same step: the trainer does on logging steps. The pipeline
    bubble of one step or of several is `first_stage_times` with `idle_ratio`/`idle_share`."""

    loss_tensor: torch.Tensor  # (m,) float64 on the head's rank, zeros elsewhere
    spans: list  # (start, end) marks of every compute of this rank
    start: object  # marks of the whole schedule
    end: object
    wait_s: float  # this rank: host seconds blocked waiting for p2p batches
    clock: Clock
    pp: object  # the pipeline Group
    _read: list | None = field(default=None, repr=False)

    @property
    def compute_s(self) -> float:
        """This rank: seconds in forward and backward."""
        return sum(self.clock.seconds(a, b) for a, b in self.spans)

    @property
    def step_s(self) -> float:
        """This rank: the schedule's duration."""
        return self.clock.seconds(self.start, self.end)

    @property
    def losses(self) -> list[float]:
        """Per micro-batch (unscaled) mean token loss: one all-reduce over pp."""
        if self._read is None:
            summed = self.loss_tensor.to(torch.float64, copy=True)
            comm.all_reduce(summed, self.pp)
            self._read = summed.tolist()
        return self._read

    @property
    def loss(self) -> float:
        return sum(self.losses) / len(self.losses)


def idle_ratio(compute_s: float, step_s: float) -> float:
    """Idle time over compute time: megalite's one definition of the pipeline bubble (the
    metrics file's `bubble_measured`), comparable to the schedule's `schedules.bubble_theory`
    (Megatron's (pp-1)/(vpp*m) for 1F1B and interleaved)."""
    return (step_s - compute_s) / max(compute_s, 1e-12)


def idle_share(compute_s: float, step_s: float) -> float:
    """Idle time as a share of the step (`idle_share`): bubble / (1 + bubble); in theory
    (pp-1)/(vpp*m + pp-1) for 1F1B and interleaved (`schedules.idle_theory`)."""
    return 1.0 - compute_s / max(step_s, 1e-12)


def first_stage_times(results: list[PipelineResult], pp) -> tuple[float, float]:
    """(compute, step) seconds summed over one step or several (a log interval): the first
    pipeline stage's compute, and each step's longest schedule of any pp rank (the step the
    first stage's idle time is counted against: in a V it may finish before the last rank).
    One all-reduce over pp; every pipeline rank calls it with its own results."""
    t = torch.tensor([0.0] + [r.step_s for r in results], dtype=torch.float64)
    if pp.rank == 0:
        t[0] = sum(r.compute_s for r in results)
    t = t.to(results[0].loss_tensor.device)
    comm.all_reduce(t, pp, op=dist.ReduceOp.MAX)
    compute, *steps = t.tolist()
    return compute, sum(steps)


def _peer_failure(batch, pp, reason: str) -> str:
    me = f"rank {pp.ranks[pp.rank]} (pipeline stage {pp.rank})"
    what = ", ".join(
        f"{a.kind} of chunk {a.chunk} micro-batch {a.mb} "
        f"{'to' if a.kind in (SEND_F, SEND_B) else 'from'} stage {a.peer} (rank {pp.ranks[a.peer]})"
        for a in batch
    )
    reason = reason.strip().splitlines()[0] if reason.strip() else "no reason given"
    return (
        f"{me} gave up waiting on {what}: that rank died or stalled ({reason[-160:]}); "
        "see its log, or raise --distributed-timeout-minutes if it was only slow"
    )


def _backward(out: torch.Tensor, grad: torch.Tensor):
    """out.backward(grad), allowed when out's storage was released (its shape is then (1,)):
    the engine call skips the shape check that torch.autograd.backward makes."""
    Variable._execution_engine.run_backward(
        tensors=(out,), grad_tensors=(grad,), keep_graph=False, create_graph=False,
        inputs=(), allow_unreachable=True, accumulate_grad=True,
    )  # fmt: skip


def _release(t: torch.Tensor):
    """Drop an output's storage; its grad_fn stays. A view or a leaf (a chunk that returned its
    input) shares storage that is still needed: keep it whole."""
    if t._base is None and t.grad_fn is not None:
        t.data = torch.empty((1,), device=t.device, dtype=t.dtype)


# timeline span names of the compute kinds
SPAN = {F: "forward", B: "backward", I: "backward-input", W: "backward-weight"}


def _record_wait(timeline, batch, t0, t1):
    """A span of time blocked on a posted batch (its actions in `ops`)."""
    sends = any(a.kind in (SEND_F, SEND_B) for a in batch)
    recvs = any(a.kind in (RECV_F, RECV_B, *WAITS) for a in batch)
    kind = "send+recv" if sends and recvs else "send" if sends else "recv"
    ops = " ".join(format_action(a, chunks=2) for a in batch)
    timeline.record(kind, t0, t1, chunk=batch[0].chunk, mb=batch[0].mb, ops=ops)


def _local_neighbours(pp: int, rank: int, n_chunks: int, placement):
    """For each chunk, the chunk on this rank holding the next / previous virtual stage, or
    None (another rank holds it, or there is none)."""
    last = pp * n_chunks - 1
    nxt, prev = [], []
    for c in range(n_chunks):
        vs = placement(pp, n_chunks, rank, c)
        for out, v in ((nxt, vs + 1), (prev, vs - 1)):
            r, cc = owner(placement, pp, n_chunks, v) if 0 <= v <= last else (None, None)
            out.append(cc if r == rank else None)
    return nxt, prev


def run_schedule(
    actions, chunks, groups, microbatches, *, hidden_shape, dtype,
    forward_only: bool = False, loss_scale: float = 1.0, timeline=None,
    placement=interleaved_placement, observe=None,
) -> PipelineResult:  # fmt: skip
    """Run this rank's `actions` (from `schedules.get_schedule`) over `chunks` (its model chunks,
    each with `has_embedding` / `has_head`, called as `chunk(x, labels=None)`).

    groups: the `ProcessGroups` (uses `groups.pp` and `groups.device`).
    microbatches: this DP rank's list of (tokens (b, s), labels (b, s)); labels are needed
        on the head chunk, also with forward_only (the result is a loss). A third element, a
        `context_parallel.Shard` (this cp rank's positions, documents, loss mask), is handed to
        every chunk as `shard=`.
    hidden_shape: shape of the tensor between stages, e.g. (b, s, h), (b, s/tp, h) with
        sequence parallelism; dtype: its dtype.
    Backward of micro-batch k starts from loss_k * loss_scale / m, so gradients are those of
    the mean loss (times loss_scale). With forward_only nothing is kept for backward and no
    gradient is computed (the actions must be a forward-only schedule).
    timeline: when given, receives `record(kind, start, end, ...)` (clock marks) for each
        compute ("forward"/"backward", chunk, mb), each wait ("recv", or "send" for the sends
        still in flight at the end, with its actions in `ops`), each ring hop context
        parallelism waited for ("cp", inside a compute span) and the whole schedule.
    placement: the schedule's (pp, vpp, rank, chunk) -> virtual stage.
    observe: when given, called as `observe(index, action)` before each action runs (a hang
        report names the action a rank was in).
    """
    pp, device = groups.pp, groups.device
    clock = Clock(device)
    local_next, local_prev = _local_neighbours(pp.size, pp.rank, len(chunks), placement)
    m = len(microbatches)
    inputs = {}  # (chunk, mb) -> input hidden (b, s, h): a leaf that collects its gradient
    outputs = {}  # (chunk, mb) -> output kept as the root of backward (scaled loss on the head)
    grads = {}  # (chunk, mb) -> gradient of that output, received or handed over
    outbox = {}  # (kind, chunk, mb) -> tensor waiting to be sent
    received = {}  # (kind of the receive, chunk, mb) -> (batch, its op index, buffer)
    later = {}  # (chunk, mb) -> the weight-gradient half of a split backward (W)
    batches = deque()  # posted batches not yet known to be complete, oldest first
    losses = [None] * m
    spans, wait_s = [], 0.0
    start = clock.mark()

    def forward(c, k):
        chunk = chunks[c]
        tokens, labels, *shard = microbatches[k]
        kw = {"shard": shard[0]} if shard else {}
        x = tokens if chunk.has_embedding else inputs[c, k]
        if forward_only:
            inputs.pop((c, k), None)
        with torch.no_grad() if forward_only else nullcontext():
            y = chunk(x, labels, **kw) if chunk.has_head else chunk(x, **kw)
        if chunk.has_head:
            losses[k] = y.detach()
            if not forward_only:
                outputs[c, k] = y * (loss_scale / m)
            return
        if not forward_only:
            outputs[c, k] = y
        if local_next[c] is not None:
            inputs[local_next[c], k] = y.detach().requires_grad_(not forward_only)
        else:
            outbox[SEND_F, c, k] = y.detach().contiguous()

    def backward(c, k):
        chunk = chunks[c]
        out = outputs.pop((c, k))
        if chunk.has_head:
            out.backward()
        else:
            _backward(out, grads.pop((c, k)))
        if not chunk.has_embedding:
            pass_back(c, k)

    def pass_back(c, k):  # the input's gradient, to the previous stage
        x = inputs.pop((c, k))
        g = x.grad if x.grad is not None else torch.zeros_like(x)  # (b, s, h)
        if local_prev[c] is not None:
            grads[local_prev[c], k] = g
        else:
            outbox[SEND_B, c, k] = g.contiguous()

    def backward_input(c, k):  # I: the input gradient now, the weight gradients kept for W
        chunk = chunks[c]
        if chunk.has_embedding:  # no input gradient to pass on: the whole backward is W's
            later[c, k] = lambda: backward(c, k)
            return
        out = outputs.pop((c, k))
        grad = None if chunk.has_head else grads.pop((c, k))
        later[c, k] = input_grad(out, grad, inputs[c, k], chunk.parameters())
        if out._base is None:
            out.detach_()  # what only the input gradient needed can go
        pass_back(c, k)

    def backward_weight(c, k):  # W
        later.pop((c, k))()

    def wait(batch, what, op=None):
        nonlocal wait_s
        t0 = clock.mark()
        try:
            wait_s += batch.wait(op)
        except RuntimeError as e:  # a timeout, or a peer whose connection closed
            raise MegaliteError(_peer_failure(what, pp, str(e)), every_rank=True) from e
        if timeline is not None:
            _record_wait(timeline, what, t0, clock.mark())

    def post(run):
        if len(batches) >= MAX_IN_FLIGHT:  # bound the activations held by sends in flight
            oldest, what = batches.popleft()
            wait(oldest, what)
        ops = []
        for a in run:
            if a.kind in (SEND_F, SEND_B):
                ops.append((True, outbox.pop((a.kind, a.chunk, a.mb)), a.peer))
                if a.kind == SEND_F and (a.chunk, a.mb) in outputs:
                    _release(outputs[a.chunk, a.mb])  # the batch holds the sent tensor now
            else:
                buf = torch.empty(hidden_shape, dtype=dtype, device=device)
                ops.append((False, buf, a.peer))
        batch = p2p.post(ops, pp)
        for i, (a, (_, buf, _)) in enumerate(zip(run, ops)):
            if a.kind in (RECV_F, RECV_B):
                received[a.kind, a.chunk, a.mb] = (batch, i, buf)
        batches.append((batch, run))

    def take(a):  # a WAIT: the received tensor, once it arrived (its sends complete later)
        kind = WAITS[a.kind]
        batch, op, buf = received.pop((kind, a.chunk, a.mb))
        run = next((run for b, run in batches if b is batch), None)
        wait(batch, [run[op]] if run else [a], op)
        if kind == RECV_F:
            inputs[a.chunk, a.mb] = buf.requires_grad_(not forward_only)
        else:
            grads[a.chunk, a.mb] = buf

    # dispatch on the kind of a compute action
    compute = {F: forward, B: backward, I: backward_input, W: backward_weight}
    # (the ledger is every group's: waits inside layers, a cp ring hop, record there too)
    with pp.ledger.recording(timeline):
        i = 0
        while i < len(actions):
            a = actions[i]
            if observe is not None:
                observe(i, a)
            if a.kind in COMM:  # a maximal run of send/recv actions is one batch
                j = i
                while j < len(actions) and actions[j].kind in COMM:
                    j += 1
                post(actions[i:j])
                i = j
                continue
            i += 1
            if a.kind in WAITS:
                take(a)
                continue
            if a.kind not in compute:
                raise ValueError(f"the executor cannot run action {a} (kind {a.kind!r})")
            t0 = clock.mark()
            compute[a.kind](a.chunk, a.mb)
            t1 = clock.mark()
            spans.append((t0, t1))
            if timeline is not None:
                timeline.record(SPAN[a.kind], t0, t1, chunk=a.chunk, mb=a.mb)
        while batches:  # the sends still in flight
            wait(*batches.popleft())
        end = clock.mark()
    if timeline is not None:
        timeline.record("schedule", start, end)
    if outputs or outbox or grads or inputs or received or later:
        left = [sorted(d)[:3] for d in (outputs, outbox, grads, inputs, received, later) if d]
        raise RuntimeError(f"the schedule left tensors unused (outputs/sends/grads/inputs): {left}")
    has_head = any(c.has_head for c in chunks)
    loss_tensor = torch.zeros(m, dtype=torch.float64, device=device)
    if has_head:
        loss_tensor = torch.stack(losses).to(torch.float64)
    return PipelineResult(loss_tensor, spans, start, end, wait_s, clock, pp)
