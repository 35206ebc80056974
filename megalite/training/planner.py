"""Memory and traffic of a layout, computed without a process group or a GPU; a ranked search.

Everything here mirrors what megalite allocates and sends (docs/planner.md gives the formulas
and their sources):

- parameters, gradients and optimizer state: the real model's parameters (built on the `meta`
  device), cut into buckets by the gradient buffer's own `bucket_layout`, then the bytes the
  ZeRO stage allocates for this rank's shards (optim/zero.py; fp32 or bf16/fp16); at ZeRO-3
  also the units gathered at once under the run's reshard policy (memory.py);
- activations: what one micro-batch of each chunk keeps for backward (Korthikanti et al. 2022,
  counted for megalite's flash attention and its sequence parallelism; memory.py), times the
  chunks in flight at the schedule's worst moment (walked from the schedule here);
- bytes per step per group kind, as the `CommLedger` counts them.
"""

import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache

from megalite.config import Config
from megalite.pipeline.actions import SEND_B, SEND_F, B, F
from megalite.pipeline.partition import rank_chunks
from megalite.pipeline.schedules import (
    bubble_theory,
    check_shape,
    default_schedule,
    get_schedule,
)
from megalite.training.memory import (
    BYTES,
    GATHERS,
    buckets,
    chunk_activations,
    expert_parallel,
    replicas,
    reshard_policy,
    state_memory,
    zero3_units,
)

GiB = 2**30


class Layout:
    """A layout to plan: the size of each parallel axis, chunks per pipeline rank, the ZeRO
    stage and sequence parallelism. `Layout(tp=2, pp=2, dp=4, vpp=2, zero=1)`."""

    def __init__(self, vpp: int = 1, zero: int = 0, sequence_parallel: bool = False, **sizes):
        self.sizes = {"tp": 1, "pp": 1, "dp": 1, **sizes}
        self.vpp, self.zero, self.sequence_parallel = vpp, zero, sequence_parallel

    def __getattr__(self, axis: str) -> int:
        sizes = self.__dict__.get("sizes", {})
        if axis in sizes:
            return sizes[axis]
        raise AttributeError(axis)

    def _key(self):
        big = tuple(sorted((a, n) for a, n in self.sizes.items() if n > 1))
        return big, self.vpp, self.zero, self.sequence_parallel and self.tp > 1

    def __eq__(self, other):
        return isinstance(other, Layout) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __str__(self):
        sp = " sp" if self.sequence_parallel and self.tp > 1 else ""
        vpp = f" vpp={self.vpp}" if self.vpp > 1 else ""
        extra = "".join(f" {a}={n}" for a, n in self.sizes.items()
                        if a not in ("tp", "pp", "dp") and (n > 1 or a != "cp"))  # fmt: skip
        return f"tp={self.tp} pp={self.pp} dp={self.dp}{extra}{vpp} zero={self.zero}{sp}"

    __repr__ = __str__


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpu_memory_gib: float = 80.0
    gpus_per_node: int = 8
    usable: float = 0.9  # CUDA context, allocator fragmentation, NCCL buffers, temporaries
    # For the estimated step time (layouts.step_time): dense peak per GPU at the training
    # precision (H100/H200 SXM bf16), the MFU the compute reaches, and the bus bandwidth per GPU
    # inside a node (NVLink) and across nodes (InfiniBand, 200 Gb/s per GPU), in GB/s.
    peak_tflops: float = 989.0
    mfu: float = 0.45
    intra_node_gbps: float = 300.0
    inter_node_gbps: float = 25.0


@dataclass
class Plan:
    layout: Layout
    memory: dict  # bytes on the fullest pipeline rank: params, grads, optimizer, activations, total
    stages: list  # the same dict for every pipeline rank
    comm: dict  # bytes per step sent by the busiest rank, per group kind
    bubble: float  # the schedule's theory: Megatron's (pp-1)/(vpp*m) for 1F1B and interleaved
    microbatches: int
    fits: bool = True
    step_time: float | None = None  # estimated seconds per step (layouts.step_time)
    notes: list = field(default_factory=list)


def zero3_notes(cfg: Config, lay: Layout, pp_rank: int, microbatches: int) -> list[str]:
    """Both choices ZeRO-3 makes, with what each costs on this rank: the reshard policy
    (memory gathered at once, gather bytes per step) and gradient accumulation (a reduce-scatter
    per micro-batch, what megalite does, or one whole unsharded gradient reduced once)."""
    d, e = replicas(lay), BYTES[cfg.training.precision]
    g_size = 4 if cfg.training.precision in ("bf16", "fp16") else e
    units, ours = zero3_units(cfg, lay, pp_rank), reshard_policy(cfg, lay)
    out = []
    for policy, (peak, sizes) in units.items():
        traffic = GATHERS[policy](microbatches) * sum(_ring("gather", d, n * e) for n in sizes)
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


