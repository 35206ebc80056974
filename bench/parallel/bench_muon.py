"""Muon's optimizer step, side by side: every holder of a matrix orthogonalising it (what
megalite did before: the update all-gathered over dp, then tp, one Newton-Schulz per holder)
against one owner per matrix (optim/muon_owners.py: its update sent to the owner, the result's
pieces back).

    .venv/bin/python bench/parallel/bench_muon.py [--layers 2] [--hidden 384] [--ffn 1536]
        [--steps 5] [--repeats 3] [--summary PATH]

Two gloo processes on CPU (one thread each) per layout, dp2 at ZeRO-1 and tp2: a llama-flavour
`GPTChunk` (fp32, torch ops), one forward and backward, then `DistributedOptimizer.step` timed
alone, --steps times per repeat after one warm-up, the two ways alternating in the same
processes. Reported: the median step of the slower rank, per way, and before / after, and the
Newton-Schulz runs of each rank in a step (at ZeRO-1 a rank only ever ran the matrices its
shard touches: the repeated work is the matrices cut by a shard edge). The two ways'
parameters after one step from the same state agree within 1e-6 (checked, or it stops).
"""

import argparse
import os
import statistics
import sys
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench._common import figure, machine, timed, write_summary  # noqa: E402
from megalite.config import Config, ModelConfig  # noqa: E402
from megalite.optim import muon  # noqa: E402
from megalite.parallel import comm  # noqa: E402
from megalite.parallel.specs import spec_of  # noqa: E402
from megalite.testing import spawn  # noqa: E402

LAYOUTS = {
    "dp2 zero0": {"dp": 2, "zero": 0},
    "dp2 zero1": {"dp": 2, "zero": 1},
    "tp2": {"tp": 2, "zero": 0},
}


@torch.no_grad()
def repeated_step(self, weights, grads, lr: float, step: int):
    """MuonState.step as it was: each bucket's update all-gathered over dp, each matrix over
    tp, every holder orthogonalising the whole matrix and keeping its piece."""
    o = self.o
    w, g, m, v, decayed = [], [], [], [], []
    for i, lo, hi, at, decay in self.adam:
        w += [weights[i][lo:hi]]
        g += [grads[i][lo:hi]]
        m += [self.exp_avg[i][lo:hi]]
        v += [self.exp_avg_sq[i][at : at + hi - lo]]
        decayed += [w[-1]] if decay else []
    muon.adamw(w, g, m, v, decayed, lr, step, o)
    for i in sorted(self.plans):
        b, mats = self.buffer.buckets[i], self.matrices_of.get(i, [])
        update = torch.zeros_like(self.exp_avg[i])
        for _, _, (lo, hi, _, _), _, _ in mats:
            mom, grad = self.exp_avg[i][lo:hi], grads[i][lo:hi]
            mom.lerp_(grad, 1 - o.muon_momentum)
            update[lo:hi] = grad.lerp(mom, o.muon_momentum) if o.muon_nesterov else mom
        full = update
        if update.numel() < b.numel:
            full = update.new_empty(b.numel)
            comm.all_gather(full, update, self.buffer.group_of(b))
        for r, _, (lo, hi, plo, phi), s, decay in mats:
            spec, start = spec_of(r.param), r.offset - b.start
            local = full[start : start + r.param.numel()].view(r.param.shape)
            split = spec.split_axis == "tp" and spec.split_size > 1
            whole = local
            if split:
                t = self.tp.size
                out = local.new_empty(t * local.numel())
                comm.all_gather(out, local.reshape(-1).contiguous(), self.tp)
                whole = torch.cat(out.view(t, *local.shape).unbind(0), dim=spec.split_dim)
            out = muon.orthogonalise(whole, 1, o)[0]
            mine = (spec.local(out) if split else out).reshape(-1)[plo:phi]
            piece = weights[i][lo:hi]
            if decay and o.weight_decay:
                piece.mul_(1 - lr * o.weight_decay)
            piece.add_(mine.to(piece.dtype), alpha=-lr * s)


