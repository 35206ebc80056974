"""The run's shape: every value derived from the config and the world size, computed once.

`validate(cfg, world_size)` rejects impossible combinations with one clear sentence (before any
process group exists; nothing here imports torch, but for an FP8 run's check of its recipe and
device) and returns a frozen `RunShape`. Nothing is written into the user's config: code that
needs a derived value (dp, the schedule, the micro-batches per step, the padded vocabulary, ...)
reads the shape. The planner's layout search calls `derive` too, so a layout it proposes is one
`validate` accepts.
"""

import dataclasses
import os
import sys
from dataclasses import dataclass

from megalite import lr_schedule
from megalite.config import Config, ModelConfig
from megalite.errors import MegaliteError
from megalite.parallel.axes import AXES, INFERRED, cp_levels, ranks, split_batch
from megalite.parallel.topology import Topology, parse_order
from megalite.parallel.zero import ZERO, ZeroStage
from megalite.pipeline import schedules
from megalite.pipeline.partition import Partition


@dataclass(frozen=True)
class RunShape:
    world_size: int
    sizes: tuple  # ((axis, size), ...) in rank order, fastest first
    vpp: int
    schedule: str
    sequence_parallel: bool  # in effect (False at tp=1)
    microbatches: int  # per step, on each rank that splits the batch
    micro_batch_size: int
    global_batch_size: int
    model: ModelConfig  # the user's model section, its vocabulary filled in once known
    ep: int = 1  # expert-parallel size: a second decomposition of tp*dp, not an axis of its own
    etp: int = 1
    zero: ZeroStage = ZERO[0]  # the ZeRO stage (--zero-stage)
    stage_layers: tuple = ()  # transformer layers per virtual stage, pipeline order (partition.py)
    cp_a2a: int | None = None  # a2a+p2p: the all-to-all level A of cp = A*P (Topology.cp_a2a)

    def size(self, axis: str) -> int:
        return dict(self.sizes).get(axis, 1)

    def __getattr__(self, axis: str) -> int:  # shape.tp, shape.pp, shape.dpr, ...
        # (not dp: shape.dp is the user's --dp, below; the dp axis alone is size("dp"))
        if axis in AXES:
            return self.size(axis)
        raise AttributeError(axis)

    @property
    def order(self) -> str:
        return "-".join(a for a, _ in self.sizes)

    @property
    def dp(self) -> int:
        """The data-parallel ranks, the user's --dp: every axis that splits the batch. With
        --dp-replicate R that is the dp axis (a ZeRO shard group, `size("dp")`) times R (dpr)."""
        return ranks(dict(self.sizes), splits_batch=True)

    data = dp  # trainer.py's name for it until it reads shape.dp

    def __str__(self) -> str:  # "tp=2 pp=2 dp=4 vpp=2 zero=1 sp": the layout, as plans print it
        sizes = dict(self.sizes)
        out = f"tp={self.tp} pp={self.pp} dp={self.dp}"  # (dp x dpr: --dp, as the user gave it)
        out += "".join(
            f" {a}={n}" for a, n in sizes.items() if a not in ("tp", "pp", "dp") and n > 1
        )
        out += f" ep={self.ep}" if self.model.num_experts else ""
        out += f" etp={self.etp}" if self.etp > 1 else ""
        out += f" vpp={self.vpp}" if self.vpp > 1 else ""
        return out + f" zero={self.zero.stage}" + (" sp" if self.sequence_parallel else "")

    def topology(self) -> Topology:
        """The ranks' layout; with experts, carrying their decomposition (`topo.expert`)."""
        topo = Topology(self.order, **dict(self.sizes))
        if self.model.num_experts:
            topo.expert = topo.experts(self.ep, self.etp)
        topo.cp_a2a = self.cp_a2a
        return topo

    @property
    def placement(self):
        return schedules.schedule(self.schedule).placement

    @property
    def partition(self) -> Partition:
        """Which layers live on which (pipeline rank, chunk): `shape.partition.rank_chunks(r)`."""
        counts = (
            self.stage_layers or Partition.even(self.model.num_layers, self.pp, self.vpp).counts
        )
        return Partition(counts, self.pp, self.vpp, self.placement)

    @property
    def padded_vocab_size(self) -> int:
        return self.model.padded_vocab_size(self.tp)

    @property
    def hidden_shape(self) -> tuple[int, int, int]:
        """The tensor between pipeline stages: (b, s/cp, h), (b, s/cp/tp, h) with sequence
        parallelism (cp: this rank's share of each sequence, context parallelism)."""
        s = self.model.seq_length // self.cp
        return (self.micro_batch_size, s // self.tp if self.sequence_parallel else s,
                self.model.hidden_size)  # fmt: skip

    def with_vocab(self, vocab_size: int) -> "RunShape":
        """The shape once the tokenizer is known: --vocab-size if given (at least the
        tokenizer's), else the tokenizer's."""
        given = self.model.vocab_size
        if given is not None and given < vocab_size:
            raise MegaliteError(
                f"the tokenizer has {vocab_size} pieces but --vocab-size is {given}; raise "
                f"--vocab-size to at least {vocab_size} or omit it"
            )
        model = dataclasses.replace(self.model, vocab_size=given or vocab_size)
        return dataclasses.replace(self, model=model)

    def layout(self) -> dict:
        """What a checkpoint records of the layout that wrote it."""
        # a newer axis of size 1 goes unrecorded: checkpoints written before it match this layout.
        # An axis whose copies hold the same shards (dpr) right after dp numbers the ranks as
        # dp x dpr plain dp ranks do and changes only how gradients are reduced: it is recorded
        # as that dp, so a run resumed at another --dp-replicate keeps its RNG streams.
        sizes, prev = {}, None
        for a, n in self.sizes:
            if prev == "dp" and AXES[a].replicated and not AXES[a].shards:
                sizes["dp"] *= n
            elif n > 1 or a in ("tp", "dp", "pp"):
                sizes[a] = n
            prev = a
        out = {**sizes, "vpp": self.vpp, "world_size": self.world_size}
        return {**out, "ep": self.ep} if self.ep > 1 else out


