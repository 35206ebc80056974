"""The vocabulary of schedules (pipeline/actions.py): placements and their inverse, where the
communication of a compute goes, how `with_comms` pairs a segment's sends with the next one's
receives, the cost rule of timed runs, and `Schedule.vpp`."""

from megalite.pipeline.actions import (
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    WAIT_B,
    WAIT_F,
    Action,
    B,
    F,
    I,
    Schedule,
    W,
    batch_order,
    compute_seconds,
    format_actions,
    interleaved_placement,
    neighbours,
    owner,
    v_placement,
    with_comms,
)


def test_placements_and_their_inverse():
    for placement in (interleaved_placement, v_placement):
        for pp in (1, 2, 4):
            seen = set()
            for r in range(pp):
                for c in range(2):
                    vs = placement(pp, 2, r, c)
                    assert owner(placement, pp, 2, vs) == (r, c)
                    seen.add(vs)
            assert seen == set(range(2 * pp))
    assert [v_placement(4, 2, r, 1) for r in range(4)] == [7, 6, 5, 4]  # the V turns back
    assert [interleaved_placement(4, 2, r, 1) for r in range(4)] == [4, 5, 6, 7]


def test_neighbours():
    # rank 1 of 1F1B pp=3: a forward receives from rank 0 and sends to rank 2
    recv, send = neighbours(Action(F, 0, 5), 3, 1, 1)
    assert (recv, send) == (Action(RECV_F, 0, 5, 0), Action(SEND_F, 0, 5, 2))
    recv, send = neighbours(Action(B, 0, 5), 3, 1, 1)
    assert (recv, send) == (Action(RECV_B, 0, 5, 2), Action(SEND_B, 0, 5, 0))
    assert neighbours(Action(W, 0, 5), 3, 1, 1) == (None, None)  # weight gradients stay
    assert neighbours(Action(F, 0, 0), 3, 1, 0)[0] is None  # the first stage reads tokens
    # the turn of the V is a local hand-over: chunk 0 of the last rank feeds its chunk 1
    assert neighbours(Action(F, 0, 0), 2, 2, 1, v_placement) == (Action(RECV_F, 0, 0, 0), None)
    # and its chunk 1's gradient comes from rank 0 (the last stage), then stays on the rank
    assert neighbours(Action(I, 1, 0), 2, 2, 1, v_placement) == (Action(RECV_B, 1, 0, 0), None)


def test_with_comms_pairs_sends_with_the_next_receives():
    segs = [[Action(F, 0, 0)], [Action(F, 0, 1)], [Action(B, 0, 0)], [Action(B, 0, 1)]]
    acts = with_comms(segs, 2, 1, 0)
    assert format_actions(acts, comms=True) == "F0 [sF0>1] F1 [sF1>1 rB0<1] B0 [rB1<1] B1"
    assert [a.kind for a in acts if a.kind in (WAIT_F, WAIT_B)] == [WAIT_B, WAIT_B]
    assert acts.index(Action(WAIT_B, 0, 0)) == acts.index(Action(B, 0, 0)) - 1
    assert (
        sorted([Action(RECV_B, 0, 0, 1), Action(SEND_F, 0, 1, 1)], key=batch_order)[0].kind
        == SEND_F
    )


def test_the_cost_rule():
    cost = {F: 1.0, B: 2.0, I: 1.0, W: 1.5}
    assert compute_seconds(F, 0, cost) == 1.0 and compute_seconds(B, 0, cost) == 2.0
    # the first stage has no input gradient to pass on: its W does the whole backward
    assert compute_seconds(I, 0, cost) == 0.0 and compute_seconds(W, 0, cost) == 2.5
    assert compute_seconds(I, 1, cost) == 1.0 and compute_seconds(W, 1, cost) == 1.5


def test_a_schedule_fixes_its_chunks_or_takes_vpp():
    def build(pp, vpp, m, r):
        return []

    free = Schedule("free", build, lambda pp, vpp, m: None, lambda pp, vpp, m, r: 0)
    v = Schedule("v", build, lambda pp, vpp, m: None, lambda pp, vpp, m, r: 0, chunks=2)
    assert [free.vpp(n) for n in (1, 2, 3)] == [1, 2, 3]
    assert [v.vpp(n) for n in (1, 2, 3)] == [2, 2, 3]  # only the default is filled in


def test_builders_and_the_executor_import_only_the_vocabulary():
    from tests.unit.test_imports import graph

    g = graph()

    def pipeline_imports(module):
        inside = (m for m in g[f"megalite.pipeline.{module}"] if m.startswith("megalite.pipeline."))
        return {m.rsplit(".", 1)[1] for m in inside}

    assert pipeline_imports("executor") == {"actions", "split_backward"}  # not the registry
    assert pipeline_imports("one_f_one_b") == {"actions"}
    assert pipeline_imports("zero_bubble") == {"actions", "timed"}
    assert pipeline_imports("timed") == {"actions"} and pipeline_imports("actions") == set()
