"""Memory and traffic of a layout, computed without a process group or a GPU; a ranked search.

Everything here mirrors what megalite allocates and sends (docs/planner.md gives the formulas
and their sources):

- parameters, gradients and optimizer state: the real model's parameters (built on the `meta`
  device), cut into buckets by the gradient buffer's own `bucket_layout`, then the bytes the
  ZeRO stage allocates for this rank's shards (optim/zero.py; fp32 or bf16/fp16);
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
        extra = "".join(f" {a}={n}" for a, n in self.sizes.items() if a not in ("tp", "pp", "dp"))
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
def _template(m_fields: tuple, tp: int, sp: bool, has_embedding: bool, has_head: bool):
    """[(name, numel, spec)] of a GPTChunk with one layer (index 0), built on `meta`: the real
    model's parameters without allocating them. Layers differ only in their index."""
    import torch

    from megalite.model.gpt import GPTChunk
    from megalite.parallel.comm import Group
    from megalite.parallel.specs import spec_of

    m = ModelConfig(*m_fields)
    group = Group("tp", list(range(tp)), tp - 1)  # building a chunk needs no process group
    chunk = GPTChunk(m, group, layers=[0], has_embedding=has_embedding, has_head=has_head,
                     sequence_parallel=sp, device=torch.device("meta"))  # fmt: skip
    return tuple((n, p.numel(), spec_of(p)) for n, p in chunk.named_parameters())


def chunk_specs(m: ModelConfig, tp: int, layers, has_embedding, has_head, sp=False):
    """[(logical name, numel on this TP rank, ParamSpec)] in `named_parameters()` order."""
    fields = dataclasses.astuple(m)
    template = _template(fields, tp, sp and tp > 1, has_embedding, has_head)
    before = [x for x in template if not x[0].startswith(("layers.", "final_norm", "output"))]
    layer = [x for x in template if x[0].startswith("layers.0.")]
    after = [x for x in template if x[0].startswith(("final_norm", "output"))]
    out = list(before)
    for i in layers:
        out += [(f"layers.{i}." + n.removeprefix("layers.0."), k, s) for n, k, s in layer]
    return out + after


def chunk_params(m: ModelConfig, tp: int, layers, has_embedding, has_head, sp=False):
    """[(logical name, numel on this TP rank, gradient summed over TP)] in registration order."""
    specs = chunk_specs(m, tp, layers, has_embedding, has_head, sp)
    return [(n, k, "tp" in s.grad_sum) for n, k, s in specs]


def buckets(cfg: Config, lay: Layout, pp_rank: int):
    """The GradBuffer's buckets on this pipeline rank (data_parallel.bucket_layout):
    [(start, end, [(name, offset, numel, groups its gradient is summed over)])]."""
    m, o = cfg.model, cfg.optimizer
    prec = cfg.training.precision
    g_size = 4 if prec in ("bf16", "fp16") else BYTES[prec]  # gradients: fp32 when low
    bucket_numel = max(1, int(o.bucket_size_mb * 2**20 / g_size))
    sync = {}
    chunks = []
    for kw in rank_chunks(m.num_layers, lay.pp, lay.vpp, pp_rank):
        specs = chunk_specs(m, lay.tp, **kw, sp=lay.sequence_parallel)
        chunks.append([(n, k, "embed" in s.grad_sum) for n, k, s in specs])
        sync.update({n: s.grad_sum for n, _, s in specs})
    layout = bucket_layout(chunks, bucket_numel, lay.dp * ALIGN)
    return [(s, e, [(n, o, k, sync[n]) for n, o, k in ranges]) for s, e, ranges in layout]


