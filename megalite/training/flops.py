"""Model FLOPs, hardware FLOPs and MFU.

Model FLOPs per token (what the model needs, whatever the implementation does):

    6 N + 6 s sum_layers nh (d_qk + d_v)       (= 6 N + 12 L h s when nh d_qk = nh d_v = h)

N counts matmul parameters: every layer's q, k, v, out and MLP weights plus the output layer
(vocab x h, the real vocabulary); an MoE layer counts its active parameters (router, the k
experts of a token, the shared expert). The input embedding is a lookup, not a matmul, so it adds
nothing of its own: a tied embedding counts once, as the output layer. Each matmul parameter
costs 2 FLOPs per token forward and 4 backward (input and weight gradients): 6 N (Kaplan et al.
2020, "Scaling laws", C = 6N; Chowdhery et al. 2022, PaLM, appendix B). Attention adds the
score matmul QK^T (2 s nh d_qk FLOPs per token and layer forward) and the weighted sum AV
(2 s nh d_v), times 3 for forward and backward; with nh d = h that is PaLM's 12 L h s (appendix
B counts exactly 6N + 12 L H Q T; Narayanan et al. 2021 count the same full s x s square, as
Megatron does, even though causal attention could skip half). Norms, activations, softmax,
RoPE, attention sinks, biases and the loss are left out, as everyone does.

Multi-head latent attention (model/mla.py) counts its real shapes: q_a (h x r_q) and q_b
(r_q x nh (dn + dr)), or one q (h x nh (dn + dr)) without a q rank; kv_a (h x (r + dr): the
latent and the RoPE key shared by the heads), kv_b (r x nh (dn + dv)), out (nh dv x h); the core
with d_qk = dn + dr and d_v = dv (not the padded head dim the kernels are handed). Each
multi-token prediction module (model/mtp.py) adds its eh_proj (2h x h), its transformer layer
(layer L + k: an MoE one when that index is) and its logits (the shared output layer, vocab x h,
once more); its embedding is a lookup of the shared one.

Hardware FLOPs add what recomputation runs again (Korthikanti et al. 2022, section 5): full
recompute repeats the whole forward (2 N + the core's forward third, 4 L h s when nh d = h),
selective repeats the attention core (its forward third). They are reported as HFU and never used for MFU.

MFU = model FLOPs per second / (devices x the device's dense peak at the training precision).
The peak comes from `PEAKS`; an unlisted device or a CPU gives None ("unknown"), never a guess.
"""

import torch

from megalite.config import ModelConfig

# Dense (no 2:4 sparsity) peak FLOP/s per GPU, by precision: bf16/fp16 on tensor cores; fp32 is
# the plain FP32 rate (PyTorch keeps TF32 off for matmuls by default). Sources: NVIDIA data
# sheets: A100 (40/80 GB, SXM and PCIe: same peaks), H100 SXM / PCIe / NVL, H200 SXM / NVL,
# and the Blackwell architecture brief for HGX B200 (1000 W). Rows are tried in order and the
# first whose fragments all occur in the device name wins, so the specific variants come first.
# fp8: dense FP8 tensor-core peaks (none on A100). A run with --fp8-format still reports MFU
# against its --precision peak (attention and the output layer stay there; docs/fp8.md), so
# FP8's speed-up shows as a higher MFU than the bf16 run's.
PEAKS = [
    (("H100", "PCIe"), {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12, "fp8": 1513e12}),
    (("H100", "NVL"), {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12, "fp8": 1671e12}),
    (("H100",), {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12, "fp8": 1979e12}),  # SXM
    (("H200", "NVL"), {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12, "fp8": 1671e12}),
    (("GH200",), {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12, "fp8": 1979e12}),
    (("H200",), {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12, "fp8": 1979e12}),  # SXM
    (("A100",), {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}),
    (("GB200",), None),  # its B200 runs at 1200 W with other peaks: not listed, so unknown
    (("B200",), {"bf16": 2250e12, "fp16": 2250e12, "fp32": 80e12, "fp8": 4500e12}),
]


