"""Timed runs (pipeline/timed.py): the dependency-driven timing of a builder's orders, the
lockstep placement of messages from it, and the executor-like run of a whole table that the
verifier and the V schedules' bubble theory use."""

import pytest

from megalite.pipeline.actions import (
    SEND_F,
    Action,
    F,
    align_receives,
    interleaved_placement,
    v_placement,
)
from megalite.pipeline.one_f_one_b import one_f_one_b_order
from megalite.pipeline.timed import (
    UNIT,
    ScheduleError,
    compute_times,
    lockstep_table,
    run_table,
)
from megalite.pipeline.zero_bubble import dualpipev_order, zbv_order


def test_compute_times_of_1f1b():
    # F = 1, B = 2: the first stage computes 3m and ends after (m + pp - 1) * 3
    timed = compute_times(4, 1, 8, interleaved_placement, one_f_one_b_order)
    assert timed[0][-1][1] == 33.0 and sum(e - s for s, e, _ in timed[0]) == 24.0
    for events in timed:  # a rank runs one compute at a time, in its order
        assert all(a[1] <= b[0] for a, b in zip(events, events[1:]))


@pytest.mark.parametrize("build", [zbv_order, dualpipev_order])
def test_lockstep_messages_keep_the_timed_idle(build):
    """Messages posted in lockstep from the timed order: the executor-like run (rendezvous,
    batches whole and in order) neither deadlocks nor idles more than the timed order."""
    timed = compute_times(4, 2, 8, v_placement, build)
    step = max(events[-1][1] for events in timed)
    idle = 1 - sum(e - s for s, e, _ in timed[0]) / step
    table = align_receives(lockstep_table(4, 2, timed, v_placement))
    _, run_idle = run_table(table, 4, 2, v_placement, UNIT)
    assert run_idle[0] == pytest.approx(idle, abs=1e-12) and 0 < idle < 0.07


def test_run_table_refuses_an_unmatched_send():
    table = [[Action(F, 0, 0), Action(SEND_F, 0, 0, 1)], [Action(F, 0, 0)]]
    with pytest.raises(ScheduleError, match=r"rank 0 action 1 \(sF0>1\): rank 1 never receives"):
        run_table(table, 2, 1, interleaved_placement, UNIT)
