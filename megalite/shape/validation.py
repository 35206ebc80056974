"""`derive` (the shape of a layout on a world size, or why it cannot run) and `validate` (derive,
then every check of the flags): the run shape's two entry points (megalite/shape/__init__.py).
The checks of one feature each are checks.py's."""

import dataclasses
import os
import sys

from megalite.config import Config
from megalite.errors import MegaliteError
from megalite.parallel.axes import AXES, INFERRED, cp_levels, ranks, split_batch
from megalite.parallel.topology import parse_order
from megalite.parallel.zero import ZERO
from megalite.pipeline import schedules
from megalite.pipeline.partition import Partition
from megalite.shape.checks import (
    check_attention,
    check_experts,
    check_fp8,
    check_latent_attention,
    check_mtp,
    check_schedule,
)
from megalite.shape.run_shape import RunShape


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
    reason = check_latent_attention(m) or check_mtp(cfg, sizes)
    if reason:
        raise MegaliteError(reason)
    for ax in AXES.values():
        reason = ax.check(cfg, sizes) if ax.check else None
        if reason:
            raise MegaliteError(reason)
    reason = check_experts(cfg, sizes, axes)
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
    reason = check_schedule(cfg, shape)
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
    reason = check_attention(cfg)
    if reason:
        raise MegaliteError(reason)
    reason = check_fp8(cfg, shape)
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
