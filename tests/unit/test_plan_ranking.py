"""plan/ranking.py: what of the communication the step time counts as exposed."""

from dataclasses import replace

import pytest

from megalite.plan import layouts, links
from megalite.plan.layouts import layout
from megalite.plan.ranking import Cluster, step_parts
from megalite.plan.traffic import step_bytes
from tests.unit.plan_configs import big, flops


def _tp_parts(cfg, cluster, overlap: bool) -> tuple[float, float, float]:
    """(exposed TP seconds, all TP seconds, the busiest rank's compute) at tp8 dp1 with SP."""
    cfg = replace(cfg, parallel=replace(cfg.parallel, tp_comm_overlap=overlap))
    p = layouts.plan(cfg, layout(cfg, tp=8, sequence_parallel=True), cluster)
    parts = step_parts(cfg, p, cluster, flops(cfg))
    steps = p.comm["tp"] / step_bytes(cfg, p.layout)["tp"]
    every = links.seconds(p.links["tp"], cluster, steps)
    return parts["tp"], every, parts["compute"]


@pytest.mark.parametrize(
    "flavour, without, overlapped",
    [
        # both blocks fused (n = 2: q/k/v, and gate/up or GeLU's up alone) of 10 collectives
        # per layer; 2n hidden always, the other 6 chunked: 1/8 of them exposed with
        # --tp-comm-overlap
        ("llama", 6 / 10, 6 / 8 / 10),
        ("gpt2", 6 / 10, 6 / 8 / 10),
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


@pytest.mark.parametrize(
    "name, pp, vpp, m",
    [("1f1b", 4, 1, 8), ("interleaved", 4, 2, 8), ("interleaved", 4, 4, 16),
     ("interleaved", 3, 4, 6), ("zbv", 4, 2, 8), ("zb-h1", 4, 1, 8)],
)  # fmt: skip
def test_chunk_windows_against_the_timed_schedule(name, pp, vpp, m):
    """Each chunk's windows on rank 0 from its own actions, against the schedule run with every
    rank timed (timed.compute_times, data dependencies, free communication): from the step's
    start to the end of the chunk's first forward, from the start of its last backward (W of a
    split one) to the step's end. Equal where rank 0 ends the step, no longer elsewhere (the
    idle time before rank 0's end is left out)."""
    from megalite.pipeline.actions import B, F, W
    from megalite.pipeline.schedules import schedule
    from megalite.pipeline.timed import compute_times
    from megalite.plan.ranking import chunk_windows

    s = schedule(name)
    timed = compute_times(pp, vpp, m, s.placement, s.build)
    end = max(e for rank in timed for _, e, _ in rank)
    first, last = {}, {}
    for start, stop, a in timed[0]:
        if a.kind == F:
            first.setdefault(a.chunk, stop)
        if a.kind in (B, W):
            last[a.chunk] = end - start
    forward, backward = chunk_windows(name, pp, vpp, m)
    assert forward == tuple(sorted(first.values()))
    ends_step = timed[0][-1][1] == end
    want = tuple(sorted(last.values()))
    assert len(backward) == len(want) == vpp
    if ends_step:
        assert backward == want
    else:
        assert all(w <= t for w, t in zip(backward, want)) and backward != want
    if name == "interleaved":  # the closed form of the docstring
        assert backward == tuple(2 * (c * pp + 1) for c in range(vpp))


def test_interleaving_hides_more_of_the_reduction():
    """One layout at vpp 1 and 4: the once-a-step reduction and the gathers queue chunk by
    chunk behind longer windows, so the exposed DP time falls."""
    cfg = big("llama", 16, 4096, 32, 4096, 32000, mbs=1, gbs=64)
    cluster = Cluster(64)
    dp = {}
    for vpp in (1, 4):
        p = layouts.plan(cfg, layout(cfg, tp=8, pp=2, dp=4, vpp=vpp, zero=1,
                                     sequence_parallel=True), cluster)  # fmt: skip
        dp[vpp] = step_parts(cfg, p, cluster, flops(cfg))["dp"]
    assert 0 < dp[4] < 0.8 * dp[1], dp
