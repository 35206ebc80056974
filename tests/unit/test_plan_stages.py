"""plan/stages.py: the pipeline splits the layout search tries (Megatron's flags), the work of
each rank with the embedding and the head at their true cost, and the step time's use of the
busiest rank."""

import pytest

from megalite.pipeline.partition import Partition
from megalite.plan import layouts, stages
from megalite.plan.layouts import layout
from megalite.plan.ranking import Cluster, step_parts
from tests.unit.plan_configs import big, flops


def llama405b(seq=8192, gbs=2048):
    cfg = big("llama", 126, 16384, 128, seq, 128256, mbs=1, gbs=gbs, recompute="full")
    cfg.model.num_query_groups, cfg.model.ffn_hidden_size = 8, 53248
    return cfg


def test_the_head_costs_what_its_logits_cost():
    cfg = llama405b()
    layer, head = stages.shares(cfg, flops(cfg))
    assert 126 * layer + head == pytest.approx(1)
    # the output layer (128k x 16k) under full recompute: 8 V h of the FLOPs, ~0.6 of a layer
    assert head == pytest.approx(8 * 128256 * 16384 / flops(cfg))
    assert 0.5 < head / layer < 0.7


def test_126_layers_over_16_stages_take_megatrons_flags():
    """Llama 3 405B's pipeline: 126 layers do not divide over 16 ranks; counting the embedding
    and the head as a layer each gives 7 | 8 x 14 | 7 (the paper's "one layer less on the first
    and the last stage"), and interleaved the first and last virtual stage one layer short."""
    cfg = llama405b()
    share = stages.shares(cfg, flops(cfg))
    best = stages.splits(126, 16, 1, *share)[0]
    part = Partition.from_flags(126, 16, **stages._kwargs(dict(best)))
    assert part.counts == (7,) + (8,) * 14 + (7,)
    assert stages.flag_text(best) == (
        "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split"
    )
    inter = Partition.from_flags(
        126, 16, 2, **stages._kwargs(dict(stages.splits(126, 16, 2, *share)[0]))
    )
    assert inter.counts[0] == inter.counts[-1] == 3 and set(inter.counts[1:-1]) == {4}
    # the busiest rank: a middle one (8 layers); the last holds 7 and the head (0.6 of a layer)
    work = stages.rank_work(part, *share)
    assert max(work) == work[1] and work[-1] < work[1]
    # no even split exists: the search would not have tried pp=16 before
    assert () not in stages.splits(126, 16, 1, *share)


def test_a_heavy_head_shortens_the_last_stage_even_where_layers_divide():
    """1.7B-like (h 2048, V 131072): the head is ~1.2 layers. 24 layers over pp=4 divide evenly,
    but the last stage would carry 6 layers and the head: the search prefers a shorter last
    stage, and the step time sees the busiest rank's work."""
    cfg = big("gpt2", 24, 2048, 16, 4096, 131072, mbs=1, gbs=64)
    share = stages.shares(cfg, flops(cfg))
    splits = stages.splits(24, 4, 1, *share)
    even = Partition.even(24, 4)
    best = Partition.from_flags(24, 4, **stages._kwargs(dict(splits[0])))
    assert splits[0] != () and best.counts[-1] < 6
    assert stages.slowest(best, *share) < stages.slowest(even, *share)
    cluster = Cluster(gpus=8)
    p_even = layouts.plan(cfg, layout(cfg, pp=4, dp=2), cluster)
    cfg_best = layouts.replace(cfg, parallel=layouts.replace(cfg.parallel, **dict(splits[0])))
    p_best = layouts.plan(cfg_best, layout(cfg_best, pp=4, dp=2), cluster)
    assert p_best.layout.partition.counts == best.counts
    f = flops(cfg)
    assert (
        step_parts(cfg_best, p_best, cluster, f)["compute"]
        < step_parts(cfg, p_even, cluster, f)["compute"]
    )
    ratio = (
        step_parts(cfg, p_even, cluster, f)["compute"]
        / step_parts(cfg_best, p_best, cluster, f)["compute"]
    )
    assert ratio == pytest.approx(stages.slowest(even, *share) / stages.slowest(best, *share))


