"""Runs one rank's schedule (any schedule from schedules.py) over its model chunks.

The actions are interpreted in order, dispatched on their kind (an unknown kind is refused). A
compute runs chunk `chunks[a.chunk]` on micro-batch `a.mb`; each run of consecutive send/recv
actions is one `p2p.exchange` batch, waited for as a whole before the next compute, exactly what
`verify.py` proves deadlock-free. Where the neighbouring virtual stage is on this rank (pp == 1,
or a placement that turns back) there are no send/recv actions: a chunk's output is handed to
that chunk directly.

Per (chunk, micro-batch) the executor keeps only what backward needs: the received input
(a leaf whose .grad becomes the gradient to send back) and the output (the root of backward).
Once the next stage has an output, its storage is released (Megatron's "deallocate output
tensor"): the autograd graph keeps whatever it saved itself, and backward is started from the
empty-shelled output with the received gradient.

With a `timeline` (megalite.training.timeline.Timeline) every compute and every p2p batch is
recorded as a span; without one nothing else changes.
"""

import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch.autograd import Variable

from megalite.errors import MegaliteError
from megalite.parallel import comm
from megalite.pipeline import p2p
from megalite.pipeline.schedules import (
    COMM,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    B,
    F,
    format_action,
    interleaved_placement,
    owner,
)


@dataclass
class PipelineResult:
    """What one step of the pipeline gives the trainer. Loss and first-stage timing are the
    same on every pipeline rank (one all-reduce over pp), so any rank can log them."""

    loss: float  # mean over micro-batches of the (unscaled) mean token loss
    losses: list[float]  # per micro-batch
    compute_s: float  # this rank: seconds in forward and backward
    wait_s: float  # this rank: seconds blocked in point-to-point batches
    step_s: float  # this rank: wall time of run_schedule (before the loss all-reduce)
    first_stage_compute_s: float
    first_stage_step_s: float

    @property
    def bubble_measured(self) -> float:
        """The first stage's idle fraction of the step; in theory (pp-1)/(vpp*m + pp-1)
        (`schedules.idle_theory`)."""
        return 1.0 - self.first_stage_compute_s / max(self.first_stage_step_s, 1e-12)

    @property
    def bubble_ratio(self) -> float:
        """The first stage's idle time over its compute time, comparable to Megatron's
        (pp-1)/(vpp*m) (`schedules.bubble_theory`)."""
        idle = self.first_stage_step_s - self.first_stage_compute_s
        return idle / max(self.first_stage_compute_s, 1e-12)


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


SPAN = {F: "forward", B: "backward"}  # timeline span names of the compute kinds


