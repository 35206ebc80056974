"""The fake world: chosen ranks of large layouts run a real training step on fake tensors over
torch's fake process group, one process each (megalite/training/fake_world.py)."""

import pytest

from megalite.shape import validate
from megalite.testing import tiny_config
from megalite.training.fake_world import expected_syncs, match, run_roles, witnesses


def _cfg(layers=8, **par):
    cfg = tiny_config(hidden=64)
    m = cfg.model
    m.num_layers, m.num_attention_heads, m.seq_length = layers, 8, 64
    for k, v in par.items():
        setattr(cfg.parallel, k, v)
    return cfg


def _memory_as_planned(reports):
    """Each role's peak (fake_memory.StorageTrace) within 10% of the planner's estimate."""
    off = {r.rank: round(r.peak_bytes / r.planned_bytes - 1, 3) for r in reports}
    assert all(abs(x) <= 0.10 for x in off.values()), off


def _world(cfg, world):
    shape = validate(cfg, world)
    reports = run_roles(cfg, world, witnesses(shape.topology()))
    return reports, match(reports)


def test_1024_ranks_tp8_pp4_dp32_vpp_collectives_match():
    cfg = _cfg(tp=8, pp=4, vpp=2)
    cfg.training.global_batch_size = 32 * 8
    reports, m = _world(cfg, 1024)
    assert m.ok, m.mismatches[:3]
    # every kind of group was compared, the world among all the witnesses
    assert {"tp", "pp", "dp", "world", "embed"} <= set(m.compared), m.compared
    assert all(r.syncs == 1 for r in reports), [(r.rank, r.where) for r in reports]
    _memory_as_planned(reports)


def test_stages_without_moe_layers_enter_the_expert_bias_all_reduce():
    """Finding 5 (issue 32): 8 layers, an MoE layer every 4th, pp=4: stages 1 and 3 hold none and
    skipped the world all-reduce of the expert-bias loads that stages 0 and 2 enter."""
    cfg = _cfg(pp=4, ep=2)
    m = cfg.model
    m.num_experts, m.moe_layer_freq, m.moe_router_enable_expert_bias = 4, 4, True
    cfg.optimizer.zero_stage = 2
    cfg.training.global_batch_size = 8
    shape = validate(cfg, 16)
    ranks = [shape.topology().rank(pp=i) for i in range(4)]
    m_ = match(run_roles(cfg, 16, ranks))
    world = [x for x in m_.mismatches if x[0] == "world"]
    assert not world, world


