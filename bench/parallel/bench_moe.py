"""The MoE layer side by side: megalite's grouped path, a plain torch loop over experts, the dense
MLP of equal active FLOPs; and the all-to-all share of an expert-parallel layer.

    .venv/bin/python bench/parallel/bench_moe.py [--hidden 256] [--ffn 512] [--experts 8] [--topk 2]
        [--tokens 2048] [--rounds 7] [--kernels auto] [--summary PATH]

Part 1, one process: forward + backward of one layer on the same tokens (llama flavour: SwiGLU
experts, fp32), the three variants interleaved round by round after a warm-up round:

- megalite: `MoELayer` at ep=1: router, tokens sorted by expert, every expert's matmuls through
  `ops.grouped_mm` (`--kernels auto`: the Triton kernel on CUDA, its torch reference elsewhere),
  unsorted and weighted;
- loop: the same weights in a plain torch loop over experts, as Hugging Face's Mixtral block
  does it (a mask per expert, its tokens gathered, two matmuls, index_add_ back);
- dense: a megalite `MLP` of width k f, the FLOPs of the k experts a token passes through (no
  router, no permutation): the cost of routing.

Part 2, two gloo processes (megalite/testing.py, one thread each) at ep=2, each rank its own tokens:
the layer's forward + backward and the seconds the `CommLedger` books for the all-to-alls
(kind "ep") and the split-size exchange ("ep_sizes"), which on gloo include waiting for the
peer: the all-to-all share of the layer's step.

Reported: median tokens/s per variant and the ratios; the all-to-all share. Timed on whatever
machine runs it: the ratios, not the absolute figures, are the result (docs/bench_moe.md).
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench._common import seconds  # noqa: E402
from megalite import kernels  # noqa: E402
from megalite.config import ModelConfig  # noqa: E402
from megalite.model.env import LayerEnv  # noqa: E402
from megalite.model.layers import MLP  # noqa: E402
from megalite.model.moe import MoELayer  # noqa: E402
from megalite.parallel.comm import Group  # noqa: E402
from megalite.parallel.expert_parallel import ExpertGroups  # noqa: E402
from megalite.parallel.specs import name_parameters  # noqa: E402


def config(a) -> ModelConfig:
    return ModelConfig(flavour="llama", hidden_size=a.hidden, num_attention_heads=4,
                       seq_length=a.tokens, num_experts=a.experts, moe_router_topk=a.topk,
                       moe_ffn_hidden_size=a.ffn, ffn_hidden_size=a.topk * a.ffn)  # fmt: skip


def build(a, tp: Group, ep: Group, device):
    torch.manual_seed(0)
    ops = kernels.select(a.kernels, device)
    m = config(a)
    env = LayerEnv(tp=tp, ops=ops, experts=ExpertGroups(ep), device=device)
    layer = MoELayer(m, env)
    dense = MLP(m, env)  # width k f
    for mod in (layer, dense):
        name_parameters(mod)
        with torch.no_grad():
            for p in mod.parameters():
                p.normal_(0, p.shape[-1] ** -0.5)
    return layer, dense


def loop_moe(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Hugging Face Mixtral's way: per expert, the tokens that chose it, two matmuls, added back."""
    b, s, h = x.shape
    t = x.reshape(-1, h)
    logits = F.linear(t, layer.router.weight)
    w, top = logits.softmax(-1).topk(layer.k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    out = torch.zeros_like(t)
    f = layer.f
    for e in range(layer.e):
        token, slot = torch.where(top == e)
        if token.numel() == 0:
            continue
        gu = t[token] @ layer.experts.gate_up.weight[e].T
        y = (F.silu(gu[:, :f]) * gu[:, f:]) @ layer.experts.down.weight[e].T
        out.index_add_(0, token, y * w[token, slot, None])
    return out.view(b, s, h)


def timed(fn, x, g, device) -> float:
    """Seconds of one forward and backward of `fn` on `x`."""
    x = x.detach().requires_grad_(True)
    return seconds(lambda: fn(x).backward(g), device)


def part1(a) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    one = Group("tp", [0], 0, device=device)
    layer, dense = build(a, one, Group("ep", [0], 0, device=device), device)
    x = torch.randn(1, a.tokens, a.hidden, device=device)
    g = torch.randn_like(x)
    with torch.no_grad():
        err = (layer(x) - loop_moe(layer, x)).abs().max().item()
    assert err < 1e-4, f"the loop and the layer disagree by {err}"
    variants = {"megalite": layer, "loop": lambda x: loop_moe(layer, x), "dense": dense}
    times = {k: [] for k in variants}
    names = list(variants)
    for r in range(a.rounds + 1):
        for k in names[r % 3 :] + names[: r % 3]:  # rotate the order each round
            dt = timed(variants[k], x, g, device)
            if r:  # round 0 warms up
                times[k].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "tokens_per_s": {k: a.tokens / v for k, v in med.items()},
        "median_s": med,
        "megalite_over_loop": med["loop"] / med["megalite"],  # >1: megalite faster
        "dense_over_megalite": med["megalite"] / med["dense"],  # the cost of routing
    }


def _part2(rank, world, a):
    from megalite.parallel.groups import build_groups
    from megalite.parallel.topology import Topology

    topo = Topology(dp=world)
    topo.expert = topo.experts(world)
    groups = build_groups(topo, torch.device("cpu"))
    layer, _ = build(a, groups.tp, groups.ep, torch.device("cpu"))
    torch.manual_seed(1 + rank)
    x = torch.randn(1, a.tokens, a.hidden)
    g = torch.randn_like(x)
    steps, comm, nbytes = [], [], 0
    for r in range(a.rounds + 1):
        groups.ledger.reset()
        dt = timed(layer, x, g, torch.device("cpu"))
        s = groups.ledger.seconds
        if r:
            steps.append(dt)
            comm.append(s["ep"] + s["ep_sizes"])
            nbytes = groups.ledger.bytes["ep"]
    return statistics.median(steps), statistics.median(comm), nbytes


def part2(a) -> dict:
    from megalite.testing import spawn

    res = spawn(_part2, 2, a, timeout=1800)
    step = max(r[0] for r in res)
    comm = max(r[1] for r in res)
    return {"ep2_step_s": step, "ep2_all_to_all_s": comm, "all_to_all_share": comm / step,
            "ep_bytes_per_rank": [r[2] for r in res]}  # fmt: skip


def main():
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--kernels", default="auto", choices=("auto", "torch", "triton"))
    p.add_argument("--summary", help="write the figures as JSON here")
    a = p.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    out = {"args": vars(a), **part1(a), **part2(a)}
    out["wall_s"] = time.time() - t0
    out["load_average"] = os.getloadavg()
    print(json.dumps(out, indent=1))
    if a.summary:
        with open(a.summary, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
