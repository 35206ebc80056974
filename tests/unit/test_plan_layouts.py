"""plan/layouts.py: the layout search's recommendations for a few fixed cases, and the Table 1
layouts of Narayanan et al. 2021."""

from dataclasses import replace

import pytest

from megalite.plan import layouts
from megalite.plan.layouts import layout
from megalite.plan.ranking import Cluster
from tests.unit.plan_configs import big, flops


def test_fits_one_gpu_gives_pure_dp():
    cfg = big("gpt2", 12, 768, 12, 1024, 50257, mbs=4, gbs=256)  # GPT-2 124M
    plans = layouts.search(cfg, Cluster(gpus=8, gpu_memory_gib=80), flops(cfg))
    best = plans[0].layout
    assert (best.tp, best.pp, best.dp) == (1, 1, 8) and best.zero.stage < 2
    # ZeRO-2 fits with the least memory but reduce-scatters every micro-batch: it ranks below
    zero2 = next(p for p in plans if p.layout == layout(cfg, dp=8, zero=2))
    assert zero2.comm["dp"] > 4 * plans[0].comm["dp"] and zero2.step_time > plans[0].step_time


def test_too_big_for_a_node_gives_pp_across_nodes():
    cfg = big("gpt2", 96, 12288, 96, 2048, 51200, mbs=1, gbs=64, recompute="full")  # GPT-3
    cluster = Cluster(gpus=64, gpu_memory_gib=80, gpus_per_node=8)
    plans = layouts.search(cfg, cluster, flops(cfg))
    best = plans[0].layout
    assert best.tp <= 8 and best.pp >= 2 and best.tp * best.pp > 8  # TP in a node, PP across
    # nothing fits inside one node: no plan with tp * pp <= 8
    assert all(p.layout.tp * p.layout.pp > 8 for p in plans)


def test_optimizer_state_dominates_gives_zero():
    # ~3B parameters: bf16 weights 6 GB + fp32 gradients 12 GB fit a 40 GB GPU, the 36 GB of
    # fp32 Adam state and masters do not; sharded over 8 ranks they do
    cfg = big("llama", 26, 3200, 32, 1024, 32000, mbs=1, gbs=64)
    best = layouts.search(cfg, Cluster(gpus=8, gpu_memory_gib=40), flops(cfg))[0]
    assert (best.layout.tp, best.layout.pp, best.layout.zero.stage) == (1, 1, 1)
    zero0 = layouts.plan(cfg, layout(cfg, dp=8), Cluster(gpus=8, gpu_memory_gib=40))
    assert (
        not zero0.fits
        and zero0.memory["optimizer"] > zero0.memory["params"] + zero0.memory["grads"]
    )


# Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using
# Megatron-LM"), Table 1: parameters, heads, hidden, layers, tp, pp, GPUs, batch; sequence 2048,
# vocabulary 51200, fp16, A100s of 80 GB, 8 per node, activation recomputation.
TABLE_1 = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512),
    ("18B", 48, 6144, 40, 8, 1, 256, 1024),
    ("39B", 64, 8192, 48, 8, 2, 512, 1536),
    ("76B", 80, 10240, 60, 8, 4, 1024, 1792),
    ("145B", 96, 12288, 80, 8, 8, 1536, 2304),
    ("310B", 128, 16384, 96, 8, 16, 1920, 2160),
    ("530B", 128, 20480, 105, 8, 35, 2520, 2520),
    ("1T", 160, 25600, 128, 8, 64, 3072, 3072),
]


@pytest.mark.slow
def test_plans_the_megatron_paper_layouts():
    """Each Table 1 model on its GPUs and batch: the paper's tp and pp among the three fastest
    layouts. As the paper ran: no distributed optimizer (ZeRO-0: with ZeRO-1 less model
    parallelism fits and the planner prefers it), full recompute, A100 peak; the table gives no
    micro-batch size, 2 is assumed. 530B's pp=35 is no power of two: the search tries every pp
    that divides the GPUs and the layers (105 = 35 * 3)."""
    a100 = Cluster(gpus=1, gpu_memory_gib=80, gpus_per_node=8, peak_tflops=312, gpu="a100",
                   intra_node_gbps=300, inter_node_gbps=25)  # fmt: skip
    missed = []
    for name, heads, h, layers, tp, pp, gpus, batch in TABLE_1:
        cfg = big("gpt2", layers, h, heads, 2048, 51200, mbs=2, gbs=batch, precision="fp16",
                  recompute="full")  # fmt: skip
        cluster = replace(a100, gpus=gpus)
        plans = layouts.search(cfg, cluster, flops(cfg), zero_stages=[0])
        if (tp, pp) in [(p.layout.tp, p.layout.pp) for p in plans[:3]]:
            continue
        paper = next(p for p in plans if (p.layout.tp, p.layout.pp) == (tp, pp))
        missed.append((name, round(paper.step_time / plans[0].step_time - 1, 3)))
    # 18B: the per-link model (plan/links.py) gives tp4's data-parallel rings two NICs per node
    # where tp8's have one, and the time by shape (plan/compute.py) tp8's GEMMs 3,072 wide
    # against tp4's 6,144, and the network at its measured 83% of nominal (links.EFFICIENCY);
    # the paper's tp8 ranks 5th, 13% behind (docs/planner.md). A held-out
    # row of the calibration (plan/published.py): its estimate is reported, not fitted.
    assert [n for n, _ in missed] == ["18B"] and missed[0][1] < 0.14, missed


