"""Model FLOPs, hardware FLOPs and the peak table against hand-computed values."""

import pytest
import torch

from megalite.config import ModelConfig
from megalite.training import flops


def gpt2_124m():
    return ModelConfig(flavour="gpt2", num_layers=12, hidden_size=768, num_attention_heads=12,
                       seq_length=1024, vocab_size=50257)  # fmt: skip


def test_gpt2_124m_by_hand():
    cfg = gpt2_124m()
    # per layer: q, k, v, out 4 h^2, MLP 2 * 4h * h = 8 h^2; plus the tied embedding as the head
    n = 12 * 12 * 768**2 + 50257 * 768
    assert flops.matmul_params(cfg) == n == 123_532_032
    attention = 12 * 12 * 768 * 1024  # 12 L h s
    assert flops.model_flops_per_token(cfg) == 6 * n + attention
    # recompute adds the repeated forward: full 2N + 4Lhs, selective 4Lhs
    assert flops.hardware_flops_per_token(cfg, "none") == 6 * n + attention
    assert flops.hardware_flops_per_token(cfg, "selective") == 6 * n + attention * 4 / 3
    assert flops.hardware_flops_per_token(cfg, "full") == 8 * n + attention * 4 / 3


def test_llama_gqa_untied_by_hand():
    cfg = ModelConfig(flavour="llama", num_layers=2, hidden_size=64, num_attention_heads=4,
                      num_query_groups=2, seq_length=32, vocab_size=100)  # fmt: skip
    hd, ffn = 16, 192  # 8h/3 rounded up to 64
    per_layer = 64 * 64 * 2 + 64 * (2 * hd) * 2 + 3 * 64 * ffn  # q, out; k, v (2 groups); MLP
    n = 2 * per_layer + 100 * 64  # untied: the output layer counts, the input embedding not
    assert flops.matmul_params(cfg) == n
    assert flops.model_flops_per_token(cfg) == 6 * n + 12 * 2 * 64 * 32


def test_mfu_by_hand():
    cfg = gpt2_124m()
    per_token = flops.model_flops_per_token(cfg)
    peak = flops.peak_flops("NVIDIA H100 80GB HBM3", "bf16")
    assert peak == 989e12
    # 8 GPUs at 400k tokens/s: 6N+12Lhs FLOPs per token over 8 x 989 TFLOP/s
    got = flops.mfu(per_token, 400_000, peak, 8)
    assert got == pytest.approx(per_token * 400_000 / (8 * 989e12))
    assert 0.03 < got < 0.05


@pytest.mark.parametrize(
    "name, precision, peak",
    [
        ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
        ("NVIDIA A100-PCIE-40GB", "fp32", 19.5e12),
        ("NVIDIA H100 80GB HBM3", "fp16", 989e12),
        ("NVIDIA H100 PCIe", "bf16", 756e12),
        ("NVIDIA H100 NVL", "bf16", 835e12),
        ("NVIDIA H200", "bf16", 989e12),
        ("NVIDIA H200 NVL", "bf16", 835e12),
        ("NVIDIA B200", "bf16", 2250e12),
        ("NVIDIA B200", "fp32", 80e12),
    ],
)
def test_peak_table(name, precision, peak):
    assert flops.peak_flops(name, precision) == peak


@pytest.mark.parametrize(
    "name", ["NVIDIA GeForce RTX 4090", "Tesla V100-SXM2-16GB", "NVIDIA GB200", ""]
)
def test_unknown_device_is_unknown(name):
    assert flops.peak_flops(name, "bf16") is None
    assert flops.mfu(1e9, 1e6, flops.peak_flops(name, "bf16"), 8) is None


def test_cpu_reports_no_mfu():
    assert flops.device_peak_flops(torch.device("cpu"), "fp32") is None


MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24,
           moe_shared_expert_intermediate_size=16, moe_dense_layers=[0])  # fmt: skip


@pytest.mark.parametrize("q_lora_rank, moe", [(12, {}), (None, MOE)])
def test_latent_attention_and_mtp_against_the_flop_counter(q_lora_rank, moe):
    """A tiny one-process DeepSeek-V3-style model (MLA with v narrower than q/k, two MTP modules,
    with and without a q rank, dense or with experts from layer 1 on, the MTP layers' too):
    the formula's forward (2 N + the attention core's third) against the matmul FLOPs
    torch.utils.flop_counter counts in a forward. The counter sees what the implementation
    runs: SDPA's math path (the full s x s square, as the formula counts it) on v padded to the
    q/k head dim (model/mla.py), which the test adds; norms, RoPE, softmax, the routing's
    top-k and the loss are no matmuls, left out by both. The real vocabulary is a padded one."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from megalite.model.env import LayerEnv
    from megalite.model.gpt import GPTChunk

    nh, s, b, dqk, dv = 4, 16, 2, 10, 8
    cfg = ModelConfig(flavour="deepseek_v3", num_layers=2, hidden_size=32, num_attention_heads=nh,
                      seq_length=s, vocab_size=256, ffn_hidden_size=48, q_lora_rank=q_lora_rank,
                      kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=dv,
                      mtp_num_layers=2, **moe)  # fmt: skip
    assert cfg.padded_vocab_size(1) == cfg.vocab_size
    model = GPTChunk(cfg, LayerEnv(seed=0))
    x, y = torch.randint(256, (2, b, s), generator=torch.Generator().manual_seed(0))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(x, y)
    counted = counter.get_total_flops() / (b * s)  # per token
    layers = cfg.num_layers + cfg.mtp_num_layers
    padding = layers * 2 * s * nh * (dqk - dv)  # AV over dqk dims instead of dv
    formula = 2 * flops.matmul_params(cfg) + flops.attention_flops_per_token(cfg) / 3
    assert counted == pytest.approx(formula + padding, rel=1e-9), (counted, formula, padding)
    # the model's parts: MLA's projections, not q, k, v, out of h x h; the MTP modules counted
    assert flops.attention_dims(cfg) == (dqk, dv)
    h, r = 32, 10
    q = h * 12 + 12 * nh * dqk if q_lora_rank else h * nh * dqk
    assert flops.attention_params(cfg) == q + h * (r + 4) + r * nh * (6 + dv) + nh * dv * h