def _positive(cfg: Config):
    m, p, t = cfg.model, cfg.parallel, cfg.training
    values = {
        "tp": p.tp, "cp": p.cp, "pp": p.pp, "vpp": p.vpp, "num-layers": m.num_layers,
        "hidden-size": m.hidden_size, "num-attention-heads": m.num_attention_heads,
        "seq-length": m.seq_length, "micro-batch-size": t.micro_batch_size,
        "global-batch-size": t.global_batch_size, "train-iters": t.train_iters,
        "log-interval": t.log_interval, "dp": p.dp, "num-query-groups": m.num_query_groups,
        "dp-replicate": p.dp_replicate,
        "ffn-hidden-size": m.ffn_hidden_size, "vocab-size": m.vocab_size,
        "num-experts": m.num_experts, "moe-router-topk": m.moe_router_topk,
        "moe-ffn-hidden-size": m.moe_ffn_hidden_size, "moe-layer-freq": m.moe_layer_freq,
        "moe-shared-expert-intermediate-size": m.moe_shared_expert_intermediate_size,
        "expert-model-parallel-size": p.ep, "expert-tensor-parallel-size": p.etp,
        "kv-channels": m.kv_channels, "sliding-window": m.sliding_window,
        "window-attn-skip-freq": m.window_attn_skip_freq,
    }  # fmt: skip
    for name, v in values.items():
        if v is not None and v < 1:
            raise MegaliteError(f"--{name}={v} must be a positive integer")


def model_ranks(cfg: Config) -> int:
    """The ranks one model copy spans: the configured sizes of the axes that do not split the
    batch (tp*cp*pp). The world is --dp times this (derive; launch.planned_world)."""
    return ranks({a: ax.size(cfg) for a, ax in AXES.items() if ax.size}, splits_batch=False)


