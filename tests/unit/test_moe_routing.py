"""The routing variants of model/routing.py and gpt-oss's experts against transformers' MoE
blocks, with copied weights, in fp32 (within 1e-5): Qwen3-MoE's sparse block (softmax top-k,
with and without norm_topk_prob), DeepSeek-V3's MoE (sigmoid scores, the expert-score bias,
node-limited groups, renormalised top-k, the routed scaling factor, a shared expert) and
gpt-oss's MLP (a biased router, top-k then softmax, biased experts, clamped SwiGLU). Each
feature is shown to matter: without it the outputs differ. The same variants at ep2/tp2 are in
tests/distributed/test_moe.py.
"""

import dataclasses

import pytest
import torch

from megalite.checkpoint import hf_config, hf_moe
from megalite.config import Config, ModelConfig
from megalite.errors import MegaliteError
from megalite.model.env import LayerEnv
from megalite.model.layers import MLP
from megalite.model.moe import MoELayer
from megalite.model.routing import Routing
from megalite.parallel.comm import Group
from megalite.shape import validate

transformers = pytest.importorskip("transformers")
H, F_, TOL = 16, 12, 1e-5
ONE = Group("tp", [0], 0)


def randomise(module, std=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            t.copy_(torch.randn(t.shape, generator=g) * std)
    return module.eval()


def ours(m: ModelConfig, shared: int | None = None) -> MoELayer:
    mlp = None
    if shared:
        mlp = MLP(dataclasses.replace(m, ffn_hidden_size=shared), LayerEnv())
    return MoELayer(m, LayerEnv(), mlp).eval()


def x_of(scale=1.0, seed=1):
    return torch.randn(2, 8, H, generator=torch.Generator().manual_seed(seed)) * scale


def moe_cfg(**kw) -> ModelConfig:
    base = {"flavour": "qwen3", "hidden_size": H, "num_attention_heads": 4, "seq_length": 8,
            "num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": F_}  # fmt: skip
    return ModelConfig(**{**base, **kw})


# ---- Qwen3-MoE ------------------------------------------------------------------------------


def qwen3_block(norm: bool):
    c = transformers.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=F_, num_experts=8,
                                    num_experts_per_tok=2, norm_topk_prob=norm)  # fmt: skip
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    return randomise(Qwen3MoeSparseMoeBlock(c))


@pytest.mark.parametrize("norm", [True, False])
def test_qwen3_moe_block(norm):
    hf = qwen3_block(norm)
    layer = ours(moe_cfg(moe_router_pre_softmax=not norm))
    with torch.no_grad():
        layer.router.weight.copy_(hf.gate.weight)
        layer.experts.gate_up.weight.copy_(hf.experts.gate_up_proj)
        layer.experts.down.weight.copy_(hf.experts.down_proj)
        x = x_of()
        assert (layer(x) - hf(x)).abs().max() <= TOL
        other = ours(moe_cfg(moe_router_pre_softmax=norm))
        other.load_state_dict(layer.state_dict())
        assert (other(x) - hf(x)).abs().max() > 1e-3  # norm_topk_prob matters


# ---- DeepSeek-V3 ----------------------------------------------------------------------------


DEEPSEEK = {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
            "moe_router_num_groups": 4, "moe_router_group_topk": 2,
            "moe_router_topk_scaling_factor": 2.5}  # fmt: skip


def deepseek_block(norm: bool = True):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    c = transformers.DeepseekV3Config(hidden_size=H, moe_intermediate_size=F_,
                                      n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                                      topk_group=2, n_shared_experts=2, norm_topk_prob=norm,
                                      routed_scaling_factor=2.5)  # fmt: skip
    return randomise(DeepseekV3MoE(c))


def deepseek_layer(hf, **change) -> MoELayer:
    m = moe_cfg(**{**DEEPSEEK, **change})
    layer = ours(m, shared=m.moe_shared_expert_intermediate_size or 2 * F_)
    with torch.no_grad():
        layer.router.weight.copy_(hf.gate.weight)
        if layer.expert_bias is not None:
            layer.expert_bias.copy_(hf.gate.e_score_correction_bias)
        layer.experts.gate_up.weight.copy_(hf.experts.gate_up_proj)
        layer.experts.down.weight.copy_(hf.experts.down_proj)
        for a in ("gate", "up", "down"):
            getattr(layer.shared, a).weight.copy_(getattr(hf.shared_experts, f"{a}_proj").weight)
    return layer


@pytest.mark.parametrize("norm", [True, False])
def test_deepseek_v3_moe_block(norm):
    hf = deepseek_block(norm)
    x = x_of()
    with torch.no_grad():
        want = hf(x)
        assert (deepseek_layer(hf, moe_router_pre_softmax=not norm)(x) - want).abs().max() <= TOL
        if norm:  # each feature, undone, changes the output
            for change in ({"moe_router_num_groups": None, "moe_router_group_topk": None},
                           {"moe_router_topk_scaling_factor": None},
                           {"moe_router_enable_expert_bias": False},
                           {"moe_router_score_function": "softmax"}):  # fmt: skip
                assert (deepseek_layer(hf, **change)(x) - want).abs().max() > 1e-3, change


