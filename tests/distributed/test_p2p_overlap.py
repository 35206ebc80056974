"""Point-to-point latency is hidden where the schedule leaves room for it.

On the ledger clock (tests/distributed/ledger.py: time the schedule drives, not the wall)
every message arrives DELAY after its sender posted it, and an operation completes no earlier
than its message arrives. Posting is separate from waiting (pipeline/actions.py), so a rank
only waits where it needs a received tensor that is not there yet. With GPipe, whose forwards
and backwards stream, the step grows by about the warm-up and cool-down hops times DELAY, not
by the number of p2p batches times DELAY as it does when every batch is waited for at once
(the executor before this change, emulated here in the same run). 1F1B's steady state leaves
no room (each stage needs what its neighbour has just computed), so latency shows on each hop
there; it still grows less.
"""

import pytest
import torch

from megalite.parallel import p2p
from megalite.pipeline.actions import COMM
from megalite.pipeline.executor import run_schedule
from megalite.pipeline.partition import rank_chunks
from megalite.pipeline.schedules import get_schedule
from megalite.testing import spawn
from tests.distributed.ledger import LEDGER, LedgerChunk, ledger_post

pytestmark = [pytest.mark.distributed]
DELAY, COMPUTE = 3.0, 1.0  # ledger seconds: per message, and per forward (backward twice)


def _steps(rank, world, name, m):
    """Every rank's ledger time at the end of the step: plain, with delayed messages, and with
    delayed messages under the old blocking semantics."""
    from megalite.parallel.groups import build_groups
    from megalite.parallel.topology import Topology

    groups = build_groups(Topology(pp=world), torch.device("cpu"))
    chunks = [LedgerChunk(**kw, stage=COMPUTE) for kw in rank_chunks(world, world, 1, rank)]
    data = [(torch.ones(2, 4), None)] * m
    actions = get_schedule(name, world, 1, m, rank)
    real, end = p2p.post, {}
    modes = {"plain": ledger_post(real), "delayed": ledger_post(real, DELAY),
             "blocking": ledger_post(real, DELAY, blocking=True)}  # fmt: skip
    for mode, post in modes.items():
        p2p.post = post
        LEDGER.update(now=0.0, busy=0.0)
        try:
            run_schedule(actions, chunks, groups, data, hidden_shape=(2, 4), dtype=torch.float32)
        finally:
            p2p.post = real
        end[mode] = LEDGER["now"]
    batches = sum(
        a.kind in COMM and (i == 0 or actions[i - 1].kind not in COMM)
        for i, a in enumerate(actions)
    )  # fmt: skip (posted batches)
    return end, batches


def _step(ranks, mode):
    return max(end[mode] for end, _ in ranks)  # the longest schedule of any rank


def test_latency_is_hidden_where_the_schedule_has_room():
    world, m = 2, 8
    ranks = spawn(_steps, world, "gpipe", m)
    batches = ranks[0][1]
    grow = (_step(ranks, "delayed") - _step(ranks, "plain")) / DELAY
    blocking = (_step(ranks, "blocking") - _step(ranks, "plain")) / DELAY
    # GPipe's forwards (backwards) stream: only the first hop and the last are exposed; waited
    # for whole at once, each batch costs its own hop (sends complete when their message lands)
    assert grow == pytest.approx(2.0) and blocking >= batches, (grow, blocking, batches)
    # 1F1B's steady state has no slack (each stage needs what its neighbour just computed),
    # so latency shows on every hop; waiting only where needed still beats waiting per batch
    ranks = spawn(_steps, world, "1f1b", m)
    assert _step(ranks, "delayed") < _step(ranks, "blocking"), ranks
