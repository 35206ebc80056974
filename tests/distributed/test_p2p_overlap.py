"""Point-to-point latency is hidden where the schedule leaves room for it.

Every message is delayed by a fixed d (it arrives d after its sender posted it: each send carries
its posting time in a companion message, and an operation completes no earlier than its message
arrives). Posting is separate from waiting (pipeline/actions.py), so a rank only waits where it needs a
received tensor that is not there yet. With GPipe, whose forwards and backwards stream, the step
grows by about the warm-up and cool-down hops times d, not by the number of p2p batches times d
as it does when every batch is waited for at once (the executor before this change, emulated
here in the same run). 1F1B's steady state leaves no room (each stage needs what its
neighbour has just computed), so latency shows on each hop there; it still grows less.
"""

import time

import pytest
import torch

from megalite.parallel import p2p
from megalite.pipeline.actions import COMM
from megalite.pipeline.executor import run_schedule
from megalite.pipeline.partition import rank_chunks
from megalite.pipeline.schedules import get_schedule
from megalite.testing import spawn

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
DELAY, COMPUTE = 0.03, 0.01  # seconds: per message, and per forward (backward twice)


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        time.sleep(COMPUTE)
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        time.sleep(2 * COMPUTE)
        return g


class SleepChunk(torch.nn.Module):
    """A stage that takes a fixed time forward and twice that backward."""

    def __init__(self, layers, has_embedding, has_head):
        super().__init__()
        self.has_embedding, self.has_head = has_embedding, has_head
        self.w = torch.nn.Parameter(torch.ones(()))

    def forward(self, x, labels=None):
        if self.has_embedding:
            x = torch.zeros(x.shape[0], 4) + x[:, :1]
        y = _Sleep.apply(x * self.w)
        return y.sum() if self.has_head else y


def _delayed(post):
    """p2p.post with every message arriving DELAY after its sender posted it."""

    def delayed_post(ops, group):
        now = time.perf_counter()
        stamps = [torch.tensor([now], dtype=torch.float64) if send else torch.zeros(1, dtype=torch.float64)
                  for send, _, _ in ops]  # fmt: skip
        n = len(ops)
        batch = post([*ops, *[(s, t, p) for (s, _, p), t in zip(ops, stamps)]], group)
        works = batch.works  # one per operation on gloo: theirs, then their stamps'

        def delayed_wait(op=None):
            t0 = time.perf_counter()
            which = range(n) if op is None else [op]
            for i in which:
                for j in (i, n + i):
                    if j not in batch.waited:
                        works[j].wait()
                        batch.waited.add(j)
            batch.done = op is None
            arrive = max(stamps[i].item() for i in which) + DELAY  # a send: ours; a receive: theirs
            time.sleep(max(0.0, arrive - time.perf_counter()))
            return time.perf_counter() - t0

        batch.wait = delayed_wait
        return batch

    return delayed_post


def _blocking(post):
    """The executor as it was: every batch waited for as a whole right after it is posted."""

    def blocking_post(ops, group):
        batch = post(ops, group)
        batch.wait()
        return batch

    return blocking_post


def _steps(rank, world, name, m):
    """The first stage's step time: plain, with delayed messages, and with delayed messages
    under the old blocking semantics (the best of two runs each)."""
    from megalite.parallel.groups import build_groups
    from megalite.parallel.topology import Topology

    groups = build_groups(Topology(pp=world), torch.device("cpu"))
    chunks = [SleepChunk(**kw) for kw in rank_chunks(world, world, 1, rank)]
    data = [(torch.ones(2, 4), None)] * m
    actions = get_schedule(name, world, 1, m, rank)
    real, best = p2p.post, {}
    modes = {"plain": real, "delayed": _delayed(real), "blocking": _blocking(_delayed(real))}
    for mode in [*modes, *modes]:
        p2p.post = modes[mode]
        try:
            result = run_schedule(actions, chunks, groups, data, hidden_shape=(2, 4),
                                  dtype=torch.float32)  # fmt: skip
        finally:
            p2p.post = real
        best[mode] = min(best.get(mode, 1e9), result.first_stage_step_s)
    batches = sum(
        a.kind in COMM and (i == 0 or actions[i - 1].kind not in COMM)
        for i, a in enumerate(actions)
    )  # fmt: skip (posted batches)
    return best, batches


def test_latency_is_hidden_where_the_schedule_has_room():
    world, m = 2, 8
    best, batches = spawn(_steps, world, "gpipe", m)[0]
    grow = (best["delayed"] - best["plain"]) / DELAY
    blocking = (best["blocking"] - best["plain"]) / DELAY
    # GPipe's forwards (backwards) stream: only the first hop and the last are exposed
    assert grow < 4 and blocking > 0.6 * batches, (grow, blocking, batches)
    # 1F1B's steady state has no slack (each stage needs what its neighbour just computed),
    # so latency shows on every hop; waiting only where needed still beats waiting per batch
    best, batches = spawn(_steps, world, "1f1b", m)[0]
    assert best["delayed"] < best["blocking"], best
