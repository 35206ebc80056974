import os

import pytest
import torch
import torch.distributed as dist

from megalite.parallel import comm
from megalite.parallel import groups as pg
from megalite.parallel.topology import Topology
from megalite.testing import spawn

pytestmark = pytest.mark.distributed


def _all_reduce_in_each_group(rank, world):
    topo = Topology(tp=2, pp=2, dp=2)
    out = {}
    groups = pg.build_groups(topo, torch.device("cpu"), products=("tp+pp",))
    for kind in ("tp", "pp", "dp", "tp+pp", "world"):
        g = groups.world if kind == "world" else groups.get(kind)
        x = torch.tensor([float(2**rank)])
        from megalite.parallel import comm

        comm.all_reduce(x, g)
        out[kind] = int(x.item())
    out["embed"] = groups.embed.ranks if groups.embed else None
    return out


def test_all_reduce_sums_exactly_the_topology_groups():
    topo = Topology(tp=2, pp=2, dp=2)
    results = spawn(_all_reduce_in_each_group, 8)
    for rank, res in enumerate(results):
        for kind, axis in (("tp", "tp"), ("pp", "pp"), ("dp", "dp"), ("tp+pp", "tp+pp")):
            expected = sum(2**r for r in topo.group(axis, rank))  # bit r set <=> rank r took part
            assert res[kind] == expected, (rank, kind)
        assert res["world"] == 2**8 - 1
        assert res["embed"] == topo.group("pp", rank)


def _gloo_threads() -> int:
    """This process's gloo worker threads (torch names them)."""
    tasks = os.listdir("/proc/self/task")
    return sum(open(f"/proc/self/task/{t}/comm").read().strip() == "pt_gloo_runloop" for t in tasks)


def _collectives_then_destroy(rank, world):
    groups = pg.build_groups(Topology(tp=2, pp=2), torch.device("cpu"))
    for g in (groups.tp, groups.pp, groups.embed, groups.world):
        comm.all_reduce(torch.ones(3), g)
    out = [None] * world
    dist.all_gather_object(out, rank)  # as a checkpoint save ends
    before = _gloo_threads()
    pg.destroy(groups, barrier=True)
    return before, _gloo_threads()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_destroy_joins_the_gloo_threads_before_interpreter_exit():
    # A gloo worker still running at interpreter exit can take the GIL of a finalizing
    # interpreter and abort the process (see pg.destroy); none may be left.
    for before, after in spawn(_collectives_then_destroy, 4):
        assert before > 0 and after == 0, (before, after)


def _layouts():
    """Three worlds, with the groups a run builds: 8 ranks (tp2 pp2 dp2), 1,024 (tp8 pp4 dp32,
    experts over ep8, a product), 16,384 (Llama 3 405B's tp8 pp16 dp128)."""
    moe = Topology(tp=8, pp=4, dp=32)
    moe.expert = moe.experts(8)
    return {
        8: (Topology(tp=2, pp=2, dp=2), ("tp+pp",)),
        1024: (moe, ("tp+dp",)),
        16384: (Topology(tp=8, pp=16, dp=128), ()),
    }


@pytest.mark.parametrize("world", [8, 1024, 16384])
def test_a_rank_creates_only_the_groups_it_is_in(world):
    from megalite.training.fake_groups import count_groups
    from megalite.training.fake_world import witnesses

    topo, products = _layouts()[world]
    ranks = sorted({*witnesses(topo, full=False), topo.world_size - 1})
    counts = count_groups(topo, ranks, products=products)
    for c in counts:
        # its groups (the world is init_process_group's), none for others, nothing world-wide
        assert (c.created, c.world_ops, c.foreign) == (c.member_of, 0, 0), c
    # distinct groups at an end stage: 8: tp, pp (= embed at pp2), dp, tp+pp; 1,024: tp (= ep),
    # pp, dp (= edp), tp+dp, embed; 16,384: tp, pp, dp, embed
    assert max(c.member_of for c in counts) == {8: 4, 1024: 5, 16384: 4}[world]
