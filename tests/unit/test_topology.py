import itertools

import pytest

from megalite.parallel.topology import Topology


def factorisations(n):
    for tp, pp in itertools.product(range(1, n + 1), repeat=2):
        if n % (tp * pp) == 0:
            yield tp, pp, n // (tp * pp)


@pytest.mark.parametrize("world", range(1, 17))
def test_groups_partition_the_world(world):
    for tp, pp, dp in factorisations(world):
        for order in ("tp-dp-pp", "tp-pp-dp", "pp-tp-dp"):
            topo = Topology(tp, pp, dp, order)
            for axis, size in (("tp", tp), ("pp", pp), ("dp", dp), ("tp+pp", tp * pp)):
                groups = topo.groups(axis)
                flat = sorted(r for g in groups for r in g)
                assert flat == list(range(world)), (topo, axis)  # each rank exactly once
                assert all(len(g) == size for g in groups)
                for g in groups:
                    for r in g:
                        assert topo.group(axis, r) == g
            # every (tp, dp, pp) coordinate is one rank, and coords/rank are inverse
            seen = {tuple(topo.coords(r).values()) for r in range(world)}
            assert len(seen) == world
            for r in range(world):
                assert topo.rank(**topo.coords(r)) == r
            if order.startswith("tp"):
                for g in topo.groups("tp"):
                    assert g == list(range(g[0], g[0] + tp))  # TP ranks contiguous


def test_default_order_and_neighbours():
    topo = Topology(tp=2, pp=2, dp=2)
    assert topo.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.coords(5) == {"tp": 1, "dp": 0, "pp": 1}
    assert topo.next_stage(1) == 5 and topo.prev_stage(1) == 5
    assert topo.is_first_stage(3) and topo.is_last_stage(7) and not topo.is_last_stage(3)
    assert topo.embedding_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    four = Topology(tp=1, pp=4, dp=1)
    assert [four.next_stage(r) for r in range(4)] == [1, 2, 3, 0]
    assert four.embedding_groups() == [[0, 3]]


def test_bad_topology():
    with pytest.raises(ValueError):
        Topology(0, 1, 1)
    with pytest.raises(ValueError):
        Topology(1, 1, 1, order="tp-dp")
