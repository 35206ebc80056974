"""The registry (pipeline/schedules.py) and the builders it lists (one_f_one_b.py,
zero_bubble.py): every small shape of every schedule verifies with its theory's bubble and its
promised activations, the text form, clear shape errors, and the vpp a schedule fixes."""

import pytest

from megalite.errors import MegaliteError
from megalite.pipeline.actions import format_actions
from megalite.pipeline.schedules import (
    SCHEDULES,
    bubble_theory,
    format_table,
    get_schedule,
    idle_theory,
    schedule,
)
from megalite.pipeline.verify import peak_bound, verify


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


def test_bubble():
    assert bubble_theory(4, 2, 8) == pytest.approx(3 / 16)


def test_each_schedule_says_how_many_chunks_it_runs():
    # a V always runs two chunks per rank: it fills in the default --vpp 1, never another one
    for name in ("zbv", "dualpipev"):
        assert schedule(name).chunks == 2
        assert schedule(name).vpp(1) == 2 and schedule(name).vpp(3) == 3
    for name in ("gpipe", "1f1b", "zb-h1"):
        assert schedule(name).vpp(1) == 1 and schedule(name).vpp(2) == 2
    assert schedule("interleaved").chunks is None and schedule("interleaved").vpp(3) == 3
    assert set(SCHEDULES) == {"gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev"}


def _cfg(name, vpp=1, layers=4):
    from megalite.config import Config

    cfg = Config()
    cfg.model.num_layers, cfg.parallel.pp, cfg.parallel.vpp = layers, 2, vpp
    cfg.parallel.pp_schedule = name
    cfg.training.global_batch_size, cfg.training.micro_batch_size = 8, 1
    return cfg


def test_a_v_schedule_without_vpp_infers_it(capsys):
    from megalite.shape import derive, validate

    for name in ("zbv", "dualpipev"):
        cfg = _cfg(name)
        shape = derive(cfg, 2)
        assert (shape.vpp, shape.schedule, cfg.parallel.vpp) == (2, name, 1)  # cfg untouched
        assert validate(cfg, 2).vpp == 2
        assert f"vpp=2 inferred: the {name} schedule runs 2 chunks" in capsys.readouterr().err
    # the layers are checked against the inferred vpp: 2 ranks * 2 chunks do not split 6 layers
    with pytest.raises(MegaliteError, match=r"not divisible by pp\*vpp=2\*2"):
        derive(_cfg("zbv", layers=6), 2)
    # an explicit wrong --vpp stays refused, and a default one is not inferred for others
    with pytest.raises(MegaliteError, match="two chunks per rank in a V: --vpp 2, not 3"):
        derive(_cfg("zbv", vpp=3, layers=12), 2)
    with pytest.raises(MegaliteError, match="vpp >= 2"):
        derive(_cfg("interleaved"), 2)
    assert derive(_cfg("zbv", vpp=2), 2).vpp == 2
    validate(_cfg("zbv", vpp=2), 2)
    assert "inferred" not in capsys.readouterr().err


def test_the_executor_docstring_shows_the_real_schedule():
    """executor.py's example (one rank's actions at pp=2, m=4) is the schedule builder's output."""
    from megalite.pipeline import executor
    from megalite.pipeline.actions import format_action

    for r in range(2):
        line = " ".join(format_action(a) for a in get_schedule("1f1b", 2, 1, 4, r))
        assert f"    rank {r}: {line}\n" in executor.__doc__