def _record_batch(timeline, batch, t0: float, t1: float):
    sends = any(a.kind in (SEND_F, SEND_B) for a in batch)
    recvs = any(a.kind in (RECV_F, RECV_B) for a in batch)
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
    placement=interleaved_placement,
) -> PipelineResult:  # fmt: skip
    """Run this rank's `actions` (from `schedules.get_schedule`) over `chunks` (its model chunks,
    each with `has_embedding` / `has_head`, called as `chunk(x, labels=None)`).

    groups: the `ProcessGroups` (uses `groups.pp` and `groups.device`).
    microbatches: this DP rank's list of (tokens (b, s), labels (b, s)); labels are needed
        on the head chunk, also with forward_only (the result is a loss).
    hidden_shape: shape of the tensor between stages, e.g. (b, s, h), (b, s/tp, h) with
        sequence parallelism; dtype: its dtype.
    Backward of micro-batch k starts from loss_k * loss_scale / m, so gradients are those of
    the mean loss (times loss_scale). With forward_only nothing is kept for backward and no
    gradient is computed (the actions must be a forward-only schedule).
    timeline: when given, receives `record(kind, start, end, ...)` for each compute
        ("forward"/"backward", chunk, mb), each p2p batch ("send"/"recv"/"send+recv", with its
        actions in `ops`) and the whole schedule ("schedule").
    placement: the schedule's (pp, vpp, rank, chunk) -> virtual stage.
    """
    pp, device = groups.pp, groups.device
    local_next, local_prev = _local_neighbours(pp.size, pp.rank, len(chunks), placement)
    m = len(microbatches)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    inputs = {}  # (chunk, mb) -> input hidden (b, s, h): a leaf that collects its gradient
    outputs = {}  # (chunk, mb) -> output kept as the root of backward (scaled loss on the head)
    grads = {}  # (chunk, mb) -> gradient of that output, received or handed over
    outbox = {}  # (kind, chunk, mb) -> tensor waiting to be sent
    losses = [None] * m
    compute_s = wait_s = 0.0
    sync()
    start = time.perf_counter()

    def forward(c, k):
        chunk = chunks[c]
        tokens, labels = microbatches[k]
        x = tokens if chunk.has_embedding else inputs[c, k]
        if forward_only:
            inputs.pop((c, k), None)
        with torch.no_grad() if forward_only else nullcontext():
            y = chunk(x, labels) if chunk.has_head else chunk(x)
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
        if chunk.has_embedding:
            return
        x = inputs.pop((c, k))
        g = x.grad if x.grad is not None else torch.zeros_like(x)  # (b, s, h)
        if local_prev[c] is not None:
            grads[local_prev[c], k] = g
        else:
            outbox[SEND_B, c, k] = g.contiguous()

    def communicate(batch):
        ops, received = [], []
        for a in batch:
            if a.kind in (SEND_F, SEND_B):
                ops.append((True, outbox[a.kind, a.chunk, a.mb], a.peer))
            else:
                buf = torch.empty(hidden_shape, dtype=dtype, device=device)
                ops.append((False, buf, a.peer))
                received.append((a, buf))
        try:
            seconds = p2p.exchange(ops, pp)
        except (
            RuntimeError
        ) as e:  # a timeout, or a peer whose connection closed: it died or stalled
            raise MegaliteError(_peer_failure(batch, pp, str(e)), every_rank=True) from e
        for a in batch:
            if a.kind in (SEND_F, SEND_B):
                del outbox[a.kind, a.chunk, a.mb]
                if a.kind == SEND_F and (a.chunk, a.mb) in outputs:
                    _release(outputs[a.chunk, a.mb])  # the next stage has it now
        for a, buf in received:
            if a.kind == RECV_F:
                inputs[a.chunk, a.mb] = buf.requires_grad_(not forward_only)
            else:
                grads[a.chunk, a.mb] = buf
        return seconds

    compute = {F: forward, B: backward}  # dispatch on the kind of a compute action
    i = 0
    while i < len(actions):
        a = actions[i]
        if a.kind in COMM:  # a maximal run of send/recv actions is one batch
            j = i
            while j < len(actions) and actions[j].kind in COMM:
                j += 1
            t0 = time.perf_counter()
            wait_s += communicate(actions[i:j])
            if timeline is not None:
                _record_batch(timeline, actions[i:j], t0, time.perf_counter())
            i = j
            continue
        if a.kind not in compute:
            raise ValueError(f"the executor cannot run action {a} (kind {a.kind!r})")
        t0 = time.perf_counter()
        compute[a.kind](a.chunk, a.mb)
        sync()
        t1 = time.perf_counter()
        compute_s += t1 - t0
        if timeline is not None:
            timeline.record(SPAN[a.kind], t0, t1, chunk=a.chunk, mb=a.mb)
        i += 1
    end = time.perf_counter()
    step_s = end - start
    if timeline is not None:
        timeline.record("schedule", start, end)
    if outputs or outbox or grads or inputs:
        left = [sorted(d)[:3] for d in (outputs, outbox, grads, inputs) if d]
        raise RuntimeError(f"the schedule left tensors unused (outputs/sends/grads/inputs): {left}")

    # One all-reduce over pp shares the last stage's losses and the first stage's timing.
    has_head = any(c.has_head for c in chunks)
    summary = torch.zeros(m + 2, dtype=torch.float64, device=device)
    if has_head:
        summary[:m] = torch.stack(losses).to(torch.float64)
    if pp.rank == 0:
        summary[m:] = torch.tensor([compute_s, step_s], dtype=torch.float64)
    comm.all_reduce(summary, pp)
    values = summary.tolist()
    return PipelineResult(
        loss=sum(values[:m]) / m,
        losses=values[:m],
        compute_s=compute_s,
        wait_s=wait_s,
        step_s=step_s,
        first_stage_compute_s=values[m],
        first_stage_step_s=values[m + 1],
    )
