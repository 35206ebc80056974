"""Bytes a rank holds, computed without a process group or a GPU: its parameters, gradients and
optimizer state (the real model built on the `meta` device, cut into buckets by the gradient
buffer's own `bucket_layout`, then what the ZeRO stage allocates), the units ZeRO-3 gathers at
once, and what one micro-batch of a chunk keeps for backward. The planner (planner.py) walks
the schedule with these and adds the traffic."""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from typing import TYPE_CHECKING

from megalite.config import Config, ModelConfig
from megalite.optim.zero import ZERO
from megalite.parallel.buckets import ALIGN, bucket_layout
from megalite.parallel.zero3 import unit_layout, unit_of
from megalite.pipeline.partition import rank_chunks

if TYPE_CHECKING:
    from megalite.training.planner import Layout

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

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
    """The GradBuffer's buckets on this pipeline rank (buckets.bucket_layout):
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
    staged = zero.staged_peak([e - s for s, e, _ in bs]) * g_size  # transient, stages 2/3
    expert_numel = 0
    if cfg.model.num_experts:  # the expert buffer: its own buckets, sharded over edp
        es = buckets(cfg, lay, pp_rank, experts=True)
        expert_numel = es[-1][1] if es else 0
        ex = zero.state_bytes(expert_numel, expert_parallel(cfg, lay)[1], p_size, g_size)
        out = {k: out[k] + ex[k] for k in out}
        staged += zero.staged_peak([e - s for s, e, _ in es]) * g_size  # its own buckets too
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
