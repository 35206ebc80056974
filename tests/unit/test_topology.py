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
            topo = Topology(order, tp=tp, pp=pp, dp=dp)
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
    assert topo.coords(5) == {"tp": 1, "cp": 0, "dp": 0, "dpr": 0, "pp": 1}  # size 1, no place
    assert topo.next_stage(1) == 5 and topo.prev_stage(1) == 5
    assert topo.stage_groups([0, 1]) == [[0, 4], [1, 5], [2, 6], [3, 7]]  # embedding + head
    four = Topology(tp=1, pp=4, dp=1)
    assert [four.next_stage(r) for r in range(4)] == [1, 2, 3, 0]
    assert four.stage_groups([0, 3]) == [[0, 3]]


def test_bad_topology():
    with pytest.raises(ValueError):
        Topology(tp=0)
    with pytest.raises(ValueError, match="leaves out"):
        Topology("tp-dp", tp=2, pp=2)
    with pytest.raises(ValueError, match="unknown axes"):
        Topology("tp-xx-dp-pp")
    with pytest.raises(ValueError, match="twice"):
        Topology("tp-tp-dp-pp")


def test_size_one_axes_may_be_left_out_and_products():
    topo = Topology("pp-tp", tp=2, pp=2)
    assert topo.axes == ("pp", "tp", "dp", "cp", "dpr") and topo.groups("pp") == [[0, 1], [2, 3]]
    t = Topology(tp=2, pp=2, dp=2)
    assert t.groups("dp+pp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert [t.index("dp+pp", r) for r in t.group("dp+pp", 1)] == [0, 1, 2, 3]
    assert t.product(lambda a: a.replicated) == "dp"


def test_second_decomposition_keeps_pipeline_groups():
    t = Topology(tp=2, pp=2, dp=2)
    experts = t.regroup("etp-ep-edp-pp", etp=1, ep=4, edp=1)
    assert experts.groups("pp") == t.groups("pp") and experts.groups("ep") == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
    ]
    with pytest.raises(ValueError, match="same pipeline groups"):
        t.regroup("pp-ep", ep=4)


def test_context_parallel_axis():
    """cp sits between tp and dp by default; its ranks hold the same parameters (gradients
    reduced over dp+cp) but not different samples; at cp=1 the ranks of tp-dp-pp are unchanged."""
    t = Topology(tp=2, cp=2, dp=2)
    assert t.order == "tp-cp-dp-dpr-pp"
    assert t.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert t.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert t.product(lambda a: a.replicated) == "cp+dp"
    assert t.groups("dp+cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert t.product(lambda a: a.splits_batch) == "dp"
    old = Topology("tp-dp-pp", tp=2, dp=2, pp=2)
    new = Topology(tp=2, dp=2, pp=2)
    for axis in ("tp", "dp", "pp"):
        assert old.groups(axis) == new.groups(axis)


def test_describe_lists_small_layouts_and_summarises_16384_ranks():
    """Launch prints the layout: every group at 8 ranks; at Llama 3 405B's tp8 pp16 dp128 the
    first two groups of each axis, the last and their count, not 3,200 groups."""
    small = Topology(tp=2, pp=2, dp=2).describe().splitlines()
    assert small[1] == "  TP groups: [0, 1] [2, 3] [4, 5] [6, 7]"
    big = Topology(tp=8, pp=16, dp=128).describe().splitlines()
    assert big[1:] == [
        "  TP groups: (2,048) [0..7] [8..15] ... [16376..16383]",
        "  DP groups: (128) [0,8..1016] [1,9..1017] ... [15367,15375..16383]",
        "  PP groups: (1,024) [0,1024..15360] [1,1025..15361] ... [1023,2047..16383]",
    ]


def test_expert_tensor_parallel_groups():
    """With etp the experts' ranks are etp-ep-edp: consecutive ranks slice the same experts, the
    tokens travel over etp+ep, gradients are summed over edp; the dense groups are untouched."""
    from megalite.parallel.groups import rank_groups

    topo = Topology(tp=2, dp=4)
    topo.expert = topo.experts(2, 2)
    g = rank_groups(topo, 5)
    assert (g["tp"], g["dp"]) == ([4, 5], [1, 3, 5, 7])
    assert (g["etp"], g["ep"], g["etp+ep"], g["edp"]) == ([4, 5], [5, 7], [4, 5, 6, 7], [1, 5])
    plain = Topology(tp=2, dp=4)
    plain.expert = plain.experts(2)  # etp 1: no etp groups to create
    assert "etp" not in rank_groups(plain, 5) and "etp+ep" not in rank_groups(plain, 5)
    assert "ETP groups: [0, 1] [2, 3]" in topo.describe()


def test_hybrid_sharding_shard_group_and_its_copies():
    """--dp-replicate 2 at tp=2 dp=4: dp is the ZeRO shard group (2 ranks), dpr its 2 copies,
    laid out right after dp, so a shard group and its TP ranks share a node of 4 GPUs and only
    the copies' all-reduce crosses nodes. Every rank builds the shard group, the copies' and
    the replicas' (dp+dpr: the loss mean); at dpr=1 the groups are plain dp's."""
    from megalite.parallel.axes import batch_axis, replica_axis, shard_copies_axis, zero_shard_axis
    from megalite.parallel.groups import communicators, rank_groups

    t = Topology(tp=2, dp=2, dpr=2)
    assert t.order == "tp-cp-dp-dpr-pp"
    assert (t.product(zero_shard_axis), t.product(shard_copies_axis)) == ("dp", "dpr")
    assert t.product(replica_axis) == t.product(batch_axis) == "dp+dpr"
    assert t.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert t.groups("dpr") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert all(len({r // 4 for r in g}) == 1 for g in t.groups("tp+dp"))  # inside a node
    assert all(len({r // 4 for r in g}) == 2 for g in t.groups("dpr"))  # across nodes
    mine = rank_groups(t, 5)
    assert (mine["dp"], mine["dpr"], mine["dp+dpr"]) == ([5, 7], [1, 5], [1, 3, 5, 7])
    assert communicators(t, 5) == 4  # tp, dp, dpr, dp+dpr
    plain = Topology(tp=2, dp=4)
    assert plain.product(zero_shard_axis) == plain.product(replica_axis) == "dp"
    assert plain.product(shard_copies_axis) == "dpr" and plain.size("dpr") == 1
    assert communicators(plain, 5) == 2  # tp, dp: no group more than before
    # the copies do not change which samples a rank reads: its index along dp+dpr is plain dp's
    assert [t.index("dp+dpr", r) for r in range(8)] == [plain.index("dp", r) for r in range(8)]
