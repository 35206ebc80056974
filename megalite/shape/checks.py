"""The checks of one feature each that `derive` and `validate` (validation.py) run: why this
model or these flags cannot run (one sentence), or None. Mixture-of-experts routing and layout,
attention variants, multi-token prediction, FP8, and the precision and batch-size schedule."""

from megalite import lr_schedule
from megalite.config import Config
from megalite.parallel.topology import Topology
from megalite.pipeline import schedules
from megalite.shape.run_shape import RunShape


def check_routing(m) -> str | None:
    """Why this MoE model's routing (node-limited groups, dense layers) is impossible, or None."""
    e, k, g, gk = m.num_experts, m.moe_router_topk, m.moe_router_num_groups, m.moe_router_group_topk
    if (g is None) != (gk is None):
        return "--moe-router-num-groups and --moe-router-group-topk are set together or not at all"
    if g is not None:
        if g < 1 or e % g:
            return f"num_experts={e} is not divisible by --moe-router-num-groups={g}"
        if not 1 <= gk <= g or k > gk * (e // g):
            return (
                f"--moe-router-group-topk={gk} must be in 1..{g} and leave at least "
                f"moe_router_topk={k} experts ({e // g} per group)"
            )
    scale = m.moe_router_topk_scaling_factor
    if scale is not None and scale <= 0:
        return f"--moe-router-topk-scaling-factor={scale} must be positive"
    if m.swiglu_limit <= 0:
        return f"--swiglu-limit={m.swiglu_limit} must be positive"
    bad = [i for i in m.moe_dense_layers if not 0 <= i < m.num_layers]
    if bad:
        return f"--moe-dense-layers {bad} are not layers of this {m.num_layers}-layer model"
    return None


def check_experts(cfg: Config, sizes: dict, axes: tuple) -> str | None:
    """Why this mixture-of-experts model cannot run at this layout (one sentence), or None.
    Experts are a second decomposition of each pipeline stage's ranks (Topology.experts)."""
    m, p = cfg.model, cfg.parallel
    e, k, ep, tp = m.num_experts, m.moe_router_topk, p.ep, sizes["tp"]
    if not e:
        if ep > 1:
            return f"--ep {ep} needs a mixture-of-experts model; set --num-experts"
        if m.moe_router_enable_expert_bias:
            return "--moe-router-enable-expert-bias needs a mixture-of-experts model; set --num-experts"
        return None
    if sizes.get("cp", 1) > 1:  # the balancing loss and capacity are over a TP group's sequence
        return "mixture-of-experts models do not run with --cp yet; use --cp 1"
    if p.etp < 1:
        return f"--expert-tensor-parallel-size {p.etp} must be at least 1"
    if k > e:
        return f"moe_router_topk={k} is larger than num_experts={e}; lower --moe-router-topk"
    why = check_routing(m)
    if why:
        return why
    if e % ep:
        return f"num_experts={e} is not divisible by ep={ep}; use a multiple of {ep} experts"
    stage = 1
    for a, n in sizes.items():
        stage *= n if a != "pp" else 1
    if stage % (ep * p.etp):
        shown = [a for a, n in sizes.items() if a != "pp" and (n > 1 or a in ("tp", "dp"))]
        names, values = "*".join(shown), "*".join(str(sizes[a]) for a in shown)
        what = f"ep={ep}" if p.etp == 1 else f"ep*etp={ep}*{p.etp}"
        return (
            f"{what} does not divide {names}={values}, the ranks of a pipeline stage that "
            f"experts are spread over; choose an {what.split('=')[0]} that divides {stage}"
        )
    if p.etp > 1:  # each expert's width is split over etp (column- then row-parallel)
        if m.moe_ffn % p.etp:
            return (
                f"moe_ffn_hidden_size={m.moe_ffn} is not divisible by "
                f"--expert-tensor-parallel-size {p.etp}"
            )
        if m.features.moe_bias:
            return (
                f"expert biases (gpt-oss) do not run with --expert-tensor-parallel-size {p.etp} yet"
            )
        if cfg.optimizer.optimizer == "muon":
            return (
                f"--optimizer muon orthogonalises whole experts; it does not run with "
                f"--expert-tensor-parallel-size {p.etp} yet"
            )
    shared = m.moe_shared_expert_intermediate_size
    if shared and shared % tp:
        return f"moe_shared_expert_intermediate_size={shared} is not divisible by tp={tp}"
    if tp > 1 and m.seq_length % tp:  # each TP rank routes its 1/tp of the sequence
        return f"seq_length={m.seq_length} is not divisible by tp={tp} (needed by MoE layers)"
    f = m.moe_expert_capacity_factor
    if f is not None and f <= 0:
        return f"--moe-expert-capacity-factor={f} must be positive (omit it for dropless)"
    try:
        Topology("-".join(axes), **sizes).experts(ep, p.etp)
    except ValueError as err:
        return f"--order {'-'.join(axes)}: {err}"
    return None


def check_attention(cfg: Config) -> str | None:
    """Why this model's attention variant cannot run, or None."""
    m = cfg.model
    if m.rope_scaling != "none" and m.rope_scaling_factor <= 0:
        return f"--rope-scaling-factor={m.rope_scaling_factor} must be positive"
    return None


def check_latent_attention(m) -> str | None:
    """Latent attention (model/mla.py) has its own head dims and one k/v per query head."""
    if not m.features.latent_attention:
        return None
    if m.qk_rope_head_dim % 2:
        return f"qk_rope_head_dim={m.qk_rope_head_dim} must be even for rotary embeddings"
    if m.kv_channels is not None:
        return (f"--kv-channels does not apply to latent attention ({m.flavour}); set "
                "--qk-head-dim, --qk-pos-emb-head-dim and --v-head-dim")  # fmt: skip
    if m.heads_kv != m.num_attention_heads:
        return (f"--num-query-groups={m.heads_kv} does not apply to latent attention "
                f"({m.flavour}): every head has its own keys and values")  # fmt: skip
    return None


def check_mtp(cfg: Config, sizes: dict) -> str | None:
    """Multi-token prediction (model/mtp.py) shifts each row's labels: whole rows, RoPE."""
    m, d = cfg.model, cfg.data
    if not m.mtp_num_layers:
        return None
    if m.mtp_num_layers < 0 or m.mtp_num_layers >= m.seq_length:
        return f"--mtp-num-layers={m.mtp_num_layers} must be in [0, seq_length={m.seq_length})"
    if sizes.get("cp", 1) > 1:
        return "multi-token prediction does not run with --cp yet; use --cp 1"
    if not m.features.rotary:
        return f"multi-token prediction needs rotary positions; the {m.flavour} flavour has none"
    if d.reset_attention_mask or d.reset_position_ids:
        return ("multi-token prediction does not run on packed documents yet (--reset-attention-"
                "mask, --reset-position-ids)")  # fmt: skip
    return None


def check_fp8(cfg: Config, shape: RunShape) -> str | None:
    """Why this run cannot train in FP8, or None: each rank's GEMM dims must be multiples of
    16 (cuBLAS FP8), 32 for MXFP8 (its blocks, which must not straddle the TP shards)."""
    t, m = cfg.training, cfg.model
    if t.fp8_param_gather and (t.fp8_format is None or not shape.zero.shard_params):
        return "--fp8-param-gather needs --zero-stage 3 and --fp8-format (it gathers FP8 weights)"
    if t.fp8_format is None:
        return None
    if t.precision == "fp16":
        return "--fp8-format needs --precision bf16 or fp32 (fp16 loss scaling is not combined)"
    if t.fp8_amax_history_len < 1:
        return f"--fp8-amax-history-len={t.fp8_amax_history_len} must be a positive integer"
    from megalite.kernels.fp8 import RECIPES, device_problem  # torch: only for an FP8 run

    if t.fp8_param_gather and not RECIPES[t.fp8_recipe].transposable:
        return (f"--fp8-param-gather needs --fp8-recipe tensorwise or delayed: {t.fp8_recipe} "
                "re-quantises the high-precision weight in backward")  # fmt: skip
    q = RECIPES[t.fp8_recipe].multiple
    kv = m.heads_kv // shape.tp if m.heads_kv % shape.tp == 0 else m.heads_kv  # k/v per rank
    dims = {"--hidden-size": m.hidden_size, "--ffn-hidden-size / tp": m.ffn // shape.tp,
            "heads x head dim / tp": m.num_attention_heads * m.head_dim // shape.tp,
            "query groups x head dim / tp": kv * m.head_dim,
            "micro-batch tokens per rank (grad_w's inner dim)":
                t.micro_batch_size * m.seq_length // shape.cp}  # fmt: skip
    for name, v in dims.items():
        if v % q:
            return f"{name}={v} is not divisible by {q}, which --fp8-recipe {t.fp8_recipe} needs"
    return device_problem()


def check_schedule(cfg: Config, shape: RunShape) -> str | None:
    """Why the schedule, ramp-up or precision flags cannot run (megalite/schedule.py), or None."""
    t = cfg.training
    if t.bf16 and t.fp16:
        return "give one of --bf16 and --fp16, not both"
    if (t.bf16 or t.fp16) and t.precision != ("bf16" if t.bf16 else "fp16"):
        return f"--{'bf16' if t.bf16 else 'fp16'} contradicts --precision {t.precision}"
    if t.grad_reduce_in_bf16 and t.precision != "bf16":
        return "--grad-reduce-in-bf16 needs --bf16 (it keeps bf16 parameters' gradients in bf16)"
    o = cfg.optimizer
    if (
        o.hysteresis < 1
        or o.loss_scale_window < 1
        or not 0 < o.min_loss_scale <= o.initial_loss_scale
    ):
        return ("fp16 loss scaling needs --hysteresis and --loss-scale-window >= 1 and 0 < "
                "--min-loss-scale <= --initial-loss-scale")  # fmt: skip
    if o.loss_scale is not None and (o.loss_scale <= 0 or t.precision == "fp32"):
        return f"--loss-scale={o.loss_scale} needs a positive scale and --fp16 or --bf16"
    reason = lr_schedule.problem(cfg, shape.dp)
    if reason or (t.rampup_batch_size is None and t.step_batch_size_schedule is None):
        return reason
    for size in lr_schedule.batch_sizes(t, cfg.model.seq_length):  # each count it runs with
        m = shape.microbatches_at(size)  # (problem() above checked that each size divides)
        reason = schedules.check_shape(shape.schedule, shape.pp, shape.vpp, m)
        if reason:
            return f"the global batch {size} of the batch-size ramp-up: {reason}"
    return None
