"""Expert tensor parallelism (--expert-tensor-parallel-size): the MoE layer with each expert's
width split over etp ranks against the same layer in one process, in fp64.

Four gloo ranks run, in one spawn, the layer of tests/distributed/test_moe.py (shared expert,
load-balancing and z losses) beside tp2 (or tp1) attention ranks, its experts at etp2·ep2,
etp2·ep1 (edp 2), etp4 and etp2·ep2 with sequence parallelism, with a plain and a skewed router
and once with a capacity. Each data-parallel replica feeds its own micro-batch; the reference
runs every replica's micro-batch through the whole layer. Outputs, input gradients and every
parameter gradient (reduced as the optimizer does: experts over edp, the router over tp and dp)
agree within 1e-10. Tokens: every rank routes its own; each assignment goes to all etp ranks of
its expert's ep slot, which return partial fc2 outputs that the sender sums.
"""

import pytest
import torch

from megalite.parallel import comm
from megalite.parallel.groups import build_groups
from megalite.parallel.specs import spec_of
from megalite.parallel.topology import Topology
from megalite.testing import spawn
from tests.distributed.test_moe import TOL, E, H, S, cfg, inputs, layer, reference

pytestmark = pytest.mark.distributed


def case(rank, tp, ep, etp, sp, skew, capacity=None):
    topo = Topology(tp=tp, dp=4 // tp)
    topo.expert = topo.experts(ep, etp)
    groups = build_groups(topo, torch.device("cpu"))
    d, t = groups.dp.rank, groups.tp.rank
    ref_out, _, ref_xg, ref_grads, _ = reference(4 // tp, skew, capacity)
    moe = layer(cfg(capacity), groups.tp, groups.experts, sp and tp > 1, skew)
    x, g = inputs(d, skew)
    rows = slice(t * S // tp, (t + 1) * S // tp) if sp and tp > 1 else slice(None)
    x = x[:, rows].clone().requires_grad_(True)
    groups.ledger.reset()
    out = moe(x)
    (out * g[:, rows]).sum().backward()
    err = {
        "out": (out - ref_out[d][:, rows]).abs().max().item(),
        "x grad": (x.grad - ref_xg[d][:, rows]).abs().max().item(),
    }
    shapes = {}
    for name, p in moe.named_parameters():
        grad, spec = p.grad.clone(), spec_of(p)
        comm.all_reduce(grad, groups.edp if spec.expert else groups.dp)
        if "tp" in spec.grad_sum:  # the router
            comm.all_reduce(grad, groups.tp)
        err[name] = (grad - spec.local(ref_grads[name])).abs().max().item()
        shapes[name] = tuple(p.shape)
    calls = dict(groups.ledger.calls)
    return err, shapes, (calls.get("ep"), calls.get("ep_sizes"))


def run(rank, world):
    out = {}
    for tp, ep, etp, sp in [(2, 2, 2, False), (2, 1, 2, False), (1, 1, 4, False), (2, 2, 2, True)]:
        for skew in (False, True):
            out[tp, ep, etp, sp, skew] = case(rank, tp, ep, etp, sp, skew)
    out["capacity"] = case(rank, 2, 2, 2, False, True, capacity=1.0)
    return out


def test_moe_layer_at_etp_matches_one_process():
    results = spawn(run, 4, timeout=300)
    for rank, res in enumerate(results):
        for key, (err, shapes, calls) in res.items():
            worst = max(err, key=err.get)
            assert err[worst] <= TOL, (rank, key, worst, err[worst])
            ep, etp = (2, 2) if key == "capacity" else key[1:3]
            f = 12 // etp  # test_moe's F_ = 12: each rank holds its 1/etp of every expert
            assert shapes["experts.gate_up.weight"] == (E // ep, 2 * f, H), (key, shapes)
            assert shapes["experts.down.weight"] == (E // ep, H, f), (key, shapes)
            # dispatch and combine forward, their reverses backward; one size exchange
            assert calls == (4, 1), (key, calls)
