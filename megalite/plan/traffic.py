"""Bytes a rank sends per step, per group kind, as the `CommLedger` counts them, computed without
a process group (docs/planner.md gives the formulas): TP's collectives per layer, the pipeline's
sends walked from the schedule, context parallelism's attention, and per gradient bucket the
collectives the layout's ZeRO stage makes (`ZeroStage.collectives`)."""

import dataclasses

from megalite.config import Config
from megalite.optim import muon_owners
from megalite.optim.muon import muon_on, muon_parts
from megalite.parallel.axes import replica_axis, shard_copies_axis, zero_shard_axis
from megalite.parallel.topology import Topology
from megalite.parallel.zero3 import carried_units, unit_gathers, unit_of
from megalite.pipeline.actions import SEND_B, SEND_F
from megalite.plan.activations import attention_core_heads, schedule_actions
from megalite.plan.memory import (
    BYTES,
    buckets,
    chunk_specs,
    expert_parallel,
    fp8_layer,
    fp8_weights,
    fused_blocks,
    replicas,
    reshard_policy,
    zero3_units,
)
from megalite.shape import RunShape


def zero3_notes(cfg: Config, shape: RunShape, pp_rank: int, microbatches: int) -> list[str]:
    """Both choices ZeRO-3 makes, with what each costs on this rank: the reshard policy
    (memory gathered at once, gather bytes per step) and gradient accumulation (a reduce-scatter
    per micro-batch, what megalite does, or one whole unsharded gradient reduced once)."""
    d, e = replicas(shape), BYTES[cfg.training.precision]
    g_size = 4 if cfg.training.precision in ("bf16", "fp16") else e
    units, ours = zero3_units(cfg, shape, pp_rank), reshard_policy(cfg, shape)
    keys = [unit_of(ranges[0][0]) for _, _, ranges in buckets(cfg, shape, pp_rank)]
    chunks = len(shape.partition.rank_chunks(pp_rank))
    out = []
    for policy, (peak, _, gathers) in units.items():
        # (zero3_units' buckets are in the order of buckets')
        per_unit = _gathers_per_unit([(k, amaxes > 0) for k, (_, amaxes) in zip(keys, gathers)],
                                     chunks, policy, microbatches)  # fmt: skip
        traffic = sum(per_unit[key] * _gather_bytes(d, *x) for key, x in zip(keys, gathers))
        mark = " (this run)" if policy == ours else ""
        out.append(f"zero3 reshard={policy}{mark}: {peak / 2**20:.2f} MiB gathered at most, "
                   f"{traffic / 1e6:.2f} MB of parameter gathers per step")  # fmt: skip
    sizes = units[ours][1]
    each = sum(_ring("gather", d, n * g_size) for n in sizes)
    whole = sum(sizes) * g_size
    out.append(f"zero3 gradients, reduce-scatter every micro-batch (this run): "
               f"{microbatches * each / 1e6:.2f} MB per step, no whole gradient; keeping the "
               f"unsharded gradient until the last micro-batch: {each / 1e6:.2f} MB per step, "
               f"+{whole / 2**20:.2f} MiB")  # fmt: skip
    return out


def _gather_bytes(d: int, nbytes: int, amaxes: int) -> int:
    """Bus bytes of gathering one ZeRO-3 bucket of `nbytes` over d replicas, after the all-reduce
    of its `amaxes` FP8 weights' amaxes (fp32) when it travels in FP8 (--fp8-param-gather)."""
    return _ring("gather", d, nbytes) + (_ring("all_reduce", d, 4 * amaxes) if amaxes else 0)


def _ring(kind: str, n: int, nbytes: float) -> int:
    """Bus bytes the CommLedger records for one call (it truncates each call to an int)."""
    factor = {"all_reduce": 2 * (n - 1) / n, "gather": (n - 1) / n, "p2p": 1.0}[kind]
    return int(factor * nbytes) if n > 1 else 0