def derive(cfg: Config, world_size: int) -> RunShape:
    """The shape of this layout (cfg.parallel) on `world_size` ranks, or MegaliteError naming
    why the model or the batch cannot run that way. A schedule that fixes its chunks per rank
    (a V: 2) fills in --vpp left at 1 (`Schedule.vpp`); the shape's vpp is then its."""
    name = cfg.parallel.pp_schedule or schedules.default_schedule(cfg.parallel.vpp)
    vpp = schedules.schedule(name).vpp(cfg.parallel.vpp)
    if vpp != cfg.parallel.vpp:  # (a copy: the user's config is not changed)
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, vpp=vpp))
    m, p, t = cfg.model, cfg.parallel, cfg.training
    sizes = {a: (ax.size(cfg) if ax.size else None) for a, ax in AXES.items()}  # dp: None
    # --dp counts every rank that splits the batch: an axis that does (dpr) divides it, the
    # others (tp, cp, pp) divide the world
    given, split = model_ranks(cfg), ranks(sizes, splits_batch=True)
    # the messages name tp and pp, and any other axis given a size (cp=1 goes unsaid)
    shown = [a for a, n in sizes.items() if a != INFERRED and not AXES[a].splits_batch
             and (n > 1 or a in ("tp", "pp"))]  # fmt: skip
    named = "*".join(shown)
    values = "*".join(str(sizes[a]) for a in shown)
    if world_size % given:
        raise MegaliteError(
            f"world size {world_size} is not divisible by {named}={values}; "
            f"launch a multiple of {given} processes or change {'/'.join('--' + a for a in shown)}"
        )
    if p.dp is not None and p.dp * given != world_size:
        raise MegaliteError(
            f"{named}*dp={values}*{p.dp}={given * p.dp} does not equal the world size {world_size}; "
            "fix --dp or omit it to infer it"
        )
    data = world_size // given
    if data % split:
        raise MegaliteError(
            f"--dp-replicate {split} does not divide dp={data} (the dp ranks form dp-replicate "
            f"copies of a ZeRO shard group); choose a divisor of {data}"
        )
    sizes[INFERRED] = data // split
    try:
        axes = parse_order(p.order, sizes)
    except ValueError as e:
        raise MegaliteError(f"--order: {e}") from None
    if m.kv_channels is None and m.hidden_size % m.num_attention_heads:
        raise MegaliteError(
            f"hidden_size={m.hidden_size} is not divisible by num_attention_heads={m.num_attention_heads}"
        )
    if m.num_attention_heads % m.heads_kv:
        raise MegaliteError(
            f"num_attention_heads={m.num_attention_heads} is not divisible by num_query_groups={m.heads_kv}"
        )
    if m.features.rotary and m.head_dim % 2:
        raise MegaliteError(f"head dim {m.head_dim} must be even for rotary embeddings")
    reason = _check_latent_attention(m) or _check_mtp(cfg, sizes)
    if reason:
        raise MegaliteError(reason)
    for ax in AXES.values():
        reason = ax.check(cfg, sizes) if ax.check else None
        if reason:
            raise MegaliteError(reason)
    reason = _check_experts(cfg, sizes, axes)
    if reason:
        raise MegaliteError(reason)
    partition = Partition.from_flags(
        m.num_layers, sizes["pp"], p.vpp, schedules.schedule(name).placement,
        first=p.decoder_first_pipeline_num_layers, last=p.decoder_last_pipeline_num_layers,
        embedding=p.account_for_embedding_in_pipeline_split,
        loss=p.account_for_loss_in_pipeline_split, layout=p.pipeline_model_parallel_layout,
        mtp_layers=m.mtp_num_layers or 0,
    )  # fmt: skip
    partition.check_every_rank_holds_something()
    microbatches = split_batch(t.global_batch_size, t.micro_batch_size, data)
    reason = schedules.check_shape(name, sizes["pp"], p.vpp, microbatches)
    if reason:
        raise MegaliteError(reason)
    # (a RoPE model's max_position_embeddings is what it declares: a run may train longer)
    learned = m.features.learned_positions and m.max_position_embeddings is not None
    if learned and m.seq_length > m.max_position_embeddings:
        raise MegaliteError(
            f"seq_length={m.seq_length} exceeds max_position_embeddings={m.max_position_embeddings}"
        )
    zero = ZERO[cfg.optimizer.zero_stage]
    if split > 1 and not zero.shard_state:
        raise MegaliteError(
            f"--dp-replicate {split} needs a sharded optimizer (--zero-stage 1, 2 or 3): at "
            f"--zero-stage {zero.stage} every rank holds the whole state and gradients are "
            "all-reduced over all dp ranks"
        )
    return RunShape(
        world_size=world_size,
        sizes=tuple((a, sizes[a]) for a in axes),
        vpp=p.vpp,
        schedule=name,
        sequence_parallel=p.sequence_parallel and sizes["tp"] > 1,
        microbatches=microbatches,
        micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size,
        model=dataclasses.replace(m),
        ep=p.ep,
        etp=p.etp,
        zero=zero,
        stage_layers=partition.counts,
        cp_a2a=(cp_levels(p) or (None,))[0],
    )


