"""Compute time by shape: what one micro-batch's forward and backward cost a rank, op by op,
on a per-GPU model (docs/planner.md, "Compute by shape"), instead of a flat MFU.

- GEMMs (the q/k/v, out, MLP and output-layer matmuls; an MoE layer's router, its experts as
  grouped GEMMs of the tokens each local expert receives, its shared expert): each one's forward
  and its two backward GEMMs (input gradient, weight gradient) at
  `flops / (peak * MAMF * waves * depth)`, or the time its bytes take at the memory bandwidth if
  longer, plus a kernel's fixed cost. MAMF: the best large-GEMM throughput measured against the
  dense peak (GPU.mamf); `waves`: the share of the last wave of output tiles that is busy (a
  128x256 tile per SM per wave, cuBLAS's largest Hopper tile); `depth`: k / (k + K_OVERHEAD),
  the prologue and epilogue a tile pays whatever its k.
- attention's core (flash attention): the causal half of the s x s square it computes (a cp
  rank's share of it), at ATTENTION of the peak forward, ATTENTION_BACKWARD backward, scaled by
  s_kv / (s_kv + ATTENTION_HALF) (short key blocks cannot fill the pipeline);
- memory-bound ops (norms, residual adds, RoPE, the activation, the loss's pass over the logits;
  the optimizer step once per step) at MEMORY_EFFICIENCY of the HBM bandwidth.

`SUSTAINED` scales the peak to the clocks a GPU keeps under a training load (MAMF is measured in
bursts); it and the attention efficiencies are the calibrated constants (docs/planner.md gives
the calibration rows and the held-out ones).
"""

import math
from dataclasses import dataclass

from megalite.config import Config
from megalite.plan.memory import kv_features


@dataclass(frozen=True)
class GPU:
    name: str
    peak_tflops: float  # dense bf16/fp16 tensor-core peak (data sheets)
    hbm_tbps: float  # memory bandwidth, TB/s (data sheets)
    sms: int  # streaming multiprocessors
    mamf: float  # best measured large-GEMM bf16 throughput / peak (ml-engineering's MAMF table)


# NVIDIA data sheets (peak, bandwidth, SMs); MAMF: stas00/ml-engineering, compute/accelerator
# README, "Maximum Achievable Matmul FLOPS comparison table" (bf16, no sparsity): A100 SXM 267.9
# of 312 (85.9%), H100 SXM 792.1 of 989 (80.1%), H100/H200 SXM 794.5 (80.3%), B200 SXM 1745 of
# 2250 (77.6%).
GPUS = {
    "a100": GPU("A100 SXM", 312.0, 2.039, 108, 0.859),
    "h100": GPU("H100 SXM", 989.0, 3.35, 132, 0.801),
    "h200": GPU("H200 SXM", 989.0, 4.8, 132, 0.803),
    "b200": GPU("B200 SXM", 2250.0, 7.7, 148, 0.776),
}
TILE = (128, 256)  # output rows x columns one SM computes per wave
K_OVERHEAD = 256  # a tile's prologue and epilogue, in k
KERNEL_US = 2.0  # a kernel's fixed cost on the GPU (launch, tail)
MEMORY_EFFICIENCY = 0.7  # of the HBM bandwidth a streaming kernel reaches
ATTENTION_HALF = 512.0  # the key length at which flash attention runs at half its best
# Calibrated on Megatron-LM's README table (a least-squares fit of the relative error of its
# nine rows: bench/plan/plan_calibration.py; docs/planner.md): the clocks kept under load against
# MAMF's bursts, flash attention's forward and backward against the sustained peak, and the
# bytes the memory-bound ops move against the count above (dropout, biases, fp32 casts, the
# kernels not fused).
SUSTAINED = 0.755
ATTENTION, ATTENTION_BACKWARD = 0.68, 0.51
MEMORY_TRAFFIC = 2.5