def _run(rank, world, args, layout):
    from megalite.model.env import LayerEnv
    from megalite.model.gpt import GPTChunk
    from megalite.optim.distributed_optimizer import build_optimizer
    from megalite.parallel.groups import build_groups
    from megalite.parallel.topology import Topology

    flags = LAYOUTS[layout]
    cfg = Config()
    cfg.model = ModelConfig(flavour="llama", num_layers=args.layers, hidden_size=args.hidden,
                            num_attention_heads=8, num_query_groups=8, ffn_hidden_size=args.ffn,
                            seq_length=64, vocab_size=512)  # fmt: skip
    cfg.optimizer.optimizer, cfg.optimizer.zero_stage = "muon", flags["zero"]
    tp, dp = flags.get("tp", 1), flags.get("dp", 1)
    groups = build_groups(Topology(tp=tp, dp=dp), torch.device("cpu"))
    torch.manual_seed(0)
    chunk = GPTChunk(
        cfg.model,
        LayerEnv(tp=groups.tp),
        layers=range(args.layers),
        has_embedding=True,
        has_head=True,
    )
    opt = build_optimizer([chunk], groups, cfg)
    tokens = torch.randint(512, (2, 64), generator=torch.Generator().manual_seed(rank // tp))
    opt.zero_grad(1)
    chunk(tokens, labels=tokens).mean().backward()
    opt.finalise_grads()
    grads = [b.shard_grad.clone() for b in opt.buffer.buckets]
    owned = opt.muon.step
    ways = {"repeated": types.MethodType(repeated_step, opt.muon), "owned": owned}
    params = [p for p in chunk.parameters()]

    def once(way):
        for b, g in zip(opt.buffer.buckets, grads):
            b.shard_grad.copy_(g)
        opt.muon.step = ways[way]
        with timed() as t:
            opt.step(1e-3)
            opt.wait_params()  # (ZeRO-1's parameter gather, the same for both)
        return t.wall

    start = [p.detach().clone() for p in params]
    state = [t.clone() for t in opt.muon.tensors()]
    after, runs, ns = {}, [], muon.orthogonalise
    muon.orthogonalise = lambda *a: (runs.append(1), ns(*a))[1]  # counted, this step only
    for way in ways:  # the same step from the same state: the same parameters
        for p, s in zip(params, start):
            p.data.copy_(s)
        for t, s in zip(opt.muon.tensors(), state):
            t.copy_(s)
        opt.step_count, before = 0, len(runs)
        once(way)
        after[way] = [p.detach().clone() for p in params]
        after[f"{way} runs"] = len(runs) - before
    muon.orthogonalise = ns
    err = max((a - b).abs().max().item() for a, b in zip(after["repeated"], after["owned"]))
    if err > 1e-6:
        raise SystemExit(f"{layout}: the two ways differ by {err}")
    times = {way: [] for way in ways}
    for _ in range(args.repeats):
        for way in ways:
            once(way)  # warm-up
            times[way] += [once(way) for _ in range(args.steps)]
    out = {way: statistics.median(t) for way, t in times.items()}
    return {**out, **{f"{way} runs": after[f"{way} runs"] for way in ways}}


def main():
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--ffn", type=int, default=1536)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--summary", default=None)
    args = p.parse_args()
    print(machine())
    print(f"llama, {args.layers} layers, hidden {args.hidden}, ffn {args.ffn}, fp32, gloo, "
          f"2 processes, 1 thread each; optimizer step, median of the slower rank")  # fmt: skip
    print(f"{'layout':<12} {'repeated NS':>12} {'one owner':>12} {'before/after':>13} "
          f"{'NS runs per rank, before -> after':>34}")  # fmt: skip
    figures = []
    for layout in LAYOUTS:
        ranks = spawn(_run, 2, args, layout, timeout=1800)
        t = {way: max(r[way] for r in ranks) for way in ("repeated", "owned")}
        ratio = t["repeated"] / t["owned"]
        runs = {w: "/".join(str(r[f"{w} runs"]) for r in ranks) for w in ("repeated", "owned")}
        print(f"{layout:<12} {t['repeated'] * 1e3:>10.1f}ms {t['owned'] * 1e3:>10.1f}ms "
              f"{ratio:>12.2f}x {runs['repeated'] + ' -> ' + runs['owned']:>34}")  # fmt: skip
        figures.append(figure(f"muon step {layout}: repeated / owned", round(ratio, 2)))
    write_summary(args.summary, "muon", figures, " ".join(sys.argv))


if __name__ == "__main__":
    main()
