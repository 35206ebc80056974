"""plan/links.py: each group's bytes over NVLink inside a node and the network across nodes."""

import pytest

from megalite.plan import links
from megalite.plan.layouts import layout
from megalite.plan.ranking import Cluster
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
    c = Cluster(8, intra_node_gbps=300, inter_node_gbps=25 / links.EFFICIENCY["network"])
    assert links.seconds({"nvlink": 300e9, "network": 25e9}, c) == pytest.approx(1.0)


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


def test_a_collective_is_latency_bound_small_and_at_the_asymptote_large():
    """NCCL-style: each of a ring's steps waits the link's latency, the bytes go at the
    asymptotic bus bandwidth (nominal times EFFICIENCY), so the achieved busbw rises with size."""
    c = Cluster(16)  # H100: NVLink 450 GB/s and 1 µs a step, 400 Gb/s NICs and 5 µs
    nv, net = 450e9 * links.EFFICIENCY["nvlink"], 50e9 * links.EFFICIENCY["network"]
    assert links.EFFICIENCY["network"] < 1.0  # nccl-tests' 331 of 400 GB/s across nodes
    # the ring's bus bytes and steps: all-reduce 2(n-1)/n S in 2(n-1), gathers (n-1)/n S in n-1
    assert links.bus_bytes("all_reduce", 8, 800.0) == pytest.approx(1400.0)
    assert links.bus_bytes("all_gather", 8, 800.0) == links.bus_bytes("reduce_scatter", 8, 800.0)
    assert links.bus_bytes("all_gather", 8, 800.0) == pytest.approx(700.0)
    assert links.bus_bytes(links.P2P, 8, 800.0) == 800.0
    assert (links.steps("all_reduce", 8), links.steps("all_gather", 8), links.steps("p2p", 8)) == (
        14, 7, 1)  # fmt: skip
    # 8 kB over 8 NVLink ranks: latency-bound (14 steps of 1 µs, the bytes ~0.03 µs)
    small = links.collective_seconds("all_reduce", 8, 8e3, "nvlink", c)
    assert small == pytest.approx(14e-6 + 14e3 / nv)
    assert links.bus_bytes("all_reduce", 8, 8e3) / small < 0.01 * nv
    # 4 GB: at the asymptotic busbw within 0.1%
    big_s = links.collective_seconds("all_reduce", 8, 4e9, "nvlink", c)
    assert links.bus_bytes("all_reduce", 8, 4e9) / big_s == pytest.approx(nv, rel=1e-3)
    # across nodes: the network's latency and busbw; half the asymptote at chunk = alpha * busbw
    assert links.busbw("network", 5e-6 * net, c) == pytest.approx(net / 2)
    assert links.busbw("network", 1e9, c) == pytest.approx(net, rel=1e-3)
    ag = links.collective_seconds("all_gather", 16, 16e6, "network", c)
    assert ag == pytest.approx(15 * 5e-6 + 15e6 / net)
    # a group's seconds: its steps' latency (the slowest link crossed) plus the slower link
    two = {"nvlink": 450e6, "network": 50e6}
    assert links.seconds(two, c, 10) == pytest.approx(10 * 5e-6 + 50e6 / net)
    assert links.seconds({"nvlink": 450e6, "network": 0.0}, c, 10) == pytest.approx(10e-6 + 1e-3)
