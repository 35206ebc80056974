"""The verifier (pipeline/verify.py) catches what a broken table would do: a dropped receive,
swapped sends, a backward before its forward, missing work, a wrong peer, a deadlock, a gradient
in a forward-only table; its timed run exposes a correct but serialising schedule."""

import dataclasses

import pytest

from megalite.pipeline.actions import (
    RECV_F,
    SEND_B,
    SEND_F,
    WAIT_F,
    Action,
    B,
    F,
    format_actions,
    with_comms,
)
from megalite.pipeline.one_f_one_b import interleaved_order, one_f_one_b_order
from megalite.pipeline.schedules import get_schedule
from megalite.pipeline.verify import ScheduleError, verify, verify_table


def _table(name, pp, vpp, m):
    return [get_schedule(name, pp, vpp, m, r) for r in range(pp)]


def _index(acts, kind, chunk, mb):
    return next(i for i, a in enumerate(acts) if (a.kind, a.chunk, a.mb) == (kind, chunk, mb))


def test_catches_a_dropped_recv():
    t = _table("1f1b", 4, 1, 4)
    del t[2][_index(t[2], RECV_F, 0, 1)]
    with pytest.raises(ScheduleError, match="rank 2 action .*forward before its input arrived"):
        verify_table(t, 4, 1, 4)


def test_catches_swapped_sends():
    t = _table("gpipe", 2, 1, 3)
    i, j = _index(t[0], SEND_F, 0, 0), _index(t[0], SEND_F, 0, 1)
    t[0][i], t[0][j] = t[0][j], t[0][i]
    with pytest.raises(ScheduleError, match="sends an activation not computed yet"):
        verify_table(t, 2, 1, 3)
    # rank 1 forwards micro-batch 1 before 0: legal locally, but the pairs disagree
    t = _table("gpipe", 2, 1, 3)
    swap = {0: 1, 1: 0, 2: 2}
    t[1] = [dataclasses.replace(a, mb=swap[a.mb]) if a.kind in (F, RECV_F, WAIT_F) else a
            for a in t[1]]  # fmt: skip
    with pytest.raises(ScheduleError, match="send #0 from rank 0 to rank 1, but receive #0"):
        verify_table(t, 2, 1, 3)


def test_catches_backward_before_forward():
    t = _table("1f1b", 2, 1, 2)
    acts = t[1]
    i, j = _index(acts, F, 0, 1), _index(acts, B, 0, 1)
    acts[i], acts[j] = acts[j], acts[i]
    with pytest.raises(ScheduleError, match="rank 1 action .*B1.*backward before its forward"):
        verify_table(t, 2, 1, 2)


def test_catches_missing_work_and_wrong_peer():
    t = _table("1f1b", 2, 1, 2)
    t[1] = [a for a in t[1] if not (a.kind in (B, SEND_B) and a.mb == 1)]
    with pytest.raises(ScheduleError, match="rank 1: no B"):
        verify_table(t, 2, 1, 2)
    t = _table("1f1b", 3, 1, 2)
    k = _index(t[0], SEND_F, 0, 0)
    t[0][k] = dataclasses.replace(t[0][k], peer=2)
    with pytest.raises(ScheduleError, match="wrong peer"):
        verify_table(t, 3, 1, 2)


def test_catches_deadlock():
    # interleaved with a batch after every single compute: ranks 0 and 1 of pp=2 each post a
    # lone send of a gradient while the other waits to send one too
    t = [with_comms([[a] for seg in interleaved_order(2, 2, 4, r) for a in seg], 2, 2, r)
         for r in range(2)]  # fmt: skip
    with pytest.raises(ScheduleError, match="deadlock: rank 0 action .* waits for rank 1"):
        verify_table(t, 2, 2, 4)


def test_forward_only_schedules_carry_no_gradients():
    t = [get_schedule("1f1b", 2, 1, 3, r, forward_only=True) for r in range(2)]
    assert format_actions(t[0], comms=True) == "F0 [sF0>1] F1 [sF1>1] F2 [sF2>1]"
    verify_table(t, 2, 1, 3, forward_only=True)
    with pytest.raises(ScheduleError, match="a gradient in a forward-only schedule"):
        verify_table(_table("1f1b", 2, 1, 3), 2, 1, 3, forward_only=True)


def test_simulated_bubble_exposes_a_serialising_schedule():
    # 1F1B without warmup is correct but runs one micro-batch through the pipe at a time
    segs = [[[a] for k in range(4) for a in (Action(F, 0, k), Action(B, 0, k))] for _ in range(4)]
    t = [with_comms(segs[r], 4, 1, r) for r in range(4)]
    slow = verify_table(t, 4, 1, 4)
    assert slow.peak_activations == [1, 1, 1, 1]
    assert slow.idle[0] > 0.7 > verify("1f1b", 4, 1, 4).idle[0] == pytest.approx(3 / 7)
    assert one_f_one_b_order(4, 1, 4, 3) == segs[3]  # the last stage does just that