def gemm_seconds(gpu: GPU, peak: float, m: float, n: float, k: float, e: int) -> float:
    """One (m, k) x (k, n) GEMM's seconds at `peak` FLOP/s (module docstring)."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    tiles = math.ceil(m / TILE[0]) * math.ceil(n / TILE[1])
    waves = tiles / (math.ceil(tiles / gpu.sms) * gpu.sms)
    depth = k / (k + K_OVERHEAD)
    flops = 2.0 * m * n * k
    math_s = flops / (peak * SUSTAINED * gpu.mamf * waves * depth)
    memory_s = (m * k + k * n + m * n) * e / (gpu.hbm_tbps * 1e12 * MEMORY_EFFICIENCY)
    return max(math_s, memory_s) + KERNEL_US * 1e-6


def trained_gemm(gpu, peak, m, n, k, e, count=1.0) -> float:
    """Forward (m, k) x (k, n), backward's input gradient (m, n) x (n, k) and weight gradient
    (k, m) x (m, n), `count` times."""
    if count <= 0:
        return 0.0
    return count * (gemm_seconds(gpu, peak, m, n, k, e) + gemm_seconds(gpu, peak, m, k, n, e)
                    + gemm_seconds(gpu, peak, k, n, m, e))  # fmt: skip


def layer_seconds(cfg: Config, shape, moe: bool, gpu: GPU, peak: float) -> dict:
    """{gemm, attention, memory} seconds of a layer's forward and backward (an MoE layer's if
    `moe`) for one micro-batch on one rank (recomputation included)."""
    m, t = cfg.model, cfg.training
    e = 2 if t.precision in ("bf16", "fp16") else 4
    tp, cp = shape.tp, shape.cp
    T = t.micro_batch_size * m.seq_length / cp  # tokens through this rank's GEMMs (SP gathers)
    h, d = m.hidden_size, m.head_dim
    q = m.num_attention_heads * d / tp
    kv = kv_features(m, tp)
    full = t.recompute == "full"
    gemm = trained_gemm(gpu, peak, T, q + 2 * kv, h, e) + trained_gemm(gpu, peak, T, h, q, e)
    gated = 2 if m.features.gated_mlp else 1
    width = 0.0  # the MLP intermediate a token passes (for the memory-bound ops)
    if moe:
        E, k = m.num_experts, m.moe_router_topk
        gemm += trained_gemm(gpu, peak, T, E, h, e)  # the router
        local = E / shape.ep
        # a stage's dp T tokens make dp T k assignments, E experts each copied over
        # tp dp / (ep etp) groups: per copy (this rank's local experts) T k ep etp / (E tp)
        tokens = T * k * shape.ep * shape.etp / (E * tp)
        f = m.moe_ffn / shape.etp
        gemm += trained_gemm(gpu, peak, tokens, gated * f, h, e, local)
        gemm += trained_gemm(gpu, peak, tokens, h, f, e, local)
        width = k * m.moe_ffn / tp
        shared = m.moe_shared_expert_intermediate_size or 0
        if shared:
            gemm += trained_gemm(gpu, peak, T, gated * shared / tp, h, e)
            gemm += trained_gemm(gpu, peak, T, h, shared / tp, e)
            width += shared / tp
    else:
        f = m.ffn / tp
        gemm += trained_gemm(gpu, peak, T, gated * f, h, e) + trained_gemm(gpu, peak, T, h, f, e)
        width = f
    # the core: causal, so half the square of the whole sequence, this rank's 1/cp share of it
    s = m.seq_length
    core = 4.0 * t.micro_batch_size * s * s / 2 / cp * m.num_attention_heads / tp * d
    fill = s / (s + ATTENTION_HALF) * SUSTAINED * peak
    forward = core / (ATTENTION * fill)
    attention = forward + 2 * core / (ATTENTION_BACKWARD * fill)
    if full or t.recompute == "selective":
        attention += forward
    # memory-bound: norms, residual adds, RoPE, activation; backward moves about twice forward's
    rows = T / tp if shape.sequence_parallel else T
    per_token = 10 * h * rows + (2 * (q + kv) + (gated + 1) * width) * T
    memory = 3 * MEMORY_TRAFFIC * per_token * e / (gpu.hbm_tbps * 1e12 * MEMORY_EFFICIENCY)
    if full:  # the forward again: a third of the GEMMs and the memory-bound ops
        gemm *= 4 / 3
        memory *= 4 / 3
    return {"gemm": gemm, "attention": attention, "memory": memory}


def head_seconds(cfg: Config, shape, gpu: GPU, peak: float) -> float:
    """The output layer's GEMMs and the loss's passes over the logits, one micro-batch."""
    m, t = cfg.model, cfg.training
    e = 2 if t.precision in ("bf16", "fp16") else 4
    T = t.micro_batch_size * m.seq_length / shape.cp
    v = m.padded_vocab_size(shape.tp) / shape.tp
    logits = 3 * MEMORY_TRAFFIC * T * v * e / (gpu.hbm_tbps * 1e12 * MEMORY_EFFICIENCY)
    return trained_gemm(gpu, peak, T, v, m.hidden_size, e) + logits


def optimizer_seconds(optimizer_bytes: float, cluster) -> float:
    """Adam's step over the rank's shard: its fp32 master copy and moments (`optimizer_bytes`,
    12 a parameter) and the gradient read, the three written, the bf16 copy written: 30 bytes a
    parameter."""
    gpu = GPUS[cluster.gpu]
    return optimizer_bytes * 30 / 12 / (gpu.hbm_tbps * 1e12 * MEMORY_EFFICIENCY)


def microbatch_seconds(cfg: Config, shape, cluster) -> float:
    """Seconds of one micro-batch's forward and backward through every layer and the head, on
    one rank of each stage together (the average pipeline rank's share: / pp)."""
    gpu, peak = GPUS[cluster.gpu], cluster.peak_tflops * 1e12
    m = cfg.model
    moe = sum(m.is_moe_layer(i) for i in range(m.num_layers))
    total = head_seconds(cfg, shape, gpu, peak)
    for is_moe, count in ((True, moe), (False, m.num_layers - moe)):
        if count:
            total += count * sum(layer_seconds(cfg, shape, is_moe, gpu, peak).values())
    return total
