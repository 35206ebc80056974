"""The pipeline bubble the real executor realises, against theory, on a clock the schedule
drives (tests/distributed/ledger.py), not the wall: the figure cannot move with the machine's
load. The real executor runs each schedule at pp 4 over gloo on ledger chunks; the first
stage's idle over its compute, its idle counted against the longest schedule of any rank (as the
metrics file's `bubble_measured`), equals the schedule's theory: (p-1)/(v m) for GPipe, 1F1B
and interleaved, (p-1)/3m for ZB-H1 (a third of 1F1B's), the schedule's own figure for ZB-V and
DualPipeV. Waits for sends are free on the ledger, so an executor that blocked on its sends
would not show here: wall-clock bubbles, on stages that sleep, are `make bench`
(bench/pipeline/bench_zero_bubble.py).
"""

import pytest
import torch

from megalite.parallel import p2p
from megalite.pipeline.executor import idle_ratio, run_schedule
from megalite.pipeline.partition import rank_chunks
from megalite.pipeline.schedules import SCHEDULES, bubble_theory, get_schedule
from megalite.testing import spawn
from tests.distributed.ledger import LEDGER, LedgerChunk, ledger_post

pytestmark = [pytest.mark.distributed]


def _measure(rank, world, cases):
    from megalite.parallel.groups import build_groups
    from megalite.parallel.topology import Topology

    groups = build_groups(Topology(pp=world), torch.device("cpu"))
    real, out = p2p.post, {}
    p2p.post = ledger_post(real)
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