def state_memory(cfg: Config, lay: Layout, pp_rank: int, bs=None) -> dict:
    """Bytes this rank allocates for parameters, gradients and optimizer state."""
    prec = cfg.training.precision
    low = prec in ("bf16", "fp16")
    p_size, g_size = BYTES[prec], 4 if low else BYTES[prec]
    bs = bs or buckets(cfg, lay, pp_rank)
    numel = bs[-1][1] if bs else 0
    zero = ZERO[lay.zero]
    out = zero.state_bytes(numel, lay.dp, p_size, g_size)
    staged = 0
    if zero.reduce_each_microbatch:  # transient: buckets staged for their reduce-scatter
        largest = sorted((e - s for s, e, _ in bs), reverse=True)[: MAX_IN_FLIGHT + 1]
        staged = sum(largest) * g_size
    return {**out, "staged_grads": staged, "numel": numel}


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
    m: ModelConfig, b: int, t: int, sp: bool, recompute: str, e: int, torch_ops=False
) -> float:
    """Bytes one layer keeps for backward per micro-batch (Korthikanti et al. 2022, section 4,
    counted for megalite): flash attention keeps q, k, v, the output and the log-sum-exp instead
    of the s x s scores (no 5as/h term), norms keep their input, the column-parallel layers of a
    block share one (all-gathered, with SP) input and keep their concatenated weights. `torch_ops`:
    the plain torch references (CPU) instead of the Triton kernels: norms keep an fp32 input
    (RMSNorm also its normalised output) and SwiGLU also keeps silu(gate)."""
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
    masks = 2 * rows * h if m.hidden_dropout > 0 else 0  # bool dropout masks
    scores = 0
    if m.attention_dropout > 0 and recompute != "selective":  # the math path keeps s x s
        scores = a / t * s * s * b * (2 * e + 1)
    return 2 * norm + linear_in + attention + fused + lse + mlp + masks + scores


def chunk_activations(cfg: Config, lay: Layout, kw: dict) -> tuple[float, float]:
    """(bytes kept per micro-batch, transient bytes of one recomputed layer) of a chunk."""
    m, t = cfg.model, cfg.training
    e, b, s, h, tp = BYTES[t.precision], t.micro_batch_size, m.seq_length, m.hidden_size, lay.tp
    torch_ops = t.kernels == "torch"  # "auto" plans for GPUs: the Triton kernels
    sp = lay.sequence_parallel and tp > 1
    per_layer = layer_activations(m, b, tp, sp, t.recompute, e, torch_ops)
    total = len(kw["layers"]) * per_layer
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
        transient = layer_activations(m, b, tp, sp, "none", e, torch_ops)
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


def comm_bytes(
    cfg: Config, lay: Layout, pp_rank: int, microbatches: int, dp_rank=0, bs=None
) -> dict:
    """Bytes per step this rank's ledger records, per group kind (docs/planner.md)."""
    m, tr = cfg.model, cfg.training
    t, d, pp = lay.tp, lay.dp, lay.pp
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
    for kw in kws:
        tp_bytes += len(kw["layers"]) * per_layer
        tp_bytes += embed if kw["has_embedding"] else 0
        tp_bytes += head + ce if kw["has_head"] else 0
    tp_bytes *= microbatches
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
    # (ZeRO 1); a reduce-scatter per micro-batch + all-gather (ZeRO 2). Plus the loss mean (a
    # logging step's).
    dp_bytes = 0
    for start, end, _ in bs:
        n = end - start
        if lay.zero == 0:
            dp_bytes += _ring("all_reduce", d, n * g_size)
        else:
            passes = microbatches if lay.zero == 2 else 1
            dp_bytes += passes * _ring("gather", d, n * g_size) + _ring("gather", d, n * e)
    out["dp"] = dp_bytes + _ring("all_reduce", d, 8)
    out["embed"] = _ring("all_reduce", 2, tied * g_size) if tied else 0
    # the step's status: the gradient norm, the inf flag and the preemption flag
    out["world"] = _ring("all_reduce", t * pp * d, 24)
    return {k: v for k, v in out.items() if v}


# ---- plans and the search ------------------------------------------------------------------------


def microbatches_of(cfg: Config, lay: Layout) -> int:
    t = cfg.training
    return t.global_batch_size // (t.micro_batch_size * lay.dp)


def plan(cfg: Config, lay: Layout, cluster: Cluster | None = None, all_stages=True) -> Plan:
    """Memory per pipeline rank, traffic and bubble of one layout."""
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
        mem["total"] += mem["staged_grads"]
        stages.append(mem)
    worst = max(range(len(stages)), key=lambda i: stages[i]["total"])
    comm = {k: max(c.get(k, 0) for c in comms) for k in ("tp", "pp", "dp", "embed", "world")}
    bubble = bubble_theory(lay.pp, lay.vpp, mb, _schedule_name(cfg, lay))
    p = Plan(lay, stages[worst], stages, {k: v for k, v in comm.items() if v}, bubble, mb)
    if cluster is not None:
        p.fits = p.memory["total"] <= cluster.usable * cluster.gpu_memory_gib * GiB
    return p