def _schedule_name(cfg: Config, lay: Layout) -> str:
    """The configured schedule where it can run the layout, else the default for its vpp."""
    name = cfg.parallel.pp_schedule
    if name and check_shape(name, lay.pp, lay.vpp, microbatches_of(cfg, lay)) is None:
        return name
    return default_schedule(lay.vpp)


@lru_cache(maxsize=4096)
def _schedule(name: str, pp: int, vpp: int, microbatches: int, rank: int) -> tuple:
    """(kind, chunk) of each action: the search asks for the same schedules many times."""
    return tuple((a.kind, a.chunk) for a in get_schedule(name, pp, vpp, microbatches, rank))


def peak_activations(cfg: Config, lay: Layout, pp_rank: int, microbatches: int) -> float:
    """Walk this rank's schedule: the most activation bytes alive at once."""
    kws = rank_chunks(cfg.model.num_layers, lay.pp, lay.vpp, pp_rank)
    per_chunk = [chunk_activations(cfg, lay, kw) for kw in kws]
    schedule = _schedule_name(cfg, lay)
    alive = peak = 0.0
    for kind, chunk in _schedule(schedule, lay.pp, lay.vpp, microbatches, pp_rank):
        if kind == F:
            alive += per_chunk[chunk][0]
            peak = max(peak, alive)
        elif kind == B:  # a recomputed layer's activations exist while its backward runs
            peak = max(peak, alive + per_chunk[chunk][1])
            alive -= per_chunk[chunk][0]
    return peak


# ---- communication -----------------------------------------------------------------------------


def _ring(kind: str, n: int, nbytes: float) -> int:
    """Bus bytes the CommLedger records for one call (it truncates each call to an int)."""
    factor = {"all_reduce": 2 * (n - 1) / n, "gather": (n - 1) / n, "p2p": 1.0}[kind]
    return int(factor * nbytes) if n > 1 else 0


def cp_layer_bytes(cfg: Config, lay: Layout) -> tuple[int, int]:
    """Bytes one layer's attention sends over cp per micro-batch, (forward, backward). Ring
    (p2p): cp-1 hops of this rank's K and V forward; backward cp-1 hops of K and V again and cp
    of dK, dV (the last one home) in the attention's output precision (fp32 for bf16/fp16).
    All-to-all:
    q, k+v and the output forward, their reverses backward (the bytes each rank hands in)."""
    cp = lay.sizes.get("cp", 1)
    if cp == 1:
        return 0, 0
    m, tr, t = cfg.model, cfg.training, lay.tp
    e, b, s = BYTES[tr.precision], tr.micro_batch_size, m.seq_length // cp
    kv_heads = m.heads_kv // t if m.heads_kv % t == 0 else 1  # each rank's k/v heads
    kv = b * kv_heads * s * m.head_dim  # elements of this rank's K (or V)
    if cfg.parallel.cp_comm_type == "a2a":
        q = b * m.num_attention_heads // t * s * m.head_dim
        return (2 * q + 2 * kv) * e, (2 * q + 2 * kv) * e
    return (cp - 1) * 2 * kv * e, (cp - 1) * 2 * kv * e + cp * 2 * kv * max(e, 4)