def _check_routing(m) -> str | None:
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


def _check_experts(cfg: Config, sizes: dict, axes: tuple) -> str | None:
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
    why = _check_routing(m)
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


def _check_attention(cfg: Config) -> str | None:
    """Why this model's attention variant cannot run, or None."""
    m = cfg.model
    if m.rope_scaling != "none" and m.rope_scaling_factor <= 0:
        return f"--rope-scaling-factor={m.rope_scaling_factor} must be positive"
    return None


def _check_latent_attention(m) -> str | None:
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


def _check_mtp(cfg: Config, sizes: dict) -> str | None:
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


def _check_fp8(cfg: Config, shape: RunShape) -> str | None:
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


def _check_schedule(cfg: Config, shape: RunShape) -> str | None:
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
    unit = t.micro_batch_size * shape.dp
    for size in lr_schedule.batch_sizes(t, cfg.model.seq_length):  # each count it runs with
        reason = schedules.check_shape(shape.schedule, shape.pp, shape.vpp, size // unit)
        if reason:
            return f"the global batch {size} of the batch-size ramp-up: {reason}"
    return None


def validate(cfg: Config, world_size: int) -> RunShape:
    """Reject impossible configs with one sentence; the run's shape. cfg is not changed."""
    _positive(cfg)
    o, p = cfg.optimizer, cfg.parallel
    shape = derive(cfg, world_size)
    if p.sequence_parallel and p.tp == 1 and int(os.environ.get("LOCAL_RANK", 0)) == 0:
        # Documented choice: sequence parallelism is a TP feature; at tp=1 it is ignored.
        print("megalite: warning: --sequence-parallel has no effect at tp=1; ignored",
              file=sys.stderr)  # fmt: skip
    if p.tp_comm_overlap and not p.sequence_parallel:
        raise MegaliteError(
            "--tp-comm-overlap overlaps sequence parallelism's all-gathers and reduce-scatters "
            "with the matmuls: add --sequence-parallel"
        )
    if p.tp_comm_overlap and cfg.training.fp8_format is not None:
        raise MegaliteError(
            "--tp-comm-overlap cuts the bf16/fp32 matmuls into pieces, not FP8's linears: drop "
            "one of --tp-comm-overlap and --fp8-format"
        )
    if shape.vpp != p.vpp and int(os.environ.get("LOCAL_RANK", 0)) == 0:
        print(f"megalite: vpp={shape.vpp} inferred: the {shape.schedule} schedule runs "
              f"{shape.vpp} chunks per rank", file=sys.stderr)  # fmt: skip
    if o.min_lr > o.lr:
        raise MegaliteError(f"min_lr={o.min_lr} is larger than lr={o.lr}")
    reason = _check_schedule(cfg, shape)
    if reason:
        raise MegaliteError(reason)
    if not 0 <= o.muon_momentum < 1:
        raise MegaliteError(f"--muon-momentum {o.muon_momentum} must be in [0, 1)")
    if o.muon_ns_steps < 1:
        raise MegaliteError(f"--muon-ns-steps {o.muon_ns_steps} must be at least 1")
    d = cfg.data
    if d.reset_attention_mask and cfg.model.attention_dropout > 0:
        raise MegaliteError(
            "--reset-attention-mask does not support attention dropout; set --attention-dropout 0"
        )
    reason = _check_attention(cfg)
    if reason:
        raise MegaliteError(reason)
    reason = _check_fp8(cfg, shape)
    if reason:
        raise MegaliteError(reason)
    if p.distributed_timeout_minutes <= 0:
        raise MegaliteError("--distributed-timeout-minutes must be positive")
    if cfg.model.num_experts and not shape.zero.experts:
        raise MegaliteError(
            f"--zero-stage {o.zero_stage} does not shard mixture-of-experts models yet; use "
            "--zero-stage 2"
        )
    return shape