LAYOUTS = {  # 1,024 ranks each: context parallelism, ZeRO-3, the zero-bubble V schedule, HSDP
    "cp2-zero1": ({"tp": 8, "cp": 2, "pp": 4}, {"zero_stage": 1}, 16),
    "zero3": ({"tp": 8, "pp": 4}, {"zero_stage": 3}, 32),
    "zbv": ({"tp": 8, "pp": 4, "pp_schedule": "zbv"}, {"zero_stage": 2}, 32),
    # hybrid sharding: dp=32 as 4 copies (dpr) of a ZeRO-3 shard group of 8
    "hsdp-zero3": ({"tp": 8, "pp": 4, "dp_replicate": 4}, {"zero_stage": 3}, 32),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_1024_rank_layouts_match(name):
    par, opt, dp = LAYOUTS[name]
    cfg = _cfg(**par)
    for k, v in opt.items():
        setattr(cfg.optimizer, k, v)
    cfg.training.global_batch_size = dp * 8
    shape = validate(cfg, 1024)
    reports = run_roles(cfg, 1024, witnesses(shape.topology(), full=False))
    m = match(reports)
    assert m.ok, m.mismatches[:3]
    assert {"tp", "pp", "world"} <= set(m.compared), m.compared
    assert all(r.syncs == 1 for r in reports), [(r.rank, r.where) for r in reports]
    _memory_as_planned(reports)


def test_1024_ranks_moe_with_expert_parallelism_match():
    """tp4·pp2·dp128 with ep=8 over tp·dp, 8 experts in every other layer (2 layers: stage 1
    holds none, finding 5's shape at 1,024 ranks), ZeRO-1; 4 roles. A stage with an MoE layer
    also reads the routing's counts once per MoE layer and micro-batch (the all-to-all's
    sizes)."""
    cfg = _cfg(layers=2, tp=4, pp=2, ep=8)
    m = cfg.model
    m.num_experts, m.moe_layer_freq, m.moe_router_enable_expert_bias = 8, 2, True
    cfg.optimizer.zero_stage = 1
    cfg.training.global_batch_size = 128 * 4  # 4 micro-batches
    shape = validate(cfg, 1024)
    reports = run_roles(cfg, 1024, witnesses(shape.topology(), full=False))
    match_ = match(reports)
    assert match_.ok, match_.mismatches[:3]
    assert {"tp", "pp", "dp", "ep", "world"} <= set(match_.compared), match_.compared
    for r in reports:  # one layer per stage: layer i on stage i
        moe = int(m.is_moe_layer(r.coords["pp"]))
        assert r.syncs == 1 + moe * 4, (r.rank, r.syncs, r.where)
        assert expected_syncs(cfg, shape, r.coords["pp"]) == 1 + moe * 4
    _memory_as_planned(reports)


def test_full_recompute_keeps_the_routing_of_the_forward():
    """Finding 7 (issue 32): with ep>1 and full recompute, routing (the split sizes' all-gather
    over ep and their host read) ran again in backward. Now as often as without recompute."""
    runs = {}
    for recompute in ("none", "full"):
        cfg = _cfg(layers=2, ep=2)
        m = cfg.model
        m.num_experts = 4
        cfg.optimizer.zero_stage = 2
        cfg.training.recompute, cfg.training.global_batch_size = recompute, 4
        runs[recompute] = run_roles(cfg, 2, [0])[0]
    ep = (0, 1)

    def gathers(r):
        return sum(op == "all_gather_single" for op, _, _ in r.calls.get(ep, []))

    none, full = runs["none"], runs["full"]
    assert gathers(none) > 0
    assert (gathers(full), full.syncs) == (gathers(none), none.syncs), (full.where, none.where)


def test_dry_run_fake_world_prints_groups_syncs_and_memory(capsys):
    """`--dry-run --fake-world`'s report (training/launch.py calls it after the plan)."""
    from megalite.training.fake_world import print_fake_world

    cfg = _cfg(layers=2, tp=2, pp=2)
    cfg.training.global_batch_size = 2
    assert print_fake_world(cfg, validate(cfg, 4))
    out = capsys.readouterr().out
    assert "tp: 2 group(s) compared, matched" in out and "pp: 2 group(s)" in out, out
    assert "planned MiB" in out and "MISMATCHED" not in out, out


DEEPSEEK = dict(flavour="deepseek_v3", num_layers=4, num_attention_heads=4, seq_length=32,
                q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4,
                v_head_dim=8, mtp_num_layers=2, num_experts=4, moe_router_topk=2,
                moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16,
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_dense_layers=[0])  # fmt: skip


@pytest.mark.slow
def test_deepseek_v3_last_stage_peaks_as_planned(capsys):
    """A tiny DeepSeek-V3 (MLA, experts from layer 1 on, two MTP modules whose layers hold
    experts) at tp2·pp2·dp2·ep2 with SP: the last stage (MLA layers, the head, both MTP
    modules) peaks within 10% of the planner's total and reads the host once plus once per MoE
    layer (its MTP modules' included) and micro-batch; the dry run's plan holds the MTP modules'
    parameters on the last stage and prints every kind of traffic."""
    from megalite.training.dry_run import print_plan

    cfg = tiny_config(hidden=32)
    for k, v in DEEPSEEK.items():
        setattr(cfg.model, k, v)
    for k, v in dict(tp=2, pp=2, ep=2, sequence_parallel=True).items():
        setattr(cfg.parallel, k, v)
    cfg.training.global_batch_size = 8
    shape = validate(cfg, 8)
    (report,) = run_roles(cfg, 8, [shape.topology().rank(pp=1)])
    _memory_as_planned([report])
    moe_layers = 2 + 2  # layers 2 and 3, the MTP modules' layers 4 and 5
    assert report.syncs == expected_syncs(cfg, shape, 1) == 1 + moe_layers * shape.microbatches
    print_plan(cfg, shape, top=2)
    out = capsys.readouterr().out
    for kind in ("tp ", "pp ", "dp ", "ep ", "edp ", "embed "):
        assert f"{kind}" in out.split("bytes per step:")[1].splitlines()[0], out
    stage0, stage1 = (line.split() for line in out.splitlines() if "  stage " in line)
    assert float(stage1[2]) > float(stage0[2]) and "fits in" in out, out  # params (KiB)


def test_16384_ranks_time_their_launch_and_make_only_their_groups():
    """Issue 47: Llama 3 405B's layout (tp8 pp16 dp128) on a 16-layer toy model, the first and
    the last stage: each role times the launch's phases, creates its own groups (and no
    world-wide operation), matches, reads the host once and peaks as planned."""
    cfg = _cfg(layers=16, tp=8, pp=16)
    cfg.training.global_batch_size = 128  # one micro-batch per replica: the cheapest step
    topo = validate(cfg, 16384).topology()
    reports = run_roles(cfg, 16384, [0, topo.rank(pp=15)])
    m = match(reports)
    assert m.ok and {"pp", "embed", "world"} <= set(m.compared), (m.compared, m.mismatches[:3])
    for r in reports:
        assert list(r.phases) == ["rendezvous", "groups", "data index", "model build",
                                  "first step"], r.phases  # fmt: skip
        g = r.group_count
        assert (g.created, g.world_ops, g.foreign) == (g.member_of, 0, 0) and g.member_of == 4, g
        assert r.syncs == 1, r.where
    _memory_as_planned(reports)