def comm_bytes(
    cfg: Config, lay: Layout, pp_rank: int, microbatches: int, dp_rank=0, bs=None
) -> dict:
    """Bytes per step this rank's ledger records, per group kind (docs/planner.md). With
    context parallelism activations are s/cp tokens of each sequence, attention sends its
    bytes over cp, and gradients are reduced over the dp*cp replicas (ledger kind "cp+dp",
    or "cp" at dp=1)."""
    cp, whole = lay.sizes.get("cp", 1), cfg
    if cp > 1:  # every activation is this rank's s/cp tokens
        m = dataclasses.replace(cfg.model, seq_length=cfg.model.seq_length // cp)
        cfg = dataclasses.replace(cfg, model=m)
    m, tr = cfg.model, cfg.training
    t, d, pp = lay.tp, replicas(lay), lay.pp
    e, b, s, h = BYTES[tr.precision], tr.micro_batch_size, m.seq_length, m.hidden_size
    low = tr.precision in ("bf16", "fp16")
    g_size = 4 if low else e
    sp = lay.sequence_parallel and t > 1
    act = b * s * h * e
    kws = rank_chunks(m.num_layers, pp, lay.vpp, pp_rank)
    out = {}

    # TP, per micro-batch: each of the 2 blocks of a layer has 2 all-reduces (forward of the
    # row-parallel exit, backward of the column-parallel entry) or, with SP, 2 all-gathers and 2
    # reduce-scatters: 8 (t-1)/t b s h elements either way; full recompute repeats the forward.
    if sp:
        per_layer = 8 * _ring("gather", t, act)
        embed = head = 2 * _ring("gather", t, act)
    else:
        per_layer = 4 * _ring("all_reduce", t, act)
        embed = head = _ring("all_reduce", t, act)
    if tr.recompute == "full":
        per_layer += per_layer // 2
    ce = _ring("all_reduce", t, b * s * 4) + _ring("all_reduce", t, 2 * b * s * 4)  # max; 2 sums
    tp_bytes = 0
    moe = _moe_comm(cfg, lay)
    for kw in kws:
        for i in kw["layers"]:
            if m.is_moe_layer(i):
                for kind, n in moe.items():
                    out[kind] = out.get(kind, 0) + n * microbatches
            else:
                tp_bytes += per_layer
        tp_bytes += embed if kw["has_embedding"] else 0
        tp_bytes += head + ce if kw["has_head"] else 0
    tp_bytes *= microbatches
    tp_bytes += out.pop("tp", 0)
    bs = bs or buckets(cfg, lay, pp_rank)
    sync, tied = 0, 0
    for start, end, ranges in bs:
        shard = (end - start) // d
        lo, hi = (
            (start, end)
            if lay.zero == 0
            else (start + dp_rank * shard, start + (dp_rank + 1) * shard)
        )
        for _, off, n, summed in ranges:
            overlap = max(0, min(off + n, hi) - max(off, lo))
            sync += overlap if "tp" in summed else 0
            tied += overlap if "embed" in summed else 0
    tp_bytes += _ring("all_reduce", t, sync * g_size) if sync else 0
    out["tp"] = tp_bytes

    # PP: every send of the schedule carries one hidden tensor (a logging step adds one
    # all-reduce of m+2 float64: the losses and the first stage's timing).
    schedule = _schedule_name(cfg, lay)
    actions = _schedule(schedule, pp, lay.vpp, microbatches, pp_rank)
    sends = sum(kind in (SEND_F, SEND_B) for kind, _ in actions)
    out["pp"] = sends * (act // (t if sp else 1))

    # DP, per bucket: all-reduce (ZeRO 0); reduce-scatter + all-gather of the parameters
    # (ZeRO 1); a reduce-scatter per micro-batch + all-gather (ZeRO 2); a reduce-scatter per
    # micro-batch, the parameter gathers as the policy makes them, counted apart as dp_gather
    # (ZeRO 3). Plus the loss mean (a logging step's).
    dp_bytes = 0
    for start, end, _ in bs:
        n = end - start
        if lay.zero == 0:
            dp_bytes += _ring("all_reduce", d, n * g_size)
        elif lay.zero == 3:
            dp_bytes += microbatches * _ring("gather", d, n * g_size)
            passes = GATHERS[reshard_policy(cfg, lay)](microbatches)
            out["dp_gather"] = out.get("dp_gather", 0) + passes * _ring("gather", d, n * e)
        else:
            passes = microbatches if lay.zero == 2 else 1
            dp_bytes += passes * _ring("gather", d, n * g_size) + _ring("gather", d, n * e)
    out["dp"] = dp_bytes + _ring("all_reduce", d, 8)
    if cp > 1:  # the replicas' ledger kind; attention's own bytes over cp
        kind = "cp+dp" if lay.dp > 1 else "cp"
        out[kind] = out.pop("dp")
        layers = sum(len(kw["layers"]) for kw in kws)
        passes = 2 if tr.recompute == "full" else 1  # a recomputed forward sends again
        fwd, bwd = cp_layer_bytes(whole, lay)
        out["cp"] = out.get("cp", 0) + layers * microbatches * (passes * fwd + bwd)
    out["embed"] = _ring("all_reduce", 2, tied * g_size) if tied else 0
    # the step's status: the gradient norm, the inf flag and the preemption flag
    out["world"] = _ring("all_reduce", t * pp * d, 24)
    if m.num_experts:  # the expert buffer over edp, as the dense one over dp
        edp = expert_parallel(cfg, lay)[1]
        for start, end, _ in buckets(cfg, lay, pp_rank, experts=True):
            n = end - start
            if lay.zero == 0:
                out["edp"] = out.get("edp", 0) + _ring("all_reduce", edp, n * g_size)
            else:
                passes = microbatches if lay.zero == 2 else 1
                out["edp"] = out.get("edp", 0) + passes * _ring("gather", edp, n * g_size)
                out["edp"] += _ring("gather", edp, n * e)
        if m.moe_router_enable_expert_bias:  # the step's loads: (layers, E) float64
            out["world"] += _ring("all_reduce", t * pp * d, m.num_layers * m.num_experts * 8)
    return {k: v for k, v in out.items() if v}


def _moe_comm(cfg: Config, lay: Layout) -> dict:
    """Bytes one MoE layer records per micro-batch, forward and backward, per group kind.
    TP: attention as in a dense layer, the shared expert as an MLP, and without sequence
    parallelism the routed tokens' split along the sequence (an all-gather of the output
    forward, of the input's gradient backward), plus the load all-reduce (--moe-aux-loss-coeff)
    and the capacity all-gather. ep: dispatch and combine forward, their reverses backward,
    each T k h bytes with T = b s / tp tokens routed by a rank and as many assignments coming
    back as going out (balanced routing; at most capacity_factor of them with drops); the
    split sizes (E int64) all-gathered over ep forward. Full recompute repeats the forward."""
    m, tr = cfg.model, cfg.training
    t, e, b, s, h = lay.tp, BYTES[tr.precision], tr.micro_batch_size, m.seq_length, m.hidden_size
    sp = lay.sequence_parallel and t > 1
    act = b * s * h * e
    fwd_block = 2 * _ring("gather", t, act) if sp else _ring("all_reduce", t, act)  # per block
    shared = 1 if m.moe_shared_expert_intermediate_size else 0
    routed = 0 if sp else _ring("gather", t, act)  # forward; the same again backward
    small = _ring("all_reduce", t, m.num_experts * 4) if m.moe_aux_loss_coeff else 0
    if m.moe_expert_capacity_factor is not None:
        small += _ring("gather", t, t * m.moe_router_topk * m.num_experts * 8)
    fwd = fwd_block * (1 + shared) + routed
    passes = 2 if tr.recompute == "full" else 1  # forwards per micro-batch
    out = {"tp": 2 * fwd + small + (passes - 1) * (fwd + small)}
    ep = expert_parallel(cfg, lay)[0]
    if ep > 1:
        kept = min(1.0, m.moe_expert_capacity_factor or 1.0)
        a2a = int(b * s // t * m.moe_router_topk * kept * h * e)
        out["ep"] = (2 * passes + 2) * a2a
        out["ep_sizes"] = passes * _ring("gather", ep, ep * m.num_experts * 8)
    return out


# ---- plans and the search ------------------------------------------------------------------------


def microbatches_of(cfg: Config, lay: Layout) -> int:
    t = cfg.training
    return t.global_batch_size // (t.micro_batch_size * lay.dp)


def plan(cfg: Config, lay: Layout, cluster: Cluster | None = None, all_stages=True) -> Plan:
    """Memory per pipeline rank, traffic and bubble of one layout."""
    if cfg.model.num_experts and "ep" not in lay.sizes:  # name the expert layout it plans
        lay = Layout(lay.vpp, lay.zero, lay.sequence_parallel, **lay.sizes, ep=cfg.parallel.ep)
    mb = microbatches_of(cfg, lay)
    stages = []
    # Middle stages hold no embedding or head and fewer micro-batches in flight than the
    # first: the search looks at the first and the last stage only.
    ranks = range(lay.pp) if all_stages else sorted({0, lay.pp - 1})
    comms = []
    for r in ranks:
        bs = buckets(cfg, lay, r)
        comms.append(comm_bytes(cfg, lay, r, mb, bs=bs))
        mem = state_memory(cfg, lay, r, bs)
        mem["activations"] = peak_activations(cfg, lay, r, mb)
        mem["total"] = sum(mem[k] for k in ("params", "grads", "optimizer", "activations"))
        mem["total"] += mem["staged_grads"] + mem["gathered_params"]
        stages.append(mem)
    worst = max(range(len(stages)), key=lambda i: stages[i]["total"])
    kinds = ("tp", "pp", "dp", "dp_gather", "cp", "cp+dp", "embed", "world", "ep", "ep_sizes",
             "edp")  # fmt: skip
    comm = {k: max(c.get(k, 0) for c in comms) for k in kinds}
    bubble = bubble_theory(lay.pp, lay.vpp, mb, _schedule_name(cfg, lay))
    p = Plan(lay, stages[worst], stages, {k: v for k, v in comm.items() if v}, bubble, mb)
    if lay.zero == 3:
        p.notes += zero3_notes(cfg, lay, ranks[worst], mb)
    if cluster is not None:
        p.fits = p.memory["total"] <= cluster.usable * cluster.gpu_memory_gib * GiB
    return p