def test_deepseek_v3_moe_fields_both_ways():
    """The MoE fields of a DeepSeek-V3 config.json build the layer transformers computes, and
    are written back as they were."""
    hf = deepseek_block()
    d = {**hf.config.to_dict(), "first_k_dense_replace": 1, "num_hidden_layers": 3}
    fields = hf_moe.deepseek_v3_moe_fields(d)
    assert fields["moe_dense_layers"] == [0] and fields["moe_shared_expert_intermediate_size"] == 24
    m = moe_cfg(**fields, num_layers=3)
    layer = deepseek_layer(hf, **fields)
    x = x_of()
    with torch.no_grad():
        assert (layer(x) - hf(x)).abs().max() <= TOL
    back = hf_moe.deepseek_v3_moe_config(m)
    for key, value in back.items():
        assert d[key] == value, key
    with pytest.raises(MegaliteError, match="topk_method='group_limited_greedy'"):
        hf_moe.deepseek_v3_moe_fields({**d, "topk_method": "group_limited_greedy"})


def test_group_limited_choice_stays_in_the_best_groups():
    r = Routing(k=2, sigmoid=True, groups=4, group_topk=1)
    scores = torch.tensor([[0.9, 0.0, 0.5, 0.5, 0.1, 0.1, 0.8, 0.05]])  # groups of two
    # group sums of the top two: 0.9, 1.0, 0.2, 0.85 -> only group 1 (experts 2, 3)
    assert sorted(r.choose(scores, None)[0].tolist()) == [2, 3]
    assert sorted(Routing(k=2).choose(scores, None)[0].tolist()) == [0, 6]


# ---- gpt-oss --------------------------------------------------------------------------------


def gpt_oss_tensors(hf) -> dict:
    """GptOssMLP's tensors in megalite's layout: gate_up (E, h, 2f) with gate and up
    interleaved -> (E, 2f, h) gate rows then up rows; down (E, f, h) -> (E, h, f)."""
    e = hf.experts
    w, b = e.gate_up_proj, e.gate_up_proj_bias
    return {
        "router.weight": hf.router.weight,
        "router.bias": hf.router.bias,
        "experts.gate_up.weight": torch.cat([w[..., ::2], w[..., 1::2]], -1).transpose(1, 2),
        "experts.gate_up.bias": torch.cat([b[:, ::2], b[:, 1::2]], -1),
        "experts.down.weight": e.down_proj.transpose(1, 2),
        "experts.down.bias": e.down_proj_bias,
    }


def test_gpt_oss_mlp():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    c = transformers.GptOssConfig(hidden_size=H, intermediate_size=F_, num_local_experts=8,
                                  num_experts_per_tok=2, swiglu_limit=7.0)  # fmt: skip
    hf = randomise(GptOssMLP(c), std=1.0)  # gate and up reach the clamp
    with torch.no_grad():  # outputs of order 1, so that 1e-5 is fp32's rounding
        hf.experts.down_proj.mul_(0.01)
        hf.experts.down_proj_bias.mul_(0.01)
    x = x_of(scale=2.0)
    layer = ours(moe_cfg(flavour="gpt_oss"))
    with torch.no_grad():
        for name, t in gpt_oss_tensors(hf).items():
            layer.get_parameter(name).copy_(t)
        want = hf(x)[0]
        assert want.abs().max() > 0.5 and (layer(x) - want).abs().max() <= TOL
        unclamped = ours(moe_cfg(flavour="gpt_oss", swiglu_limit=1e9))
        unclamped.load_state_dict(layer.state_dict())
        assert (unclamped(x) - want).abs().max() > 1e-3  # the clamp is reached and matters
        layer.router.bias.zero_()
        assert (layer(x) - want).abs().max() > 1e-3  # the router's bias matters


def test_what_hf_cannot_express_is_refused():
    with pytest.raises(MegaliteError, match="a gpt_oss model without experts cannot be exported"):
        hf_config.hf_config(moe_cfg(flavour="gpt_oss", vocab_size=64, num_experts=None))
    with pytest.raises(MegaliteError, match="sigmoid router scores, node-limited routing, a top-k "
                       "scaling factor, which Qwen3MoeForCausalLM"):  # fmt: skip
        hf_config.hf_config(moe_cfg(vocab_size=64, **DEEPSEEK))


# ---- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize("change, line", [
    ({"moe_router_num_groups": 4}, "set together or not at all"),
    ({"moe_router_num_groups": 3, "moe_router_group_topk": 1}, "not divisible by"),
    ({"moe_router_num_groups": 8, "moe_router_group_topk": 1}, "leave at least"),
    ({"moe_dense_layers": [5]}, "are not layers of this 2-layer model"),
    ({"moe_router_topk_scaling_factor": 0.0}, "scaling-factor=0.0 must be positive"),
])  # fmt: skip
def test_bad_routing_is_refused(change, line):
    cfg = Config(model=dataclasses.replace(moe_cfg(vocab_size=64), **change))
    with pytest.raises(MegaliteError, match=line):
        validate(cfg, 1)