def test_the_last_stage_runs_the_mtp_modules():
    """The step time's last stage (the pipeline's pace) holds the output layer once more and a
    layer per MTP module: at pp=4 the compute term grows by (pp - 1) times that share."""
    from megalite.plan.ranking import step_time

    cfg = big("deepseek_v3", 8, 1024, 8, 1024, 32000, mbs=1, gbs=64)
    cfg.model.mtp_num_layers = 2
    cluster = Cluster(gpus=8, gpu_memory_gib=80, mfu=0.45)  # the flat model: its compute below
    p = layouts.plan(cfg, layout(cfg, pp=4, dp=2), cluster)
    f = flops(cfg)
    with_mtp = step_time(cfg, p, cluster, f)
    cfg.model.mtp_num_layers = 0  # the same plan and FLOPs: only the last stage's share differs
    without = step_time(cfg, p, cluster, f)
    compute = f * 64 * 1024 / 8 / (cluster.peak_tflops * 1e12 * cluster.mfu)
    out = 6 * 32000 * 1024 / f  # one output layer's share
    extra = 2 * out + 2 * (1 - 3 * out) / (8 + 2)  # two more logits, two layers
    assert with_mtp - without == pytest.approx(compute * (1 + p.bubble) * 3 * extra, rel=1e-9)


def test_hybrid_sharding_is_searched_and_keeps_its_shards_in_a_node():
    """With ZeRO, the search also tries --dp-replicate with the shard group filling a node: its
    reduce-scatter and gathers stay on NVLink, only the copies' all-reduce of each shard crosses
    the network (the plan's bytes per link say so; links.py's rings make the two equal in
    network bytes per GPU, so hybrid sharding wins only where latency decides)."""
    from megalite.plan.report import launch_flags

    cfg = big("llama", 32, 4096, 32, 4096, 32000, mbs=1, gbs=1024)
    plans = layouts.search(cfg, Cluster(512), flops(cfg))
    hybrid = [p for p in plans if p.layout.dpr > 1]
    assert hybrid and all(p.layout.zero.shard_state for p in hybrid)
    p = hybrid[0]
    assert p.layout.size("dp") * p.layout.tp * p.layout.cp == 8  # the shard group: one node
    assert p.links["dp"]["network"] == 0 < p.links["dp"]["nvlink"]
    assert p.links["dpr"]["nvlink"] == 0 < p.links["dpr"]["network"]
    assert f"--dp-replicate {p.layout.dpr}" in launch_flags(p)


def test_micro_batch_sizes_searched_per_layout():
    """With `micro_batch_sizes` each layout is planned once, at its fastest size that splits the
    batch (48 sequences over dp 8: 1, 2 or 3 per rank, so 4 and 8 never) and fits; without it,
    at cfg's only."""
    from megalite.plan.ranking import step_time

    cfg = big("gpt2", 12, 768, 12, 1024, 50257, mbs=1, gbs=48)
    cluster = Cluster(8)
    f = flops(cfg)
    plans = layouts.search(cfg, cluster, f, micro_batch_sizes=(1, 2, 4, 8))
    keys = [(str(p.layout), p.layout.dp) for p in plans]
    assert len(set(keys)) == len(keys)
    assert all(48 % (p.layout.micro_batch_size * p.layout.dp) == 0 for p in plans)
    assert {p.layout.micro_batch_size for p in plans if p.layout.dp == 8} <= {1, 2}
    assert max(p.layout.micro_batch_size for p in plans) > 1
    for p in plans[:4]:
        lay = p.layout
        for b in (1, 2):
            c = replace(cfg, training=replace(cfg.training, micro_batch_size=b),
                        parallel=replace(cfg.parallel, **dict(p.split)))  # fmt: skip
            other = layouts.plan(c, layout(c, lay.tp, lay.pp, lay.dp, lay.vpp, lay.zero.stage,
                                           lay.sequence_parallel), cluster)  # fmt: skip
            assert p.step_time <= step_time(c, other, cluster, f) * (1 + 1e-12)
    assert {p.layout.micro_batch_size for p in layouts.search(cfg, cluster, f)} == {1}


def test_cli_searches_micro_batch_sizes_unless_given(monkeypatch, tmp_path):
    """tools/plan.py hands the search MICRO_BATCH_SIZES, or none (cfg's only) where
    --micro-batch-size is given on the command line or in --config's YAML."""
    from pathlib import Path

    from megalite.cli import plan as cli

    asked = []
    monkeypatch.setattr(cli, "print_plan", lambda *a, **kw: asked.append(kw["micro_batch_sizes"]))
    tiny = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"  # sets it: 2
    no_mbs = tmp_path / "no_mbs.yaml"
    no_mbs.write_text("".join(line for line in tiny.read_text().splitlines(keepends=True)
                              if "micro_batch_size" not in line))  # fmt: skip
    for argv in ([], ["--micro-batch-size", "4"], ["--mbs", "4"], ["--config", str(tiny)],
                 ["--config", str(no_mbs)]):  # fmt: skip
        cli.main(["--gpus", "8", *argv])
    assert asked == [layouts.MICRO_BATCH_SIZES, None, None, None, layouts.MICRO_BATCH_SIZES]
