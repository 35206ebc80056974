"""The MoE layer in one process against a token-by-token reference written from the definitions
(fp64): routing, renormalised top-k weights, SwiGLU and GELU experts, the load-balancing and
z losses, the capacity drop policy; the Triton grouped GEMM against the torch reference inside
the layer; the expert bias; bad input; FLOPs and planner bytes of an MoE model."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from megalite.kernels import TORCH_OPS
from megalite.kernels.grouped_gemm import grouped_mm

from megalite.config import Config, ModelConfig
from megalite.errors import MegaliteError
from megalite.model.env import LayerEnv
from megalite.model.gpt import GPTChunk
from megalite.model.moe import MoELayer, aux_loss_scale, moe_metrics, update_expert_bias
from megalite.parallel.comm import Group
from megalite.parallel.expert_parallel import ExpertGroups
from megalite.parallel.specs import name_parameters
from megalite.plan import layouts, memory, traffic
from megalite.plan.layouts import layout
from megalite.shape import validate
from megalite.training import flops

B, S, H, E, K, F_ = 2, 8, 16, 4, 2, 12
ONE = Group("tp", [0], 0)


def moe(flavour="llama", ops=TORCH_OPS, dtype=torch.float64, **kw) -> MoELayer:
    m = ModelConfig(flavour=flavour, hidden_size=H, num_attention_heads=4, seq_length=S,
                    num_experts=E, moe_router_topk=K, moe_ffn_hidden_size=F_,
                    moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01, **kw)  # fmt: skip
    layer = MoELayer(m, LayerEnv(tp=ONE, ops=ops, dtype=dtype))
    name_parameters(layer)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) / math.sqrt(p.shape[-1]))
    return layer


def naive(layer: MoELayer, x: torch.Tensor, capacity=None):
    """Token by token: softmax over all experts, the k best, weights renormalised, the chosen
    experts' outputs weighted; capacity by the position policy. (out, aux, z, dropped)."""
    t = x.reshape(-1, H)
    logits = t @ layer.router.weight.T
    p = logits.softmax(-1)
    top = p.topk(K, -1).indices
    w = p.gather(1, top)
    w = w / w.sum(-1, keepdim=True)
    keep = torch.ones_like(top, dtype=torch.bool)
    if capacity is not None:
        c = math.ceil(capacity * t.shape[0] * K / E)
        taken = [0] * E
        for j in range(K):  # first choices first, then by position, then by row
            for pos in range(S):
                for b in range(B):
                    i = b * S + pos
                    e = int(top[i, j])
                    keep[i, j] = taken[e] < c
                    taken[e] += 1
    out = torch.zeros_like(t)
    for i in range(t.shape[0]):
        for j in range(K):
            e = int(top[i, j])
            if not keep[i, j]:
                continue
            if layer.gated:
                gu = layer.experts.gate_up.weight[e] @ t[i]
                y = F.silu(gu[:F_]) * gu[F_:]
            else:
                y = F.gelu(layer.experts.up.weight[e] @ t[i], approximate="tanh")
            out[i] += w[i, j] * (layer.experts.down.weight[e] @ y)
    load = torch.bincount(top.reshape(-1), minlength=E).double()
    aux = 0.1 * E / (K * t.shape[0] ** 2) * (p.sum(0) * load).sum()
    z = 0.01 * torch.logsumexp(logits, -1).square().mean()
    return out.view_as(x), aux, z, int((~keep).sum())


