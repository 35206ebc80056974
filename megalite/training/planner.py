"""Memory and traffic of a layout, computed without a process group or a GPU; a ranked search.

Everything here mirrors what megalite allocates and sends (docs/planner.md gives the formulas
and their sources):

- parameters, gradients and optimizer state: the real model's parameters (built on the `meta`
  device), cut into buckets by the gradient buffer's own `bucket_layout`, then the bytes the
  ZeRO stage allocates for this rank's shards (optim/zero.py; fp32 or bf16/fp16); at ZeRO-3
  also the units gathered at once under the run's reshard policy (`zero3_units`);
- activations: what one micro-batch of each chunk keeps for backward (Korthikanti et al. 2022,
  counted for megalite's flash attention and its sequence parallelism), times the chunks in
  flight at the schedule's worst moment (walked from `schedules.compute_order`);
- bytes per step per group kind, as the `CommLedger` counts them.
"""

import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache

from megalite.config import Config, ModelConfig
from megalite.optim.zero import ZERO
from megalite.parallel.data_parallel import ALIGN, MAX_IN_FLIGHT, bucket_layout
from megalite.parallel.zero3 import unit_layout, unit_of
from megalite.pipeline.partition import rank_chunks
from megalite.pipeline.schedules import (
    SEND_B,
    SEND_F,
    B,
    F,
    bubble_theory,
    check_shape,
    default_schedule,
    get_schedule,
)

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
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
    bubble: float  # Megatron's (pp-1)/(vpp*m)
    microbatches: int
    fits: bool = True
    step_time: float | None = None  # estimated seconds per step (layouts.step_time)
    notes: list = field(default_factory=list)


# ---- parameters: built by the real model, on the meta device ------------------------------------


@lru_cache(maxsize=256)
def _template(m_fields: tuple, tp: int, sp: bool, has_embedding: bool, has_head: bool,
              layers: tuple = (0,), ep: int = 1):  # fmt: skip
    """[(name, numel, spec)] of a GPTChunk with the given layers (one of each kind: dense, MoE),
    built on `meta`: the real model's parameters without allocating them. Layers of a kind
    differ only in their index."""
    import torch

    from megalite.model.gpt import GPTChunk
    from megalite.parallel.comm import Group
    from megalite.parallel.specs import spec_of

    m = ModelConfig(*m_fields)
    group = Group("tp", list(range(tp)), tp - 1)  # building a chunk needs no process group
    ep_group = Group("ep", list(range(ep)), ep - 1)
    chunk = GPTChunk(m, group, layers=list(layers), has_embedding=has_embedding,
                     has_head=has_head, sequence_parallel=sp, device=torch.device("meta"),
                     ep=ep_group)  # fmt: skip
    return tuple((n, p.numel(), spec_of(p)) for n, p in chunk.named_parameters())


def chunk_specs(m: ModelConfig, tp: int, layers, has_embedding, has_head, sp=False, ep=1):
    """[(logical name, numel on this TP rank, ParamSpec)] in `named_parameters()` order."""
    fields = dataclasses.astuple(m)
    kinds = {}  # MoE or dense -> the first layer index of that kind (its template)
    for i in layers:
        kinds.setdefault(m.is_moe_layer(i), i)
    reps = tuple(sorted(kinds.values())) or (0,)
    template = _template(fields, tp, sp and tp > 1, has_embedding, has_head, reps, ep)
    before = [x for x in template if not x[0].startswith(("layers.", "final_norm", "output"))]
    after = [x for x in template if x[0].startswith(("final_norm", "output"))]
    out = list(before)
    for i in layers:
        rep = f"layers.{kinds[m.is_moe_layer(i)]}."
        out += [(f"layers.{i}." + n.removeprefix(rep), k, s) for n, k, s in template
                if n.startswith(rep)]  # fmt: skip
    return out + after


def replicas(lay: Layout) -> int:
    """Ranks holding the same parameters (gradients reduced, ZeRO sharded over them): dp*cp."""
    return lay.dp * lay.sizes.get("cp", 1)


