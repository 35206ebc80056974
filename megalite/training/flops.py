"""Model FLOPs, hardware FLOPs and MFU.

Model FLOPs per token (what the model needs, whatever the implementation does):

    6 N + 12 L h s

N counts matmul parameters: every layer's q, k, v, out and MLP weights plus the output layer
(vocab x h, the real vocabulary); an MoE layer counts its active parameters (router, the k
experts of a token, the shared expert). The input embedding is a lookup, not a matmul, so it adds
nothing of its own: a tied embedding counts once, as the output layer. Each matmul parameter
costs 2 FLOPs per token forward and 4 backward (input and weight gradients): 6 N (Kaplan et al.
2020, "Scaling laws", C = 6N; Chowdhery et al. 2022, PaLM, appendix B). Attention adds the
score matmul QK^T and the weighted sum AV, each 2 s h FLOPs per token and layer forward, times
3 for forward and backward: 12 L h s (PaLM appendix B counts exactly 6N + 12 L H Q T; Narayanan
et al. 2021 count the same full s x s square, as Megatron does, even though causal attention
could skip half). Norms, activations, softmax and the loss are left out, as everyone does.

Hardware FLOPs add what recomputation runs again (Korthikanti et al. 2022, section 5): full
recompute repeats the whole forward (2 N + 4 L h s), selective repeats the attention core
(4 L h s). They are reported as HFU and never used for MFU.

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


def matmul_params(cfg: ModelConfig) -> int:
    """N: the weights that multiply activations (biases and norms excluded). In a mixture of
    experts the active ones: per MoE layer the router, the k experts a token passes through
    and the shared expert, not the E - k others (what a token costs, as Megatron counts)."""
    h, L, hd = cfg.hidden_size, cfg.num_layers, cfg.head_dim
    attn = h * hd * (cfg.num_attention_heads * 2 + cfg.heads_kv * 2)  # q and out; k and v
    per = 3 if cfg.features.gated_mlp else 2  # (gate,) up, down
    mlp = h * cfg.ffn * per
    n = L * attn + cfg.vocab_size * h  # + the output layer (the tied embedding)
    for i in range(L):
        if cfg.is_moe_layer(i):
            shared = cfg.moe_shared_expert_intermediate_size or 0
            n += h * cfg.num_experts + h * (cfg.moe_router_topk * cfg.moe_ffn + shared) * per
        else:
            n += mlp
    return n


def attention_flops_per_token(cfg: ModelConfig) -> float:
    """Forward and backward of QK^T and AV: 12 L h s."""
    return 12 * cfg.num_layers * cfg.hidden_size * cfg.seq_length


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
