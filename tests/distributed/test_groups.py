import pytest
import torch

from megalite.parallel import groups as pg
from megalite.parallel.topology import Topology
from tests.spawn import spawn

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
