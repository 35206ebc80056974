"""The MoE layer with expert parallelism against the same layer in one process, in fp64.

Four gloo ranks run, in one spawn, the layer at ep 2 and 4 with tp 1 and 2 (with and without
sequence parallelism; experts spread over TP ranks first, then over data-parallel ones), once
with a plain router and once with one skewed so that about 90% of the tokens pick expert 0.
Each data-parallel replica feeds its own micro-batch; the reference runs every replica's
micro-batch through the whole layer (ep = tp = 1). Outputs, the load-balancing loss, the input
gradients and the parameter gradients (reduced as the optimizer does: the router over TP and
DP, the experts over edp, the shared expert over DP) agree within 1e-10. The ledger holds
exactly two all-to-alls per layer per direction, of (T k + rows received) h 8 bytes.
The routing variants (model/routing.py: DeepSeek-V3's sigmoid scores with the expert bias,
node-limited groups and a scaling factor; Qwen3-MoE's unnormalised top-k; gpt-oss's biased
router and experts with clamped SwiGLU) run in the same spawn at ep2·tp2 and ep4·tp2 (with SP).
"""

import math
import zlib

import pytest
import torch

from megalite.config import ModelConfig
from megalite.model.env import LayerEnv
from megalite.model.layers import MLP
from megalite.model.moe import MoELayer
from megalite.parallel import comm
from megalite.parallel.comm import Group
from megalite.parallel.expert_parallel import ExpertGroups
from megalite.parallel.groups import build_groups
from megalite.parallel.specs import name_parameters, spec_of
from megalite.parallel.topology import Topology
from megalite.testing import spawn

pytestmark = pytest.mark.distributed
B, S, H, E, K, F_, SHARED = 2, 8, 16, 4, 2, 12, 8
TOL = 1e-10


VARIANTS = {  # the routing variants: ModelConfig fields
    "deepseek": {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                 "moe_router_num_groups": 2, "moe_router_group_topk": 1,
                 "moe_router_topk_scaling_factor": 2.5},
    "qwen3 unnormalised": {"flavour": "qwen3", "moe_router_pre_softmax": True},
    "gpt-oss": {"flavour": "gpt_oss", "swiglu_limit": 0.5},  # a limit the values reach
}  # fmt: skip


def cfg(capacity=None, **variant) -> ModelConfig:
    return ModelConfig(**{"flavour": "llama", **variant}, hidden_size=H, num_attention_heads=4, seq_length=S,
                       vocab_size=64, num_experts=E, moe_router_topk=K, moe_ffn_hidden_size=F_,
                       moe_shared_expert_intermediate_size=SHARED, moe_aux_loss_coeff=0.1,
                       moe_z_loss_coeff=0.01, moe_expert_capacity_factor=capacity)  # fmt: skip