def expert_parallel(cfg: Config, lay: Layout) -> tuple[int, int]:
    """(ep, edp) of a layout: ep from the layout if it names one, else from the config;
    edp = tp*dp*cp/ep, the ranks holding the same experts."""
    ep = lay.sizes.get("ep") or cfg.parallel.ep
    return ep, max(1, lay.tp * replicas(lay) // ep)


def chunk_params(m: ModelConfig, tp: int, layers, has_embedding, has_head, sp=False):
    """[(logical name, numel on this TP rank, gradient summed over TP)] in registration order."""
    specs = chunk_specs(m, tp, layers, has_embedding, has_head, sp)
    return [(n, k, "tp" in s.grad_sum) for n, k, s in specs]


def buckets(cfg: Config, lay: Layout, pp_rank: int, experts: bool = False):
    """The GradBuffer's buckets on this pipeline rank (data_parallel.bucket_layout):
    [(start, end, [(name, offset, numel, groups its gradient is summed over)])]. `experts`:
    those of the expert parameters instead (their own buffer, sharded over edp)."""
    m, o = cfg.model, cfg.optimizer
    prec = cfg.training.precision
    g_size = 4 if prec in ("bf16", "fp16") else BYTES[prec]  # gradients: fp32 when low
    bucket_numel = max(1, int(o.bucket_size_mb * 2**20 / g_size))
    ep, edp = expert_parallel(cfg, lay)
    sync = {}
    chunks = []
    for kw in rank_chunks(m.num_layers, lay.pp, lay.vpp, pp_rank):
        specs = chunk_specs(m, lay.tp, **kw, sp=lay.sequence_parallel, ep=ep)
        specs = [x for x in specs if x[2].expert == experts]
        chunks.append([(n, k, "embed" in s.grad_sum) for n, k, s in specs])
        sync.update({n: s.grad_sum for n, _, s in specs})
    if lay.zero == 3 and not experts:  # one bucket per unit (a layer), as Zero3Buffer
        layout = unit_layout(chunks, replicas(lay) * ALIGN)
    else:
        layout = bucket_layout(chunks, bucket_numel, (edp if experts else replicas(lay)) * ALIGN)
    return [(s, e, [(n, o, k, sync[n]) for n, o, k in ranges]) for s, e, ranges in layout]


def state_memory(cfg: Config, lay: Layout, pp_rank: int, bs=None) -> dict:
    """Bytes this rank allocates for parameters, gradients and optimizer state."""
    prec = cfg.training.precision
    low = prec in ("bf16", "fp16")
    p_size, g_size = BYTES[prec], 4 if low else BYTES[prec]
    bs = bs or buckets(cfg, lay, pp_rank)
    numel = bs[-1][1] if bs else 0
    zero = ZERO[lay.zero]
    out = zero.state_bytes(numel, replicas(lay), p_size, g_size)
    staged = 0
    if zero.reduce_each_microbatch:  # transient: buckets staged for their reduce-scatter
        largest = sorted((e - s for s, e, _ in bs), reverse=True)[: MAX_IN_FLIGHT + 1]
        staged = sum(largest) * g_size
    expert_numel = 0
    if cfg.model.num_experts:  # the expert buffer: its own buckets, sharded over edp
        es = buckets(cfg, lay, pp_rank, experts=True)
        expert_numel = es[-1][1] if es else 0
        ex = zero.state_bytes(expert_numel, expert_parallel(cfg, lay)[1], p_size, g_size)
        out = {k: out[k] + ex[k] for k in out}
        if zero.reduce_each_microbatch:  # the expert buffer stages its own buckets too
            largest = sorted((e - s for s, e, _ in es), reverse=True)[: MAX_IN_FLIGHT + 1]
            staged += sum(largest) * g_size
    gathered = 0
    if zero.shard_params:  # whole units alive at once, on top of the shards
        gathered = zero3_units(cfg, lay, pp_rank)[reshard_policy(cfg, lay)][0]
    return {**out, "staged_grads": staged, "gathered_params": gathered,
            "numel": numel + expert_numel, "expert_numel": expert_numel}  # fmt: skip


# ---- ZeRO-3: units gathered, and how often -------------------------------------------------------

# Gathers of each unit per step under each policy (parallel/zero3.py), with m micro-batches:
# "forward" before its forward and again before its backward, "backward" (--zero3-keep-params)
# once per micro-batch, "step" (the default under pp) once per step.
GATHERS = {"forward": lambda m: 2 * m, "backward": lambda m: m, "step": lambda m: 1}


def reshard_policy(cfg: Config, lay: Layout) -> str:
    """The policy Zero3Buffer runs (distributed_optimizer._buffers picks it the same way)."""
    if lay.pp > 1:
        return "step"
    return "backward" if cfg.optimizer.zero3_keep_params else "forward"


def zero3_units(cfg: Config, lay: Layout, pp_rank: int) -> dict:
    """{policy: (most parameter bytes gathered at once, [padded numel of each bucket])} on
    this pipeline rank. "forward": a chunk's outer unit (embedding, head) and two layers (the
    one computing and the one prefetched); "backward": a whole chunk (each layer kept from its
    forward to its backward); "step": every chunk of the rank."""
    e = BYTES[cfg.training.precision]
    per_chunk, sizes = [], []
    for kw in rank_chunks(cfg.model.num_layers, lay.pp, lay.vpp, pp_rank):
        specs = chunk_specs(cfg.model, lay.tp, **kw, sp=lay.sequence_parallel)
        params = [(n, k, "embed" in s.grad_sum) for n, k, s in specs]
        units = {}
        for start, end, ranges in unit_layout([params], replicas(lay) * ALIGN):
            units[unit_of(ranges[0][0])] = units.get(unit_of(ranges[0][0]), 0) + end - start
            sizes.append(end - start)
        layers = sorted((n for u, n in units.items() if u), reverse=True)
        per_chunk.append((units.get("", 0), layers))
    forward = max((outer + sum(layers[:2]) for outer, layers in per_chunk), default=0)
    chunk = max((outer + sum(layers) for outer, layers in per_chunk), default=0)
    total = sum(outer + sum(layers) for outer, layers in per_chunk)
    return {"forward": (forward * e, sizes), "backward": (chunk * e, sizes),
            "step": (total * e, sizes)}  # fmt: skip


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


# ---- activations -------------------------------------------------------------------------------


def layer_activations(
    m: ModelConfig,
    b: int,
    t: int,
    sp: bool,
    recompute: str,
    e: int,
    torch_ops=False,
    moe=False,
) -> float:
    """Bytes one layer keeps for backward per micro-batch (Korthikanti et al. 2022, section 4,
    counted for megalite): flash attention keeps q, k, v, the output and the log-sum-exp instead
    of the s x s scores (no 5as/h term), norms keep their input, the column-parallel layers of a
    block share one (all-gathered, with SP) input and keep their concatenated weights. `torch_ops`:
    the plain torch references (CPU) instead of the Triton kernels: norms keep an fp32 input
    (RMSNorm also its normalised output) and SwiGLU also keeps silu(gate). `moe`: the layer
    holds experts (moe_activations) instead of the MLP."""
    s, h, f, a = m.seq_length, m.hidden_size, m.ffn, m.num_attention_heads
    llama = m.flavour == "llama"
    rows = s * b / (t if sp else 1)  # tokens of a sequence-sharded tensor on this rank
    kv = m.heads_kv * m.head_dim // t if m.heads_kv % t == 0 else m.heads_kv * m.head_dim
    if recompute == "full":  # only the layer's input
        return rows * h * e
    norm_e = max(e, 4) if torch_ops else e
    norm = rows * h * norm_e + rows * 4 * (1 if llama else 2)  # input; rstd (and mean), fp32
    if torch_ops and llama:
        norm += rows * h * norm_e  # rms_norm_ref keeps x * rstd too
    # Inputs of q/k/v and of the MLP's first linear(s): one (b, s, h) tensor for the attention
    # block and one for the MLP, shared by the layers that read it (all-gathered with SP).
    linear_in = s * b * h * e * 2
    attention = s * b * (2 * h / t + 2 * kv) * e  # q, output; k, v
    # fused_column_linear keeps the concatenated q/k/v (and gate/up) weights (and biases)
    fused = (h / t + 2 * kv) * (h + (0 if llama else 1)) * e + (2 * f / t * h * e if llama else 0)
    lse = 0 if recompute == "selective" else a / t * s * b * 4
    mlp = s * b * f / t * e * ((4 if torch_ops else 3) if llama else 2)  # (gate,) up, act out
    if moe:  # no dense MLP: the routed experts, and the shared expert's MLP if any
        fs = m.moe_shared_expert_intermediate_size or 0
        linear_in -= 0 if fs else s * b * h * e
        fused -= (2 * f / t * h * e if llama else 0) - (2 * fs / t * h * e if llama else 0)
        mlp = mlp * fs / f + moe_activations(m, b, t, e, torch_ops)
    masks = 2 * rows * h if m.hidden_dropout > 0 else 0  # bool dropout masks
    scores = 0
    if m.attention_dropout > 0 and recompute != "selective":  # the math path keeps s x s
        scores = a / t * s * s * b * (2 * e + 1)
    return 2 * norm + linear_in + attention + fused + lse + mlp + masks + scores


def moe_activations(m: ModelConfig, b: int, t: int, e: int, torch_ops=False) -> float:
    """Bytes the routed part of an MoE layer keeps for backward per micro-batch, with T = s b / t
    tokens routed by this rank and n = T k assignments (as many come back, balanced): the
    router's input (and its fp32 copy in bf16/fp16), fp32 logits and probabilities (T, E), per
    assignment the first grouped GEMM's input, the activation's inputs (SwiGLU: gate and up,
    plus silu(gate) on the torch path; GELU: its input), the second GEMM's input and the
    combined output that is weighted, plus its weight and four int64 permutations."""
    h, k, f, n_exp = m.hidden_size, m.moe_router_topk, m.moe_ffn, m.num_experts
    tokens = m.seq_length * b / t
    n = tokens * k
    act = (3 if torch_ops else 2) if m.flavour == "llama" else 1
    router = tokens * h * e + (tokens * h * 4 if e < 4 else 0) + tokens * n_exp * 4 * 2
    return router + n * (2 * h + f * (act + 1)) * e + n * (4 + 4 * 8)


def chunk_activations(cfg: Config, lay: Layout, kw: dict) -> tuple[float, float]:
    """(bytes kept per micro-batch, transient bytes of one recomputed layer) of a chunk. With
    context parallelism a rank holds s/cp tokens of each sequence and ring attention keeps only
    this rank's q, k, v, output and log-sum-exp: the same counts at seq_length/cp."""
    m, t = cfg.model, cfg.training
    cp = lay.sizes.get("cp", 1)
    if cp > 1:
        m = dataclasses.replace(m, seq_length=m.seq_length // cp)
    e, b, s, h, tp = BYTES[t.precision], t.micro_batch_size, m.seq_length, m.hidden_size, lay.tp
    torch_ops = t.kernels == "torch"  # "auto" plans for GPUs: the Triton kernels
    sp = lay.sequence_parallel and tp > 1
    total = sum(layer_activations(m, b, tp, sp, t.recompute, e, torch_ops, m.is_moe_layer(i))
                for i in kw["layers"])  # fmt: skip
    if kw["has_embedding"]:
        total += b * s * (9 if tp > 1 else 8)  # token ids (int64; a bool mask with TP)
        total += s * 8 if m.flavour == "gpt2" else 0  # position ids
    if kw["has_head"]:
        rows = s * b / (tp if sp else 1)
        norm_e = max(e, 4) if torch_ops else e
        total += rows * h * norm_e + rows * 4 * (1 if m.flavour == "llama" else 2)
        if torch_ops and m.flavour == "llama":
            total += rows * h * norm_e  # rms_norm_ref keeps x * rstd too
        total += s * b * h * e + s * b * 8  # the output layer's input; the labels
        if tp > 1:  # vocab-parallel cross entropy: the logits shard and the fp32 log-sum-exp
            total += s * b * m.padded_vocab_size(tp) // tp * e + s * b * 4
        elif torch_ops:  # fp32 log-softmax over the real vocabulary
            total += s * b * m.vocab_size * max(e, 4) + 4
        else:  # the Triton kernel keeps the logits and the log-sum-exp
            total += s * b * m.padded_vocab_size(1) * e + s * b * 4
    transient = 0.0
    if t.recompute == "full" and kw["layers"]:
        transient = max(layer_activations(m, b, tp, sp, "none", e, torch_ops, m.is_moe_layer(i))
                        for i in kw["layers"])  # fmt: skip
    return total, transient


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
    (p2p): cp-1 hops of this rank's K and V forward; backward cp-1 hops of K, V, dK, dV and one
    of dK, dV home, in the attention's output precision (fp32, fp64 for fp64). All-to-all:
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
    return (cp - 1) * 2 * kv * e, ((cp - 1) * 4 * kv + 2 * kv) * max(e, 4)


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