def test_the_search_prints_the_split_it_chose():
    """A pp that does not divide the layers is searched, and the chosen plan's flags name the
    split."""
    from megalite.plan.report import format_ranking, launch_flags

    cfg = big("llama", 14, 1024, 8, 1024, 32000, mbs=1, gbs=32)
    cluster = Cluster(gpus=4, gpu_memory_gib=80, gpus_per_node=4)
    plans = layouts.search(cfg, cluster, flops(cfg))
    pp4 = [p for p in plans if p.layout.pp == 4]
    assert pp4 and all(p.split for p in pp4)  # 14 layers over 4 ranks: uneven only
    flags = launch_flags(pp4[0])
    assert "--pipeline-model-parallel-size 4" in flags and "pipeline" in stages.flag_text(
        pp4[0].split
    )
    text = format_ranking(plans, cluster)
    chosen = [r for r in text.splitlines() if r.startswith(("  the fastest, ", "  chosen: #"))]
    assert len(chosen) == 1 and ": --tensor-model-parallel-size" in chosen[0]
    assert "bytes per step over NVLink in a node" in text


def test_the_search_plans_the_fullest_rank_of_an_uneven_split():
    """A short first stage leaves rank 1 the most layers in flight: the search's plan (ends
    only) finds the same fullest rank as the plan of every stage."""
    cfg = big("llama", 22, 1024, 8, 1024, 32000, mbs=1, gbs=32)
    split = {stages.FIRST: 1, stages.LAST: 3}  # 1 | 6 | 6 | 6 | 3
    cfg = layouts.replace(cfg, parallel=layouts.replace(cfg.parallel, **split))
    shape = layout(cfg, pp=5, dp=1)
    assert shape.partition.counts == (1, 6, 6, 6, 3)
    every = layouts.plan(cfg, shape, Cluster(gpus=5))
    fullest = max(range(5), key=lambda r: every.stages[r]["total"])
    assert fullest == 1
    ends = layouts.plan(cfg, shape, Cluster(gpus=5), all_stages=False)
    assert ends.memory["total"] == every.memory["total"]


def test_a_ring_over_many_replicas_waits_its_latency():
    """Each bucket's ring over the replicas takes n - 1 steps at the slowest hop's latency:
    across nodes, 5 us by default; none at dp = 1."""
    from dataclasses import replace

    from megalite.plan.ranking import _ring_step

    cfg = big("gpt2", 4, 512, 8, 512, 32000, mbs=1, gbs=64)
    cluster = Cluster(gpus=64, gpus_per_node=8)
    shape = layout(cfg, tp=8, dp=8, sequence_parallel=True)  # dp ring: one rank per node
    assert _ring_step(shape, cluster) == pytest.approx(7 * 5e-6)
    assert _ring_step(layout(cfg, tp=8), Cluster(gpus=8)) == 0.0
    p = layouts.plan(cfg, shape, cluster)
    assert p.buckets >= 1
    f = flops(cfg)
    slow = step_parts(cfg, p, cluster, f)["dp"]
    fast = step_parts(cfg, p, replace(cluster, inter_node_latency_us=0.0), f)["dp"]
    assert slow > fast


def test_when_nothing_fits_the_nearest_is_named():
    from megalite.plan.report import format_ranking

    # the state (a few GB) fits 4 GPUs of 4 GiB; 8 sequences of 16K tokens' activations do not
    cfg = big("llama", 8, 1024, 8, 16384, 32000, mbs=8, gbs=8)
    cluster = Cluster(gpus=4, gpu_memory_gib=4, gpus_per_node=4)
    misses = []
    assert layouts.search(cfg, cluster, flops(cfg), misses=misses) == []
    assert misses and misses[0].memory["total"] == min(p.memory["total"] for p in misses)
    assert "nearest: " in format_ranking([], cluster, misses)
