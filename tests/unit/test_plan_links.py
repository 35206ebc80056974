"""plan/links.py: each group's bytes over NVLink inside a node and the network across nodes."""

import pytest

from megalite.plan import links
from megalite.plan.layouts import layout
from tests.unit.plan_configs import big


def test_ring_all_to_all_and_p2p_split_by_ranks_per_node():
    # one node: everything over NVLink
    assert links.split(100.0, list(range(8)), 8, links.RING) == {"nvlink": 100.0, "network": 0.0}
    # one rank per node (dp at tp8): a rank's whole ring share leaves the node
    assert links.split(100.0, [0, 8, 16, 24], 8, links.RING)["network"] == 100.0
    # two per node (dp at tp4): two rings, one per NIC: half of it on the network
    assert links.split(100.0, [0, 4, 8, 12], 8, links.RING) == {"nvlink": 50.0, "network": 50.0}
    # all-to-all over 16 ranks, 8 per node: 8 of the 15 other ranks are in the other node
    a2a = links.split(150.0, list(range(16)), 8, links.ALL_TO_ALL)
    assert a2a["network"] == pytest.approx(80.0) and a2a["nvlink"] == pytest.approx(70.0)
    # a pipeline hop into the next node: on the network
    assert links.split(10.0, [0, 8], 8, links.P2P) == {"nvlink": 0.0, "network": 10.0}


def test_a_layouts_kinds_land_on_their_links():
    cfg = big("llama", 8, 1024, 8, 1024, 32000, mbs=1, gbs=64)
    shape = layout(cfg, tp=8, pp=2, dp=4)  # 64 ranks: tp in a node, dp and pp across
    comm = {"tp": 1e9, "dp": 1e9, "pp": 1e9, "embed": 1e9}
    per = links.link_bytes(shape, comm, gpus_per_node=8)
    assert per["tp"] == {"nvlink": 1e9, "network": 0.0}
    assert per["dp"]["network"] == per["pp"]["network"] == per["embed"]["network"] == 1e9
    assert links.totals(per) == {"nvlink": 1e9, "network": 3e9}
    # the slower link sets a group's pace
    assert links.seconds({"nvlink": 300e9, "network": 25e9}, 300, 25) == pytest.approx(1.0)


def test_recorded_collectives_go_through_the_same_factors():
    calls = {
        tuple(range(8)): [("all_reduce", (4, 8), "float32")],  # 128 B over one node
        (0, 8): [
            ("all_gather_single", (16,), "bfloat16"),
            ("all_to_all_single", ("*", 4), "float32"),
        ],
        (0,): [("broadcast", (), "object")],
    }
    out = links.recorded(calls, 8)
    assert out["nvlink"] == pytest.approx(2 * 7 / 8 * 128)
    assert out["network"] == pytest.approx(32)  # the other rank's shard; the a2a left out