def cp_layer_bytes(cfg: Config, shape: RunShape) -> tuple[int, int]:
    """Bytes one layer's attention sends over cp per micro-batch, (forward, backward). Ring
    (p2p): cp-1 hops of this rank's K and V forward; backward cp-1 hops of K and V again and cp
    of dK, dV (the last one home) in the attention's output precision (fp32 for bf16/fp16).
    All-to-all:
    q, k+v and the output forward, their reverses backward (the bytes each rank hands in).
    a2a+p2p: those exchanges over the A ranks, then the ring over P (A times the tokens, 1/A of
    the heads: the same K/V bytes per hop), both counted as cp's."""
    cp = shape.cp
    if cp == 1:
        return 0, 0
    m, tr, t = cfg.model, cfg.training, shape.tp
    e, b, s = BYTES[tr.precision], tr.micro_batch_size, m.seq_length // cp
    heads, d = attention_core_heads(m)  # MLA: a k and v per head, padded to its q/k dims
    kv_heads = heads // t if heads % t == 0 else 1  # each rank's k/v heads
    kv = b * kv_heads * s * d  # elements of this rank's K (or V)
    q = b * m.num_attention_heads // t * s * d
    exchange = (2 * q + 2 * kv) * e  # q, k+v and the output
    if cfg.parallel.cp_comm_type == "a2a":
        return exchange, exchange
    a2a = shape.cp_a2a or 1  # a2a+p2p's all-to-all level (1: the ring alone)
    exchange, ring = (exchange if a2a > 1 else 0), cp // a2a
    hops = (ring - 1) * 2 * kv * e
    back = ring * 2 * kv * max(e, 4) if ring > 1 else 0
    return exchange + hops, exchange + hops + back


def step_bytes(cfg: Config, shape: RunShape) -> dict:
    """Bytes one algorithm step carries, per group kind whose messages have one size (the
    latency term of links.seconds: a kind's steps are its bus bytes over these): TP's
    collectives of a (b, s/cp, h) activation, S/tp a ring step; cp's ring hop of this rank's
    K and V (an all-to-all's q, k/v or output over cp); an expert dispatch's share of one of
    ep - 1 peers; the split sizes' E int64. Pipeline hops, the data-parallel buckets, the tied
    embedding's all-reduce and the step's status all-reduce are counted where they are timed
    (ranking.step_parts)."""
    tr = dataclasses.replace(cfg.training, micro_batch_size=shape.micro_batch_size)
    cfg = dataclasses.replace(cfg, training=tr)
    m, e, t = cfg.model, BYTES[tr.precision], shape.tp
    b, s, h = tr.micro_batch_size, m.seq_length // shape.cp, m.hidden_size
    out = {"tp": b * s * h * e / t}
    if shape.cp > 1:
        fwd, _ = cp_layer_bytes(cfg, shape)
        a2a = shape.cp_a2a or 1
        if cfg.parallel.cp_comm_type == "a2a":
            a2a = shape.cp
        hops = shape.cp // a2a - 1 + (3 * (a2a - 1) if a2a > 1 else 0)
        out["cp"] = fwd / hops
    ep = expert_parallel(shape)[0]
    if m.num_experts and ep > 1:
        kept = min(1.0, m.moe_expert_capacity_factor or 1.0)
        out["ep"] = b * s // t * m.moe_router_topk * kept * h * e / (ep - 1)
        out["ep_sizes"] = m.num_experts * 8
    return out


def latency_steps(cfg: Config, shape: RunShape, comm: dict, microbatches: int) -> dict:
    """{kind: algorithm steps per step} of the kinds `step_bytes` sizes: a kind's bus bytes
    over what a step carries. cp's count its attention's bytes only: at dp = 1 the "cp" kind
    also holds the gradients' reduction over cp (buckets, counted with the data-parallel
    rings)."""
    chunk = step_bytes(cfg, shape)
    out = {k: comm.get(k, 0) / c for k, c in chunk.items() if c}
    if "cp" in chunk:
        fwd, bwd = cp_layer_bytes(cfg, shape)
        passes = 2 if cfg.training.recompute == "full" else 1
        layers = max(sum(len(kw["layers"]) for kw in shape.partition.rank_chunks(r))
                     for r in range(shape.pp))  # fmt: skip
        attention = layers * microbatches * (passes * fwd + bwd)
        out["cp"] = min(comm.get("cp", 0), attention) / chunk["cp"]
    return out


def _gathers_per_unit(pieces: list, chunks: int, policy: str, microbatches: int) -> dict:
    """{unit key: its gathers per step} under ZeRO-3's `policy`, from (unit key, holds FP8
    weights) per bucket in layout order (the run's Zero3Buffer: zero3.carried_units)."""
    units = {}
    for key, fp8 in pieces:
        units[key] = units.get(key, False) or fp8
    carried = carried_units(list(units.items()), chunks, policy)
    return {key: unit_gathers(policy, microbatches, key, carried) for key in units}


