"""Bytes a rank keeps for backward, computed without a process group or a GPU: what one
micro-batch of each chunk keeps (Korthikanti et al. 2022, counted for megalite's flash attention
and its sequence parallelism; docs/planner.md), times the chunks in flight at the schedule's
worst moment, walked from the schedule itself (with the p2p tensors of buffers.py)."""

import dataclasses
import math
from functools import lru_cache

from megalite.config import Config, ModelConfig
from megalite.pipeline.actions import B, F, I, W
from megalite.pipeline.schedules import get_schedule
from megalite.plan.buffers import P2PBuffers, backward_working, forward_working
from megalite.plan.memory import BYTES, fp8_layer, fp8_saved, fused_blocks, kv_features
from megalite.shape import RunShape


@lru_cache(maxsize=4096)
def schedule_actions(name: str, pp: int, vpp: int, microbatches: int, rank: int) -> tuple:
    """(kind, chunk) of each action: the search asks for the same schedules many times."""
    return tuple((a.kind, a.chunk) for a in get_schedule(name, pp, vpp, microbatches, rank))


@lru_cache(maxsize=4096)
def schedule_steps(name: str, pp: int, vpp: int, microbatches: int, rank: int) -> tuple:
    """(kind, chunk, micro-batch) of each action."""
    return tuple((a.kind, a.chunk, a.mb) for a in get_schedule(name, pp, vpp, microbatches, rank))


def peak_activations(
    cfg: Config, shape: RunShape, pp_rank: int, microbatches: int, buffers: bool = False
) -> float:
    """Walk this rank's schedule: the most activation bytes alive at once (a chunk's from its
    forward to its backward: B, or W of a split backward, where the weight gradients still need
    them). `buffers`: with what buffers.py adds at the same moment: the pipeline's send and
    receive tensors, a backward's working memory while it runs and a forward's temporaries
    while it runs."""
    return peaks(cfg, shape, pp_rank, microbatches, buffers)[1 if buffers else 0]


def peaks(
    cfg: Config, shape: RunShape, pp_rank: int, microbatches: int, buffers: bool = True
) -> tuple[float, float]:
    """(the activations' peak, the peak with buffers.py's tensors: `peak_activations` without
    and with `buffers`) from one walk of the schedule."""
    kws = shape.partition.rank_chunks(pp_rank)
    per_chunk = [chunk_activations(cfg, shape, kw) for kw in kws]
    steps = schedule_steps(shape.schedule, shape.pp, shape.vpp, microbatches, pp_rank)
    hidden = BYTES[cfg.training.precision] * math.prod(shape.hidden_shape)
    p2p = P2PBuffers(steps, hidden) if buffers else None
    working = [backward_working(cfg, shape, kw) if buffers else 0.0 for kw in kws]
    ahead = [forward_working(cfg, shape, kw) if buffers else 0.0 for kw in kws]
    pending = [pending_weight_grads(cfg, shape, kw) for kw in kws]
    alive = plain = peak = 0.0
    for kind, chunk, mb in steps:
        extra = p2p.step(kind, chunk, mb) if p2p else 0.0
        if kind == F:  # its temporaries, on top of what the chunks keep up to its end
            alive += per_chunk[chunk][0]
            peak = max(peak, alive + extra + ahead[chunk])
        elif kind in (B, I, W):  # a recomputed layer's activations exist while its backward runs
            now = alive + per_chunk[chunk][1]
            plain = max(plain, now)
            peak = max(peak, now + extra + working[chunk])
        if kind in (B, W):
            alive -= per_chunk[chunk][0]
        if kind == I and not kws[chunk]["has_embedding"]:  # the embedding's I defers it all to W
            alive += pending[chunk]
        elif kind == W and not kws[chunk]["has_embedding"]:
            alive -= pending[chunk]
        plain = max(plain, alive)
        peak = max(peak, alive + extra)
    return plain, peak


