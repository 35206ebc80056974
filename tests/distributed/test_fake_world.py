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


@pytest.mark.slow
def test_stages_without_layers_match_and_peak_as_planned():
    """Issue 47: Megatron's layouts give the first stage only the embedding and the last only
    the MTP module and the loss ("E|ttt|ttt|mL", tp2·pp4·dp2): every group matches, each stage
    reads the host once and peaks within 10% of the plan (the embedding-only stage was +26%:
    the plan held no backward working memory for its weight's gradient, plan/buffers.py)."""
    cfg = _cfg(layers=6, tp=2, pp=4, pipeline_model_parallel_layout="E|ttt|ttt|mL")
    cfg.model.flavour, cfg.model.mtp_num_layers = "llama", 1
    cfg.training.global_batch_size = 8
    topo = validate(cfg, 16).topology()
    reports = run_roles(cfg, 16, [*(topo.rank(pp=i) for i in range(4)), topo.rank(tp=1)])
    m = match(reports)
    assert m.ok and {"tp", "pp", "embed", "world"} <= set(m.compared), (m.compared, m.mismatches)
    assert all(r.syncs == 1 for r in reports), [(r.rank, r.where) for r in reports]
    _memory_as_planned(reports)


# ---- production shapes (issue 47): real widths, fewer layers, uneven stages ---------------------
LLAMA_405B = dict(flavour="llama", hidden_size=16384, num_attention_heads=128, num_query_groups=8,
                  ffn_hidden_size=53248, vocab_size=128256, seq_length=8192)  # fmt: skip
DEEPSEEK_V3 = dict(flavour="deepseek_v3", hidden_size=7168, num_attention_heads=128,
                   ffn_hidden_size=18432, vocab_size=129280, seq_length=4096, q_lora_rank=1536,
                   kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                   mtp_num_layers=1, num_experts=256, moe_router_topk=8, moe_ffn_hidden_size=2048,
                   moe_shared_expert_intermediate_size=2048, moe_router_score_function="sigmoid",
                   moe_router_enable_expert_bias=True, moe_router_num_groups=8,
                   moe_router_group_topk=4, moe_router_topk_scaling_factor=2.5,
                   moe_dense_layers=[0, 1, 2])  # fmt: skip


def _production(model: dict, layers: int, **par):
    """A bf16 model of `model`'s real dims with `layers` layers, micro-batch 1, global batch
    2048 (16 micro-batches per replica at dp128), `par` the parallel flags."""
    from megalite.config import Config

    cfg = Config()
    for k, v in {**model, "num_layers": layers}.items():
        setattr(cfg.model, k, v)
    t = cfg.training
    t.precision, t.micro_batch_size, t.global_batch_size = "bf16", 1, 2048
    cfg.logging.wandb_mode = "disabled"
    for k, v in par.items():
        setattr(cfg.parallel, k, v)
    return cfg


def _production_step(cfg, world: int, coords: list[dict], groups: set):
    """The roles at `coords` run two steps: every group compared matches (`groups` among them),
    each reads the host as `expected_syncs` says and peaks within 10% of the planner."""
    shape = validate(cfg, world)
    topo = shape.topology()
    reports = run_roles(cfg, world, [topo.rank(**c) for c in coords])
    for r in reports:  # the numbers docs/fake_world.md records (pytest -s shows them)
        print(f"rank {r.rank} {r.coords}: {r.seconds:.1f} s, {r.syncs} syncs, peak "
              f"{r.peak_bytes / 2**30:.2f} GiB, planned {r.planned_bytes / 2**30:.2f} GiB")  # fmt: skip
    m = match(reports)
    assert m.ok and groups <= set(m.compared), (m.compared, m.mismatches[:3])
    for r in reports:
        assert r.syncs == expected_syncs(cfg, shape, r.coords["pp"]), (r.rank, r.syncs, r.where)
    _memory_as_planned(reports)
    return shape, reports


@pytest.mark.slow
def test_16384_ranks_llama_405b_step_with_uneven_stages():
    """Llama 3 405B's widths (h16384, 128 heads, 8 KV groups, ffn 53248, 128,256-token vocab,
    8,192 tokens, bf16) at tp8 pp16 dp128 with SP, 16 micro-batches of 1: 30 layers (126 in the
    model), the first and the last stage one layer short of the others' 2 (Megatron's
    --decoder-first/last-pipeline-num-layers). The first stage and its tp and dp neighbours, a
    middle stage, the last stage (the 128k head at tp8) and its tp neighbour."""
    cfg = _production(LLAMA_405B, 30, tp=8, pp=16, sequence_parallel=True,
                      decoder_first_pipeline_num_layers=1, decoder_last_pipeline_num_layers=1)  # fmt: skip
    coords = [{}, {"tp": 1}, {"dp": 1}, {"pp": 1}, {"pp": 15}, {"pp": 15, "tp": 1}]
    shape, reports = _production_step(cfg, 16384, coords, {"tp", "dp", "pp", "world"})
    assert shape.partition.counts == (1, *[2] * 14, 1) and shape.microbatches == 16


@pytest.mark.slow
def test_2048_ranks_deepseek_v3_step_with_an_mtp_only_last_stage():
    """DeepSeek-V3's widths (MLA, 256 experts top-8 over node-limited groups, a shared expert,
    the first 3 layers dense, one MTP layer, bf16) at pp16 ep64 dp128 with ZeRO-1, 16
    micro-batches of 1: 15 layers (61 in the model), one per stage and none on the last, which
    holds the MTP module, the head and the loss (the layout "Et|(t|)*14,mL"). The first stage,
    the first MoE stage (3) with its ep and edp neighbours, the last stage and its neighbour."""
    cfg = _production(DEEPSEEK_V3, 15, pp=16, ep=64, pipeline_model_parallel_layout="Et|(t|)*14,mL")
    cfg.optimizer.zero_stage = 1
    coords = [{}, {"pp": 3}, {"pp": 3, "dp": 1}, {"pp": 3, "dp": 64},
              {"pp": 15}, {"pp": 15, "dp": 1}]  # fmt: skip
    groups = {"dp", "ep", "edp", "pp", "world", "embed"}
    shape, reports = _production_step(cfg, 2048, coords, groups)
    assert shape.partition.counts == (*[1] * 15, 0) and shape.microbatches == 16
    assert [r.syncs for r in reports] == [1, 17, 17, 17, 17, 17]  # 1 + an MoE layer x 16