@pytest.mark.parametrize("flavour", ["llama", "gpt2"])
@pytest.mark.parametrize("capacity", [None, 0.75])
def test_layer_matches_token_by_token_reference(flavour, capacity):
    layer = moe(flavour, moe_expert_capacity_factor=capacity)
    x = torch.randn(B, S, H, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = layer(x)
    ref, aux, z, dropped = naive(layer, x, capacity)
    assert (out - ref).abs().max() <= 1e-12
    stats = layer.stats
    assert abs(stats[E] - aux) <= 1e-14 and abs(stats[E + 1] - z) <= 1e-14
    assert stats[E + 2] == dropped and (dropped > 0) == (capacity is not None)
    assert stats[:E].sum() == B * S * K  # loads count every assignment, dropped or not


def test_inference_with_a_kv_cache_drops_nothing():
    layer = moe(moe_expert_capacity_factor=0.75)
    x = torch.randn(B, S, H, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref, _, _, dropped = naive(layer, x, None)
    assert (layer(x, fused=False) - ref).abs().max() <= 1e-12
    assert dropped == 0 and naive(layer, x, 0.75)[3] > 0  # the training forward would drop


def test_aux_losses_reach_the_router():
    # the losses' gradient joins in backward at the scale the trainer hands in (loss_scale / m)
    layer = moe()
    x = torch.randn(B, S, H, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with aux_loss_scale(0.25):
        layer(x).sum().backward()
    with_aux = layer.router.weight.grad.clone()
    layer.zero_grad()
    layer.aux_coeff = layer.z_coeff = 0.0
    layer(x).sum().backward()
    without = layer.router.weight.grad
    w = layer.router.weight.detach().clone().requires_grad_(True)
    logits = x.reshape(-1, H) @ w.T
    p = logits.softmax(-1)
    load = torch.bincount(p.topk(K, -1).indices.reshape(-1), minlength=E).double()
    n = B * S
    losses = 0.1 * E / (K * n * n) * (p.sum(0) * load).sum()
    losses = losses + 0.01 * torch.logsumexp(logits, -1).square().mean()
    (expected,) = torch.autograd.grad(0.25 * losses, w)
    assert (with_aux - without - expected).abs().max() <= 1e-14


def test_triton_grouped_gemm_inside_the_layer():
    # fp32 under the Triton interpreter: the kernel path agrees with the torch reference
    ops = SimpleNamespace(**{**vars(TORCH_OPS), "grouped_mm": grouped_mm})
    kernel, ref = moe(ops=ops, dtype=torch.float32), moe(dtype=torch.float32)
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(3))
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    outs = [m(xi) for m, xi in zip((kernel, ref), xs)]
    for o in outs:
        o.square().sum().backward()
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-5, atol=1e-5)
    for (n, a), b in zip(kernel.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5, msg=n)


def test_expert_bias_moves_towards_balance():
    m = ModelConfig(flavour="llama", num_layers=2, hidden_size=H, num_attention_heads=4,
                    seq_length=S, vocab_size=64, num_experts=E, moe_router_topk=K,
                    moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.01)  # fmt: skip
    chunk = GPTChunk(m, LayerEnv(dtype=torch.float64))
    chunk(torch.randint(0, 64, (B, S)), torch.randint(0, 64, (B, S))).backward()
    layer = chunk.layers["0"].mlp
    load = layer.step_load.clone()
    update_expert_bias([chunk], Group("world", [0], 0), m.num_layers)
    expected = 0.01 * torch.sign(load.mean() - load)
    assert torch.equal(layer.expert_bias, expected.float()) and not layer.step_load.any()
    metrics = moe_metrics([chunk], Group("world", [0], 0), m.num_layers, E)
    assert sum(metrics["moe_load"]["1"]) == pytest.approx(1, abs=1e-3)
    assert not chunk.layers["0"].mlp.stats.any()  # read and restarted


@pytest.mark.parametrize(
    "flags, world, line",
    [
        ({"num_experts": 6, "ep": 4}, 4, "num_experts=6 is not divisible by ep=4"),
        ({"num_experts": 4, "moe_router_topk": 5}, 1, "moe_router_topk=5 is larger than num_experts=4"),
        ({"num_experts": 6, "ep": 3}, 4, "ep=3 does not divide tp*dp=1*4"),
        ({"num_experts": 4, "ep": 2, "etp": 2}, 2, "ep*etp=2*2 does not divide tp*dp=1*2"),
        ({"num_experts": 4, "etp": 3}, 3, "moe_ffn_hidden_size=256 is not divisible by --expert-tensor-parallel-size 3"),
        ({"num_experts": 4, "etp": 2, "flavour": "gpt_oss"}, 2, "expert biases .gpt-oss. do not run"),
        ({"num_experts": 4, "etp": 2, "optimizer": "muon"}, 2, "--optimizer muon orthogonalises whole experts"),
        ({"ep": 2}, 2, "--ep 2 needs a mixture-of-experts model"),
        ({"moe_router_enable_expert_bias": True}, 1, "--moe-router-enable-expert-bias needs a mixture-of-experts"),
        ({"num_experts": 4, "cp": 2}, 2, "mixture-of-experts models do not run with --cp yet"),
    ],
)  # fmt: skip
def test_bad_expert_layouts(flags, world, line):
    cfg = Config()
    for k, v in flags.items():
        where = cfg.optimizer if k == "optimizer" else cfg.model
        setattr(cfg.parallel if k in ("ep", "etp", "cp") else where, k, v)
    cfg.training.global_batch_size = 8
    with pytest.raises(MegaliteError, match=line.replace("*", r"\*")):
        validate(cfg, world)


def test_flops_count_active_parameters():
    m = ModelConfig(flavour="llama", num_layers=2, hidden_size=64, num_attention_heads=4,
                    seq_length=32, vocab_size=100, ffn_hidden_size=128, num_experts=8,
                    moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq=2,
                    moe_shared_expert_intermediate_size=16)  # fmt: skip
    attn = 4 * 64 * 64
    moe_layer = attn + 64 * 8 + 3 * 64 * (2 * 32 + 16)  # router, 2 of 8 experts, shared
    dense = attn + 3 * 64 * 128
    assert flops.matmul_params(m) == moe_layer + dense + 100 * 64


def test_planner_counts_experts_and_all_to_all():
    cfg = Config()
    cfg.model = ModelConfig(flavour="llama", num_layers=2, hidden_size=32, num_attention_heads=4,
                            seq_length=16, vocab_size=100, num_experts=4, moe_router_topk=2,
                            moe_ffn_hidden_size=24)  # fmt: skip
    cfg.parallel.ep = 2
    t = cfg.training
    t.micro_batch_size, t.global_batch_size = 2, 8
    lay = layout(cfg, dp=2, zero=1)
    chunk = GPTChunk(
        cfg.model,
        LayerEnv(device=torch.device("meta"), experts=ExpertGroups(Group("ep", [0, 1], 0))),
    )
    experts = sum(p.numel() for n, p in chunk.named_parameters() if ".experts." in n)
    assert experts == 2 * (2 * 3 * 24 * 32)  # per layer 2 local experts of 3 (24 x 32) matrices
    mem = memory.state_memory(cfg, lay, 0)
    assert experts <= mem["expert_numel"] < experts + 2 * 64 * 2  # padded to edp * 64 per bucket
    comm = traffic.comm_bytes(cfg, lay, 0, 2)
    tokens = 2 * 16  # b s per rank (tp 1)
    assert comm["ep"] == 2 * 2 * 4 * tokens * 2 * 32 * 4  # layers, micro-batches, 4 a2a, T k h 4
    assert "edp" not in comm  # dp 2 = ep 2: every expert on one rank (edp 1)
    assert str(layouts.plan(cfg, lay).layout) == "tp=1 pp=1 dp=2 ep=2 zero=1"
