"""The pipeline bubble the real executor realises, against theory, on a clock the schedule
drives (a ledger), not the wall: the figure cannot move with the machine's load.

Every rank keeps a ledger clock. A chunk's forward advances it by t, its input gradient (I) and
its weight gradients (W) by t each, in separate autograd nodes so that a split backward really
runs them apart (a full backward B: 2t); the first stage has no input gradient to pass on, so
its W does the whole backward (2t), as the real model's does (pipeline/actions.py
`compute_seconds`). Every p2p message carries its sender's ledger time in a companion message,
and a wait sets the receiver's clock to at least that time: communication is free and a rank is
idle exactly where the schedule makes it wait for a neighbour. The real executor runs each
schedule at pp 4 over gloo; the first stage's idle over its compute, its idle counted against
the longest schedule of any rank (as the metrics file's `bubble_measured`), equals the
schedule's theory: (p-1)/(v m) for GPipe, 1F1B and interleaved, (p-1)/3m for ZB-H1 (a third of
1F1B's), the schedule's own figure for ZB-V and DualPipeV. (Waits for sends are free here, so
an executor that blocked on its sends would not show; bench/bench_zero_bubble.py times that.)

Wall-clock bubbles, on stages that sleep, are `make bench` (bench/bench_zero_bubble.py).
"""

import pytest
import torch

from megalite.parallel import p2p
from megalite.pipeline.executor import idle_ratio, run_schedule
from megalite.pipeline.partition import rank_chunks
from megalite.pipeline.schedules import SCHEDULES, bubble_theory, get_schedule
from megalite.testing import spawn

pytestmark = [pytest.mark.distributed]
LEDGER = {"now": 0.0, "busy": 0.0}  # this rank's clock and its compute time (one per process)


def _spend(seconds: float):
    LEDGER["now"] += seconds
    LEDGER["busy"] += seconds


def _timed(seconds: float):
    class Timed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            _spend(seconds)
            return g

    return Timed.apply


class LedgerChunk(torch.nn.Module):
    """A chunk over (2, 4) activations whose computes advance the ledger (t = 1/vpp a stage)."""

    def __init__(self, layers, has_embedding, has_head, vpp=1):
        super().__init__()
        self.has_embedding, self.has_head, self.t = has_embedding, has_head, 1.0 / vpp
        self.w = torch.nn.Parameter(torch.ones(4))
        self.input_grad = _timed(self.t)
        self.weight_grad = _timed(2 * self.t if has_embedding else self.t)

    def forward(self, x, labels=None):
        _spend(self.t)
        x = torch.ones(2, 4) * x[:, :1] if self.has_embedding else self.input_grad(x * 1.0)
        wv = self.weight_grad(self.w)  # W: on the path to w only, its value cancelled
        y = x + wv - wv.detach()
        return y.sum() if self.has_head else y


def _ledger_post(post):
    """p2p.post whose messages carry their sender's ledger time; a wait for a receive moves
    this rank's clock to at least the sender's time at posting."""

    def ledger_post(ops, group):
        stamps = [torch.tensor([LEDGER["now"] if send else 0.0], dtype=torch.float64)
                  for send, _, _ in ops]  # fmt: skip
        n = len(ops)
        batch = post([*ops, *[(s, t, p) for (s, _, p), t in zip(ops, stamps)]], group)

        def wait(op=None):
            which = range(n) if op is None else [op]
            for i in which:
                for j in (i, n + i):  # the operation and its stamp
                    if j not in batch.waited:
                        batch.works[j].wait()
                        batch.waited.add(j)
            arrived = [stamps[i].item() for i in which if not ops[i][0]]
            LEDGER["now"] = max([LEDGER["now"], *arrived])
            return 0.0

        batch.wait = wait
        return batch

    return ledger_post


def _measure(rank, world, cases):
    from megalite.parallel.groups import build_groups
    from megalite.parallel.topology import Topology

    groups = build_groups(Topology(pp=world), torch.device("cpu"))
    real, out = p2p.post, {}
    p2p.post = _ledger_post(real)
    try:
        for name, vpp, m in cases:
            placement = SCHEDULES[name].placement
            chunks = [LedgerChunk(**kw, vpp=vpp)
                      for kw in rank_chunks(world * vpp, world, vpp, rank, placement)]  # fmt: skip
            LEDGER.update(now=0.0, busy=0.0)
            run_schedule(get_schedule(name, world, vpp, m, rank), chunks, groups,
                         [(torch.ones(2, 4), None)] * m, hidden_shape=(2, 4),
                         dtype=torch.float32, placement=placement)  # fmt: skip
            out[name, m] = (LEDGER["busy"], LEDGER["now"])
    finally:
        p2p.post = real
    return out


def test_realised_bubble_matches_theory():
    world = 4
    cases = [("gpipe", 1, 4), ("1f1b", 1, 4), ("1f1b", 1, 6), ("interleaved", 2, 4),
             ("zb-h1", 1, 4), ("zbv", 2, 4), ("dualpipev", 2, 8)]  # fmt: skip
    ranks = spawn(_measure, world, cases, timeout=240)
    bubble = {}
    for name, vpp, m in cases:
        busy, _ = ranks[0][name, m]
        step = max(r[name, m][1] for r in ranks)  # the longest schedule of any rank
        assert busy == pytest.approx(3 * m), (name, busy)  # F + B per micro-batch, per stage
        bubble[name, m] = idle_ratio(busy, step)
        theory = bubble_theory(world, vpp, m, name)
        # on the ledger the realised bubble is the theory itself (sleeping stages: +-0.05)
        assert bubble[name, m] == pytest.approx(theory, abs=1e-9), (name, m, bubble[name, m])
    # ZB-H1 idles a third of 1F1B at F = I = W
    assert bubble["zb-h1", 4] == pytest.approx(bubble["1f1b", 4] / 3), bubble