def attention_params(cfg: ModelConfig) -> int:
    """The matmul weights of one layer's attention: q, k, v and out, or MLA's projections."""
    h, nh = cfg.hidden_size, cfg.num_attention_heads
    if cfg.features.latent_attention:
        dn, dr, dv, r, rq = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                             cfg.kv_lora_rank, cfg.q_lora_rank)  # fmt: skip
        q = (h * rq + rq * nh * (dn + dr)) if rq else h * nh * (dn + dr)
        return q + h * (r + dr) + r * nh * (dn + dv) + nh * dv * h  # q; kv_a; kv_b; out
    return h * cfg.head_dim * (cfg.num_attention_heads * 2 + cfg.heads_kv * 2)  # q, out; k, v


def attention_dims(cfg: ModelConfig) -> tuple[int, int]:
    """(d_qk, d_v): the per-head dims of QK^T and of AV (MLA: dn + dr and dv)."""
    if cfg.features.latent_attention:
        return cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    return cfg.head_dim, cfg.head_dim


def layer_params(cfg: ModelConfig, i: int) -> int:
    """The matmul weights a token passes through in layer i (MTP module k's layer: i = L + k)."""
    h = cfg.hidden_size
    per = 3 if cfg.features.gated_mlp else 2  # (gate,) up, down
    if not cfg.is_moe_layer(i):
        return attention_params(cfg) + h * cfg.ffn * per
    shared = cfg.moe_shared_expert_intermediate_size or 0
    routed = h * cfg.num_experts + h * (cfg.moe_router_topk * cfg.moe_ffn + shared) * per
    return attention_params(cfg) + routed


def attention_layers(cfg: ModelConfig) -> int:
    """Layers with an attention core: the model's and the MTP modules'."""
    return cfg.num_layers + cfg.mtp_num_layers


def matmul_params(cfg: ModelConfig) -> int:
    """N: the weights that multiply activations (biases and norms excluded). In a mixture of
    experts the active ones: per MoE layer the router, the k experts a token passes through
    and the shared expert, not the E - k others (what a token costs, as Megatron counts).
    MTP modules: eh_proj, the layer and the output layer again."""
    h, L = cfg.hidden_size, cfg.num_layers
    n = sum(layer_params(cfg, i) for i in range(L)) + cfg.vocab_size * h  # + the output layer
    for k in range(cfg.mtp_num_layers):
        n += 2 * h * h + layer_params(cfg, L + k) + cfg.vocab_size * h
    return n


def attention_flops_per_token(cfg: ModelConfig) -> float:
    """Forward and backward of QK^T and AV: 6 s nh (d_qk + d_v) per layer (12 L h s when
    nh d = h), the MTP modules' layers included."""
    d_qk, d_v = attention_dims(cfg)
    per_layer = 6 * cfg.seq_length * cfg.num_attention_heads * (d_qk + d_v)
    return attention_layers(cfg) * per_layer


def model_flops_per_token(cfg: ModelConfig) -> float:
    """6 N + 12 L h s (training: forward and backward)."""
    return 6 * matmul_params(cfg) + attention_flops_per_token(cfg)


def hardware_flops_per_token(cfg: ModelConfig, recompute: str) -> float:
    """Model FLOPs plus the forward work that recomputation repeats."""
    attention_forward = attention_flops_per_token(cfg) / 3
    extra = {
        "none": 0.0,
        "selective": attention_forward,
        "full": 2 * matmul_params(cfg) + attention_forward,
    }[recompute]
    return model_flops_per_token(cfg) + extra


def peak_flops(device_name: str, precision: str) -> float | None:
    """Dense peak FLOP/s of a device named like `torch.cuda.get_device_name()`, or None."""
    for fragments, peaks in PEAKS:
        if all(f in device_name for f in fragments):
            return None if peaks is None else peaks.get(precision)
    return None


def device_peak_flops(device: torch.device, precision: str) -> float | None:
    """Peak FLOP/s of this process's device, or None (CPU, an unlisted GPU): never a guess."""
    if device.type != "cuda":
        return None
    return peak_flops(torch.cuda.get_device_name(device), precision)


def mfu(flops_per_token: float, tokens_per_s: float, peak: float | None, devices: int):
    """Achieved FLOP/s over the peak of all devices; None when the peak is unknown."""
    if peak is None:
        return None
    return flops_per_token * tokens_per_s / (peak * devices)