def full_tensor(name: str, shape, skew: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    t = torch.randn(shape, generator=g, dtype=torch.float64) / math.sqrt(shape[-1])
    if skew and name == "router.weight":
        t[0] += 3.0 / math.sqrt(H)  # with inputs leaning the same way: expert 0 wins
    return t


def layer(
    m: ModelConfig, tp: Group, ep: ExpertGroups, sequence_parallel: bool, skew: bool
) -> MoELayer:
    """The layer with its full tensors drawn by name (and the expert bias, when on)."""
    env = LayerEnv(tp=tp, sequence_parallel=sequence_parallel, experts=ep, dtype=torch.float64)
    import dataclasses

    shared = MLP(dataclasses.replace(m, ffn_hidden_size=SHARED), env)
    moe = MoELayer(m, env, shared)
    name_parameters(moe)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            p.copy_(spec_of(p).local(full_tensor(name, spec_of(p).shape, skew)))
        if moe.expert_bias is not None:
            moe.expert_bias.copy_(full_tensor("expert_bias", (E,), skew).float())
    return moe


def inputs(d: int, skew: bool):
    g = torch.Generator().manual_seed(100 + d)
    x = torch.randn(B, S, H, generator=g, dtype=torch.float64)
    if skew:
        x += 1.5
    return x, torch.randn(B, S, H, generator=g, dtype=torch.float64)


def reference(dp: int, skew: bool, capacity=None, variant=()):
    """Every replica's micro-batch through the whole layer: outputs, aux per replica, x grads,
    parameter gradients summed over the replicas, the share of tokens picking expert 0."""
    one = Group("tp", [0], 0)
    moe = layer(cfg(capacity, **dict(variant)), one, ExpertGroups(Group("ep", [0], 0)), False, skew)
    outs, auxes, xgrads, picked = [], [], [], 0.0
    for d in range(dp):
        x, g = inputs(d, skew)
        x.requires_grad_(True)
        before = moe.stats.clone()
        out = moe(x)
        (out * g).sum().backward()
        outs.append(out.detach())
        auxes.append((moe.stats - before)[E].item())
        xgrads.append(x.grad)
        top = moe.route(x.detach().reshape(-1, H))[2]
        picked += (top == 0).any(-1).double().mean().item() / dp
    grads = {n: p.grad for n, p in moe.named_parameters()}
    return outs, auxes, xgrads, grads, picked


def case(rank, tp, ep, sequence_parallel, skew, capacity=None, **variant):
    topo = Topology(tp=tp, dp=4 // tp)
    topo.expert = topo.experts(ep)
    groups = build_groups(topo, torch.device("cpu"))
    d, t = groups.dp.rank, groups.tp.rank
    ref = reference(4 // tp, skew, capacity, tuple(variant.items()))
    ref_out, ref_aux, ref_xg, ref_grads, picked = ref
    moe = layer(
        cfg(capacity, **variant),
        groups.tp,
        ExpertGroups(groups.ep),
        sequence_parallel and tp > 1,
        skew,
    )
    x, g = inputs(d, skew)
    rows = slice(t * S // tp, (t + 1) * S // tp) if sequence_parallel and tp > 1 else slice(None)
    x = x[:, rows].clone().requires_grad_(True)
    groups.ledger.reset()
    out = moe(x)
    fwd = dict(groups.ledger.calls), dict(groups.ledger.bytes)
    (out * g[:, rows]).sum().backward()
    calls, nbytes = dict(groups.ledger.calls), dict(groups.ledger.bytes)
    err = {
        "out": (out - ref_out[d][:, rows]).abs().max().item(),
        "x grad": (x.grad - ref_xg[d][:, rows]).abs().max().item(),
    }
    aux = moe.stats[E].clone()
    comm.all_reduce(aux, groups.tp)  # each TP rank holds its tokens' share
    err["aux"] = abs(aux.item() - ref_aux[d])
    for name, p in moe.named_parameters():
        grad = p.grad.clone()
        group = groups.edp if spec_of(p).split_axis == "ep" else groups.dp
        comm.all_reduce(grad, group)
        if "tp" in spec_of(p).grad_sum:  # the router; biases seeing only their rows (SP)
            comm.all_reduce(grad, groups.tp)
        err[name] = (grad - spec_of(p).local(ref_grads[name])).abs().max().item()
    ledger = None
    if ep > 1:
        t_local = B * S // tp
        sent = torch.tensor([t_local * K * H * 8], dtype=torch.float64)
        total = torch.tensor([fwd[1]["ep"]], dtype=torch.float64)
        comm.all_reduce(total, groups.ep)
        ledger = {
            "calls": (fwd[0]["ep"], calls["ep"], fwd[0]["ep_sizes"], calls["ep_sizes"]),
            "fwd = bwd": nbytes["ep"] == 2 * fwd[1]["ep"],
            "dispatch": fwd[1]["ep"] >= sent.item(),  # its T k rows, plus those it returns
            "group total": (total.item(), 2 * K * H * 8 * t_local * ep),
        }
    return err, ledger, picked


def run(rank, world):
    out = {}
    for tp, ep, sequence_parallel in [
        (1, 2, False),
        (1, 4, False),
        (2, 2, False),
        (2, 4, False),
        (2, 2, True),
    ]:
        for skew in (False, True):
            out[tp, ep, sequence_parallel, skew] = case(rank, tp, ep, sequence_parallel, skew)
    out["capacity"] = case(rank, 2, 2, False, True, capacity=1.0)
    for name, variant in VARIANTS.items():
        out[name] = case(rank, 2, 2, False, False, **variant)
        out[name + " ep4 sp"] = case(rank, 2, 4, True, False, **variant)
    return out


def test_moe_layer_matches_one_process():
    results = spawn(run, 4, timeout=300)
    for rank, res in enumerate(results):
        for key, (err, ledger, picked) in res.items():
            worst = max(err, key=err.get)
            assert err[worst] <= TOL, (rank, key, worst, err[worst])
            if isinstance(key, tuple) and key[3]:
                assert picked >= 0.9, picked  # the skewed router: ~90% pick expert 0
            if ledger is not None:
                # per layer: dispatch + combine forward, their reverses backward; one size
                # exchange forward
                assert ledger["calls"] == (2, 4, 1, 1), (key, ledger)
                assert ledger["fwd = bwd"], ledger
                if key != "capacity":  # dropless: every assignment goes out and comes back
                    assert ledger["dispatch"], ledger
                    assert ledger["group total"][0] == ledger["group total"][1], (key, ledger)