def comm_bytes(
    cfg: Config, shape: RunShape, pp_rank: int, microbatches: int, dp_rank=0, bs=None,
    tp_rank=0, edp_rank=0,
) -> dict:  # fmt: skip
    """Bytes per step this rank's ledger records, per group kind (docs/planner.md). With
    context parallelism activations are s/cp tokens of each sequence, attention sends its
    bytes over cp, and gradients are reduced over the dp*cp replicas (ledger kind "cp+dp",
    or "cp" at dp=1)."""
    cp, whole, zero = shape.cp, cfg, shape.zero
    if cp > 1:  # every activation is this rank's s/cp tokens
        m = dataclasses.replace(cfg.model, seq_length=cfg.model.seq_length // cp)
        cfg = dataclasses.replace(cfg, model=m)
    m, tr = cfg.model, cfg.training
    t, d, pp = shape.tp, replicas(shape), shape.pp
    e, b, s, h = BYTES[tr.precision], tr.micro_batch_size, m.seq_length, m.hidden_size
    low = tr.precision in ("bf16", "fp16")
    g_size = 4 if low else e
    sequence_parallel = shape.sequence_parallel
    act = b * s * h * e
    kws = shape.partition.rank_chunks(pp_rank)
    out = {}

    # TP, per micro-batch: each of the 2 blocks of a layer has 2 all-reduces (forward of the
    # row-parallel exit, backward of the column-parallel entry) or, with SP, 2 all-gathers and 2
    # reduce-scatters: 8 (t-1)/t b s h elements either way; full recompute repeats the forward.
    # With SP a fused block gathers its input again in backward, but in FP8 (memory.fused_blocks).
    regather = _ring("gather", t, act) if sequence_parallel else 0
    if sequence_parallel:
        per_layer = 8 * _ring("gather", t, act)
        embed = head = 2 * _ring("gather", t, act)
    else:
        per_layer = 4 * _ring("all_reduce", t, act)
        embed = head = _ring("all_reduce", t, act)
    if tr.recompute == "full":
        per_layer += per_layer // 2
    ce = _ring("all_reduce", t, b * s * 4) + _ring("all_reduce", t, 2 * b * s * 4)  # max; 2 sums
    tp_bytes = 0
    moe = _moe_comm(cfg, shape)
    L = m.num_layers
    for kw in kws:
        # the head's chunk runs the MTP modules (model/mtp.py): layer L + k, the embedding
        # of the shifted ids, the head's logits and loss again
        mtp = range(L, L + m.mtp_num_layers) if kw["has_head"] else ()
        for i in [*kw["layers"], *mtp]:
            if not fp8_layer(cfg, m, i):
                tp_bytes += regather * fused_blocks(m, m.is_moe_layer(i))
            if m.is_moe_layer(i):
                for kind, n in moe.items():
                    out[kind] = out.get(kind, 0) + n * microbatches
            else:
                tp_bytes += per_layer
        tp_bytes += embed if kw["has_embedding"] else 0
        tp_bytes += (head + ce) * (1 + len(mtp)) + embed * len(mtp) if kw["has_head"] else 0
    tp_bytes *= microbatches
    tp_bytes += out.pop("tp", 0)
    bs = bs or buckets(cfg, shape, pp_rank)
    sync, tied = 0, 0
    for start, end, ranges in bs:  # the grad_sum groups of the part of a bucket this rank updates
        shard = zero.shard(end - start, d)
        lo = start + (dp_rank * shard if zero.shard_state else 0)
        hi = lo + shard
        for _, off, n, summed in ranges:
            overlap = max(0, min(off + n, hi) - max(off, lo))
            sync += overlap if "tp" in summed else 0
            tied += overlap if "embed" in summed else 0
    tp_bytes += _ring("all_reduce", t, sync * g_size) if sync else 0
    out["tp"] = tp_bytes

    # PP: every send of the schedule carries one hidden tensor (a logging step adds one
    # all-reduce of m+2 float64: the losses and the first stage's timing).
    actions = schedule_actions(shape.schedule, pp, shape.vpp, microbatches, pp_rank)
    sends = sum(kind in (SEND_F, SEND_B) for kind, _ in actions)
    out["pp"] = sends * (act // (t if sequence_parallel else 1))

    # DP, per bucket: the collectives of the ZeRO stage (ZeroStage.collectives), ZeRO-3's
    # parameter gathers counted apart as dp_gather. Plus the loss mean (a logging step's).
    policy = reshard_policy(cfg, shape)
    calls = zero.collectives(microbatches, policy)
    fp8 = {}  # --fp8-param-gather: FP8 weights' buckets gathered at 1 byte, after their amaxes
    if tr.fp8_param_gather:
        layers = [i for kw in kws for i in kw["layers"]]
        fp8 = fp8_weights(cfg, shape, layers, any(kw["has_head"] for kw in kws))
    dp_bytes = 0
    if calls.get("param_gather"):  # ZeRO-3
        per_unit = _gathers_per_unit(
            [(unit_of(r[0][0]), any(x[0] in fp8 for x in r)) for _, _, r in bs], len(kws),
            policy, microbatches,
        )  # fmt: skip
    for start, end, ranges in bs:
        n = end - start
        dp_bytes += _dp_bytes(calls, d, n * g_size, n * e)
        if calls.get("param_gather"):
            amaxes = len({fp8[r[0]] for r in ranges if r[0] in fp8})
            each = _gather_bytes(d, n * (1 if amaxes else e), amaxes)
            out["dp_gather"] = out.get("dp_gather", 0) + per_unit[unit_of(ranges[0][0])] * each
    # the shard group's kind (dp, cp+dp); with --dp-replicate each shard is all-reduced over
    # the copies of the group (dpr) once a step, and the loss mean spans both (dp+dpr)
    shard, everyone, copies = (
        _kind(shape, f) for f in (zero_shard_axis, replica_axis, shard_copies_axis)
    )
    out[shard] = out.get(shard, 0) + dp_bytes
    out[everyone] = out.get(everyone, 0) + _ring("all_reduce", d * shape.dpr, 8)
    for start, end, _ in bs:
        n = calls.get("shard_all_reduce", 0) * zero.shard(end - start, d) * g_size
        out[copies] = out.get(copies, 0) + _ring("all_reduce", shape.dpr, n)
    if cp > 1:  # attention's own bytes over cp
        layers = sum(len(kw["layers"]) for kw in kws)
        passes = 2 if tr.recompute == "full" else 1  # a recomputed forward sends again
        fwd, bwd = cp_layer_bytes(whole, shape)
        out["cp"] = out.get("cp", 0) + layers * microbatches * (passes * fwd + bwd)
    out["embed"] = _ring("all_reduce", 2, tied * g_size) if tied else 0
    for kind, n in muon_bytes(whole, shape, pp_rank, dp_rank, tp_rank, edp_rank).items():
        out[kind] = out.get(kind, 0) + n
    # the step's status, float64 each: the gradient norm, the inf flag, the preemption signal
    # and time-limit flags, and the loss when the spike guard reads it
    status = 4 + (tr.spike_threshold > 0)
    out["world"] = _ring("all_reduce", shape.world_size, 8 * status)
    if m.num_experts:  # the expert buffer over edp, as the dense one over dp
        edp = expert_parallel(shape)[1]
        for start, end, _ in buckets(cfg, shape, pp_rank, experts=True):
            n = end - start
            out["edp"] = out.get("edp", 0) + _dp_bytes(calls, edp, n * g_size, n * e)
        if m.moe_router_enable_expert_bias:  # the step's loads: (layers + MTP, E) float64
            rows = m.num_layers + m.mtp_num_layers
            out["world"] += _ring("all_reduce", shape.world_size, rows * m.num_experts * 8)
    return {k: v for k, v in out.items() if v}


def muon_bytes(cfg: Config, shape: RunShape, pp_rank: int, dp_rank=0, tp_rank=0, edp_rank=0):
    """Bytes --optimizer muon's all-to-alls send per step on this rank (optim/muon_owners.py's
    three hops, the plan the step makes): over the replicas, tp, and edp for the experts."""
    if not muon_on(cfg.optimizer):
        return {}
    m, prec, t = cfg.model, cfg.training.precision, shape.tp
    e = 4 if prec in ("bf16", "fp16") else BYTES[prec]  # the update: in the state's dtype
    ep, edp = expert_parallel(shape)
    specs = {}
    for kw in shape.partition.rank_chunks(pp_rank):
        sequence_parallel = shape.sequence_parallel
        specs.update(
            (n, s)
            for n, _, s in chunk_specs(
                m, t, **kw, sequence_parallel=sequence_parallel, ep=ep, etp=shape.etp
            )
        )
    out = {}
    for experts, kind, n, rank in (
        (False, _zero_shard_kind(shape), replicas(shape), dp_rank),
        (True, "edp", edp, edp_rank),
    ):
        owners = muon_owners.Owners(n, t)
        for start, end, ranges in buckets(cfg, shape, pp_rank, experts=experts):
            named = [(name, o, k, specs[name]) for name, o, k, _ in ranges]
            mats = owners.assign(muon_owners.matrices(named, t, muon_parts))
            sharded = shape.zero.shard(end - start, n) < end - start
            shards = muon_owners.bounds(start, end - start, n, sharded)
            over_group, over_tp = muon_owners.sent_elements(mats, shards, rank, tp_rank, t)
            out[kind] = out.get(kind, 0) + over_group * e
            out["tp"] = out.get("tp", 0) + over_tp * e
    return {k: v for k, v in out.items() if v}


def _zero_shard_kind(shape: RunShape) -> str:
    """The ledger kind of the group ZeRO shards over: dp, or with context parallelism cp+dp (cp)."""
    return _kind(shape, zero_shard_axis)


def _kind(shape: RunShape, axes) -> str:
    """The ledger kind of the group over the axes `axes(Axis)` holds for: its group's name."""
    return Topology(shape.order, **dict(shape.sizes)).product(axes)


def _dp_bytes(calls: dict, n: int, grad_bytes: int, param_bytes: int) -> int:
    """Bus bytes of one bucket's gradient reductions and its parameters' all-gather after the
    step over `n` replicas (`calls`: ZeroStage.collectives); ZeRO-3's gathers are dp_gather."""
    out = calls.get("all_reduce", 0) * _ring("all_reduce", n, grad_bytes)
    out += calls.get("reduce_scatter", 0) * _ring("gather", n, grad_bytes)
    return out + calls.get("all_gather", 0) * _ring("gather", n, param_bytes)


def _moe_comm(cfg: Config, shape: RunShape) -> dict:
    """Bytes one MoE layer records per micro-batch, forward and backward, per group kind.
    TP: attention as in a dense layer, the shared expert as an MLP, and without sequence
    parallelism the routed tokens' split along the sequence (an all-gather of the output
    forward, of the input's gradient backward), plus the load all-reduce (--moe-aux-loss-coeff)
    and the capacity all-gather. ep: dispatch and combine forward, their reverses backward,
    each T k h bytes with T = b s / tp tokens routed by a rank and as many assignments coming
    back as going out (balanced routing; at most capacity_factor of them with drops); the
    split sizes (E int64) all-gathered over ep forward. Full recompute repeats the forward."""
    m, tr = cfg.model, cfg.training
    t, e, b, s, h = shape.tp, BYTES[tr.precision], tr.micro_batch_size, m.seq_length, m.hidden_size
    sequence_parallel = shape.sequence_parallel
    act = b * s * h * e
    # per block
    fwd_block = 2 * _ring("gather", t, act) if sequence_parallel else _ring("all_reduce", t, act)
    shared = 1 if m.moe_shared_expert_intermediate_size else 0
    routed = 0 if sequence_parallel else _ring("gather", t, act)  # forward; the same again backward
    small = _ring("all_reduce", t, m.num_experts * 4) if m.moe_aux_loss_coeff else 0
    if m.moe_expert_capacity_factor is not None:
        small += _ring("gather", t, t * m.moe_router_topk * m.num_experts * 8)
    fwd = fwd_block * (1 + shared) + routed
    passes = 2 if tr.recompute == "full" else 1  # forwards per micro-batch
    out = {"tp": 2 * fwd + small + (passes - 1) * (fwd + small)}
    ep = expert_parallel(shape)[0]
    if ep > 1:
        kept = min(1.0, m.moe_expert_capacity_factor or 1.0)
        a2a = int(b * s // t * m.moe_router_topk * kept * h * e)
        out["ep"] = (2 * passes + 2) * a2a
        out["ep_sizes"] = passes * _ring("gather", ep, ep * m.num_experts * 8)
    return out