def attention_core_heads(m: ModelConfig) -> tuple[int, int]:
    """(k/v heads, head dim) of the k and v the attention core is handed (the kernels, context
    parallelism's ring and all-to-all): MLA's heads each have their own k and v, q, k and v
    zero-padded to d = max(dn + dr, dv) (model/mla.py); else the k/v groups at head_dim."""
    if m.features.latent_attention:
        return m.num_attention_heads, max(m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim)
    return m.heads_kv, m.head_dim


def _projection_outputs(m: ModelConfig, tp: int) -> float:
    """Per token, the elements a layer's attention projections (other than out) produce on a
    TP rank: q/k/v (k/v groups whole when tp does not divide them); MLA's q_a and its norm,
    q_b (or q), kv_a, the kv norm and kv_b (model/mla.py)."""
    if m.features.latent_attention:
        heads, dqk = m.num_attention_heads / tp, m.qk_nope_head_dim + m.qk_rope_head_dim
        latents = 2 * (m.q_lora_rank or 0) + m.kv_lora_rank + m.qk_rope_head_dim + m.kv_lora_rank
        return latents + heads * (dqk + m.qk_nope_head_dim + m.v_head_dim)
    return m.num_attention_heads * m.head_dim / tp + 2 * kv_features(m, tp)


def pending_weight_grads(cfg: Config, shape: RunShape, kw: dict) -> float:
    """Bytes a split backward keeps from a micro-batch's I to its W (pipeline/split_backward.py:
    the gradient arriving at each op that holds parameters, which W starts from): per layer the
    outputs of the two norms and of the attention's and the MLP's output projections (h wide),
    of the attention's other projections (q/k/v, or MLA's) and of the MLP's first linear(s)
    (TP-sharded); at the head, the final norm's and the logits', and per MTP module its layer,
    enorm, hnorm, eh_proj and head. An MoE layer is counted as its dense MLP would be."""
    m, t = cfg.model, cfg.training
    if shape.cp > 1:
        m = dataclasses.replace(m, seq_length=m.seq_length // shape.cp)
    e, tp = BYTES[t.precision], shape.tp
    tokens = m.seq_length * t.micro_batch_size
    rows = tokens / (tp if shape.sequence_parallel else 1)
    mlp_in = m.ffn / tp * (2 if m.features.gated_mlp else 1)
    layer = rows * m.hidden_size * 4 + tokens * (_projection_outputs(m, tp) + mlp_in)
    total = len(kw["layers"]) * layer
    if kw["has_head"]:
        head = rows * m.hidden_size + tokens * m.padded_vocab_size(tp) / tp
        total += head + m.mtp_num_layers * (layer + head + 3 * rows * m.hidden_size)
    return total * e


def layer_activations(
    m: ModelConfig,
    b: int,
    t: int,
    sequence_parallel: bool,
    recompute: str,
    e: int,
    torch_ops=False,
    moe=False,
    fp8=False,
) -> float:
    """Bytes one layer keeps for backward per micro-batch (Korthikanti et al. 2022, section 4,
    counted for megalite): flash attention keeps q, k, v, the output and the log-sum-exp instead
    of the s x s scores (no 5as/h term), norms keep their input, the column-parallel layers of a
    block share one (all-gathered, with SP) input, of which fused ones keep this rank's rows
    only (`fused_blocks`; no weight copy) but in FP8 (`fp8`: the whole input and the
    concatenated weights; memory.fp8_saved counts the rest). `torch_ops`:
    the plain torch references (CPU) instead of the Triton kernels: norms keep an fp32 input
    (RMSNorm also its normalised output) and SwiGLU also keeps silu(gate). `moe`: the layer
    holds experts (moe_activations) instead of the MLP."""
    s, h, f, a = m.seq_length, m.hidden_size, m.ffn, m.num_attention_heads
    rms, gated = m.features.rms_norm, m.features.gated_mlp
    # tokens of a sequence-sharded tensor on this rank
    rows = s * b / (t if sequence_parallel else 1)
    kv = kv_features(m, t)
    if recompute == "full":  # only the layer's input
        return rows * h * e
    norm_e = max(e, 4) if torch_ops else e
    norm = rows * h * norm_e + rows * 4 * (1 if rms else 2)  # input; rstd (and mean), fp32
    if torch_ops and rms:
        norm += rows * h * norm_e  # rms_norm_ref keeps x * rstd too
    # Inputs of q/k/v and of the MLP's first linear(s): one (b, s, h) tensor for the attention
    # block and one for the MLP, shared by the layers that read it (all-gathered with SP); the
    # fused blocks keep this rank's rows of theirs (fused_column_linear), but in FP8
    fused = 0 if fp8 else fused_blocks(m, moe)
    blocks = 2 if not moe or m.moe_shared_expert_intermediate_size else 1  # routed: its own
    linear_in = (fused * rows + (blocks - fused) * s * b) * h * e
    attention = s * b * (2 * h / t + 2 * kv) * e  # q, output; k, v
    if m.features.rotary:  # q and k rotated into new tensors; v, a view of the one q/k/v
        attention += s * b * (h / t + kv) * e  # output, keeps that output's q and k parts too
    joined = 0.0  # FP8 runs the fused layers on their concatenated weights, which it keeps
    if fp8:
        up = (m.moe_shared_expert_intermediate_size or 0) if moe else f
        joined = 2 * up / t * h * e if gated else 0
        if not m.features.latent_attention:
            joined += (h / t + 2 * kv) * (h + m.features.qkv_bias) * e
    if m.features.latent_attention:  # MLA (model/mla.py): its latents, q/k/v padded to d
        attention = latent_attention_activations(m, b, t, e, torch_ops)
    lse = 0 if recompute == "selective" else a / t * s * b * 4
    mlp = s * b * f / t * e * ((4 if torch_ops else 3) if gated else 2)  # (gate,) up, act out
    if moe:  # no dense MLP: the routed experts, and the shared expert's MLP if any
        fs = m.moe_shared_expert_intermediate_size or 0
        mlp = mlp * fs / f + moe_activations(m, b, t, e, torch_ops)
    masks = 2 * rows * h if m.hidden_dropout > 0 else 0  # bool dropout masks
    scores = 0
    if m.attention_dropout > 0 and recompute != "selective":  # the math path keeps s x s
        scores = a / t * s * s * b * (2 * e + 1)
    return 2 * norm + linear_in + attention + joined + lse + mlp + masks + scores


def latent_attention_activations(m: ModelConfig, b: int, t: int, e: int, torch_ops=False) -> float:
    """Bytes MLA keeps for backward per micro-batch besides its (b, s, h) input: the low-rank
    q and kv latents (each a norm's input and the next projection's), the padded q, k, v and
    the output the attention core keeps (head dim d = max(dn + dr, dv)), and the out
    projection's input; RMSNorm's fp32 copies on the torch path. Nothing else: the rotary
    keeps only its tables, and q and k before padding (concatenations of the projections'
    outputs with the rotated parts) are the core's own when d = dn + dr, else only padded
    (measured in the fake world: docs/fake_world.md)."""
    s, heads = m.seq_length * b, m.num_attention_heads / t
    dqk, dv = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    d = max(dqk, dv)
    latents = (m.q_lora_rank or 0) + m.kv_lora_rank
    norm_e = (2 * max(e, 4)) if torch_ops else e  # rms_norm_ref keeps x and x * rstd
    per_token = latents * (e + norm_e)  # the latents
    per_token += heads * (4 * d + dv) * e  # the core's q, k, v, output; the out projection's input
    return s * per_token


def moe_activations(m: ModelConfig, b: int, t: int, e: int, torch_ops=False) -> float:
    """Bytes the routed part of an MoE layer keeps for backward per micro-batch, with T = s b / t
    tokens routed by this rank and n = T k assignments (as many come back, balanced): the
    router's fp32 input (in bf16/fp16 a copy: the input itself is not kept), fp32 logits and probabilities (T, E), per
    assignment the first grouped GEMM's input, the activation's inputs (SwiGLU: gate and up,
    plus silu(gate) on the torch path; GELU: its input), the second GEMM's input and the
    combined output that is weighted, plus its weight and four int64 permutations."""
    h, k, f, n_exp = m.hidden_size, m.moe_router_topk, m.moe_ffn, m.num_experts
    tokens = m.seq_length * b / t
    n = tokens * k
    act = (3 if torch_ops else 2) if m.features.gated_mlp else 1
    router = tokens * h * max(e, 4) + tokens * n_exp * 4 * 2
    return router + n * (2 * h + f * (act + 1)) * e + n * (4 + 4 * 8)


def chunk_activations(cfg: Config, shape: RunShape, kw: dict) -> tuple[float, float]:
    """(bytes kept per micro-batch, transient bytes of one recomputed layer) of a chunk. With
    context parallelism a rank holds s/cp tokens of each sequence and ring attention keeps only
    this rank's q, k, v, output and log-sum-exp: the same counts at seq_length/cp."""
    m, t = cfg.model, cfg.training
    cp = shape.cp
    if cp > 1:
        m = dataclasses.replace(m, seq_length=m.seq_length // cp)
    e, b, s, h, tp = BYTES[t.precision], t.micro_batch_size, m.seq_length, m.hidden_size, shape.tp
    torch_ops = t.kernels == "torch"  # "auto" plans for GPUs: the Triton kernels
    sequence_parallel = shape.sequence_parallel
    total = sum(layer_activations(m, b, tp, sequence_parallel, t.recompute, e, torch_ops,
                                  m.is_moe_layer(i), fp8_layer(cfg, m, i))
                for i in kw["layers"])  # fmt: skip
    total += fp8_saved(cfg, m, tp, kw["layers"])  # FP8 linears' copies (plan/memory.py)
    if kw["has_embedding"]:
        total += b * s * (9 if tp > 1 else 8)  # token ids (int64; a bool mask with TP)
        total += s * 8 if m.features.learned_positions else 0  # position ids
    if kw["has_head"]:
        rows = s * b / (tp if sequence_parallel else 1)
        norm_e = max(e, 4) if torch_ops else e
        norm = rows * h * norm_e + rows * 4 * (1 if m.features.rms_norm else 2)
        if torch_ops and m.features.rms_norm:
            norm += rows * h * norm_e  # rms_norm_ref keeps x * rstd too
        head = norm + s * b * h * e + s * b * 8  # the output layer's input; the labels
        if tp > 1:  # vocab-parallel cross entropy: the logits shard and the fp32 log-sum-exp
            head += s * b * m.padded_vocab_size(tp) // tp * e + s * b * 4
        elif torch_ops:  # fp32 log-softmax over the real vocabulary
            head += s * b * m.vocab_size * max(e, 4) + 4
        else:  # the Triton kernel keeps the logits and the log-sum-exp
            head += s * b * m.padded_vocab_size(1) * e + s * b * 4
        total += head
        for k in range(m.mtp_num_layers):  # an MTP module (model/mtp.py): a head of its own,
            # its layer, enorm and hnorm, eh_proj's (b, s, 2h) input, the shifted ids
            L = m.num_layers + k
            layer = layer_activations(m, b, tp, sequence_parallel, t.recompute, e, torch_ops,
                                      m.is_moe_layer(L), fp8_layer(cfg, m, L))  # fmt: skip
            total += head + layer + 2 * norm + rows * 2 * h * e + s * b * 8
    transient = 0.0
    if t.recompute == "full" and kw["layers"]:
        transient = max(layer_activations(m, b, tp, sequence_parallel, "none", e, torch_ops,
                                          m.is_moe_layer(i), fp8_layer(cfg, m, i))
                        for i in kw["layers"])  # fmt: skip
    return total, transient
