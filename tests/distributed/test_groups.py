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
