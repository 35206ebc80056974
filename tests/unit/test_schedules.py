import dataclasses

import pytest

from megalite.errors import MegaliteError
from megalite.pipeline.schedules import (
    RECV_F,
    SEND_B,
    SEND_F,
    WAIT_F,
    Action,
    B,
    F,
    bubble_theory,
    format_actions,
    format_table,
    get_schedule,
    idle_theory,
    interleaved_order,
    one_f_one_b_order,
    with_comms,
)
from megalite.pipeline.verify import ScheduleError, peak_bound, verify, verify_table


def shapes():
    """Every valid (name, pp, vpp, m) with pp <= 8, vpp <= 4, m <= 16."""
    for pp in range(1, 9):
        for m in range(1, 17):
            yield "gpipe", pp, 1, m
            yield "1f1b", pp, 1, m
            yield "zb-h1", pp, 1, m
            yield "zbv", pp, 2, m
            if m >= 2 * pp:
                yield "dualpipev", pp, 2, m
            if m % pp == 0:
                for vpp in range(2, 5):
                    yield "interleaved", pp, vpp, m


def test_every_small_schedule_verifies():
    n = 0
    for name, pp, vpp, m in shapes():
        report = verify(name, pp, vpp, m)
        verify(name, pp, vpp, m, forward_only=True)
        # timed with its cost model (F=1, B=2; or F=I=W=1) and free p2p, the first stage idles
        # exactly as the schedule's theory says
        theory = bubble_theory(pp, vpp, m, name)
        assert report.bubble_theory == theory
        assert report.idle[0] == pytest.approx(theory / (1 + theory), abs=1e-12), (name, pp, m)
        if name in ("gpipe", "1f1b", "interleaved"):
            assert theory == (pp - 1) / (vpp * m)
            assert report.idle[0] == pytest.approx(idle_theory(pp, vpp, m), abs=1e-12)
        n += 1
    assert n > 600


def test_zero_bubble_against_1f1b():
    """ZB-H1 idles a third of 1F1B (F = I = W: (p-1)/3m against (p-1)/m) with 1F1B's most
    activations; ZB-V, two chunks per rank in a V, nearly none at 2p chunk activations."""
    for pp, m in ((4, 8), (8, 16)):
        assert bubble_theory(pp, 1, m, "zb-h1") == pytest.approx(bubble_theory(pp, 1, m) / 3)
        h1 = verify("zb-h1", pp, 1, m)
        assert max(h1.peak_activations) == max(verify("1f1b", pp, 1, m).peak_activations)
        v = verify("zbv", pp, 2, m)
        assert v.idle[0] < 0.08 and max(v.peak_activations) <= 2 * pp
    # the V's turn is a local hand-over: rank pp-1 sends nothing to itself
    last = get_schedule("zbv", 4, 2, 8, 3)
    assert all(a.peer != 3 for a in last if a.peer is not None)


def test_peak_activations_are_the_known_bounds():
    assert verify("gpipe", 4, 1, 8).peak_activations == [8, 8, 8, 8]
    assert verify("1f1b", 4, 1, 8).peak_activations == [4, 3, 2, 1]
    assert verify("1f1b", 4, 1, 2).peak_activations == [2, 2, 2, 1]
    # Megatron's interleaved warmup 2*(pp-rank-1) + (vpp-1)*pp, plus one
    assert verify("interleaved", 4, 2, 8).peak_activations == [11, 9, 7, 5]
    assert peak_bound("interleaved", 2, 2, 2, 0) == 4  # capped by m*vpp


def test_text_form():
    assert format_actions(get_schedule("1f1b", 4, 1, 6, 0)) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5"
    assert format_actions(get_schedule("1f1b", 4, 1, 6, 3)) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"
    assert format_actions(get_schedule("gpipe", 2, 1, 3, 1)) == "F0 F1 F2 B0 B1 B2"
    assert format_actions(get_schedule("1f1b", 1, 1, 2, 0), comms=True) == "F0 B0 F1 B1"
    line = format_actions(get_schedule("interleaved", 2, 2, 2, 1), chunks=2)
    assert line == "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 B0.0 B1.0"
    with_comm = format_actions(get_schedule("1f1b", 2, 1, 2, 0), comms=True)
    assert with_comm == "F0 [sF0>1] F1 [sF1>1 rB0<1] B0 [rB1<1] B1"
    assert format_table("1f1b", 2, 1, 2).splitlines()[1] == "rank 1: F0 B0 F1 B1"


def test_bad_shapes_are_clear_errors():
    with pytest.raises(MegaliteError, match="multiple of pp=4"):
        get_schedule("interleaved", 4, 2, 6, 0)
    with pytest.raises(MegaliteError, match="unknown pipeline schedule"):
        get_schedule("zigzag", 2, 1, 4, 0)
    with pytest.raises(MegaliteError, match="use interleaved"):
        get_schedule("1f1b", 2, 2, 4, 0)
    with pytest.raises(MegaliteError, match="vpp >= 2"):
        get_schedule("interleaved", 2, 1, 4, 0)
    with pytest.raises(MegaliteError, match=r"at least 2\*pp=8 micro-batches"):
        get_schedule("dualpipev", 4, 2, 6, 0)
    with pytest.raises(MegaliteError, match="two chunks per rank in a V: --vpp 2, not 1"):
        get_schedule("zbv", 4, 1, 8, 0)


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


def test_bubble():
    assert bubble_theory(4, 2, 8) == pytest.approx(3 / 16)


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
