"""plan/ranking.py: what of the communication the step time counts as exposed."""

from dataclasses import replace

import pytest

from megalite.plan import layouts, links
from megalite.plan.layouts import layout
from megalite.plan.ranking import Cluster, step_parts
from tests.unit.plan_configs import big, flops


def _tp_parts(cfg, cluster, overlap: bool) -> tuple[float, float, float]:
    """(exposed TP seconds, all TP seconds, the busiest rank's compute) at tp8 dp1 with SP."""
    cfg = replace(cfg, parallel=replace(cfg.parallel, tp_comm_overlap=overlap))
    p = layouts.plan(cfg, layout(cfg, tp=8, sequence_parallel=True), cluster)
    parts = step_parts(cfg, p, cluster, flops(cfg))
    every = links.seconds(p.links["tp"], cluster.intra_node_gbps, cluster.inter_node_gbps)
    return parts["tp"], every, parts["compute"]


@pytest.mark.parametrize(
    "flavour, without, overlapped",
    [
        # a gated MLP: both blocks fused (n = 2) of 10 collectives per layer; 2n hidden always,
        # the other 6 chunked: 1/8 of them exposed with --tp-comm-overlap
        ("llama", 6 / 10, 6 / 8 / 10),
        # GeLU's up is no fused block (n = 1, 9 collectives): its all-gather and reduce-scatter
        # stay exposed, 5 of the other 7 chunked
        ("gpt2", 7 / 9, (2 + 5 / 8) / 9),
    ],
)
def test_tp_exposed_share(flavour, without, overlapped):
    cfg = big(flavour, 4, 4096, 32, 4096, 32000, mbs=1, gbs=8)
    cluster = Cluster(8)
    tp, every, compute = _tp_parts(cfg, cluster, overlap=False)
    assert every < compute  # the bound below does not decide here
    assert tp == pytest.approx(without * every, rel=1e-9)
    tp, every, _ = _tp_parts(cfg, cluster, overlap=True)
    assert tp == pytest.approx(overlapped * every, rel=1e-9)


def test_tp_hidden_no_longer_than_the_compute():
    """Over a slow link the TP traffic outlasts the compute: only the compute's length of it is
    hidden, whatever the overlap."""
    cfg = big("llama", 4, 4096, 32, 4096, 32000, mbs=1, gbs=8)
    cluster = Cluster(8, intra_node_gbps=0.5)
    tp, every, compute = _tp_parts(cfg, cluster, overlap=True)
    assert every > 2 * compute and tp == pytest.approx(every - compute, rel=1e-9)


def test_no_tp_hidden_with_fp8():
    cfg = big("llama", 4, 4096, 32, 4096, 32000, mbs=1, gbs=8)
    cfg.training.fp8_format = "e4m3"
    tp, every, _ = _tp_parts(cfg, Cluster(8), overlap=True)
    assert tp == every
