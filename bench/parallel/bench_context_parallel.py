"""Context parallelism side by side: activation memory per rank and throughput at cp = 1, 2, 4.

    .venv/bin/python bench/parallel/bench_context_parallel.py [--seq 4096] [--layers 2] [--hidden 256]
        [--heads 8] [--groups 4] [--comm p2p] [--cps 1,2,4] [--rounds 3] [--summary PATH]

One long sequence (micro-batch of 1) through a llama-flavoured `GPTChunk` (torch reference ops,
fp32) on cp gloo processes on CPU (megalite/testing.py: one thread each), each rank holding s/cp
tokens (chunks i and 2cp-1-i, `shard_batch`) and running ring (or all-to-all) attention over the
cp group. For each cp:

- activation bytes per rank: every tensor autograd keeps for backward during one forward
  (saved-tensor hooks, each storage counted once): what context parallelism divides; the
  parameters are the same on every rank and not counted. Beside it, the planner's estimate
  (`activations.chunk_activations`, torch ops) and the ratio to cp = 1;
- tokens/s: one forward and backward of the whole sequence, the slowest rank's median over the
  rounds after a warm-up round, and the ratio to cp = 1. On a 2-core machine cp = 4 runs four
  processes on two cores: its throughput is a lower bound, the memory figures are exact;
- the bytes each rank sends over cp per step (the CommLedger) and the planner's count;
- the exposed share of the ring: the time each rank waited for ring hops (the timeline's "cp"
  spans: what the hop left after the block computed while it travelled) over the time of
  forward and backward, averaged over ranks and rounds.
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench._common import figure, machine, write_summary  # noqa: E402
from megalite.config import Config, ModelConfig  # noqa: E402
from megalite.parallel.context_parallel import shard_batch  # noqa: E402
from megalite.parallel.groups import build_groups  # noqa: E402
from megalite.parallel.topology import Topology  # noqa: E402
from megalite.plan import activations, layouts, traffic  # noqa: E402
from megalite.shape import validate  # noqa: E402
from megalite.testing import spawn  # noqa: E402
from megalite.training import timeline  # noqa: E402
from megalite.training.build import parallelize  # noqa: E402


def _model_cfg(a) -> ModelConfig:
    return ModelConfig(flavour="llama", num_layers=a.layers, hidden_size=a.hidden,
                       num_attention_heads=a.heads, num_query_groups=a.groups,
                       seq_length=a.seq, vocab_size=2048)  # fmt: skip


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves for backward while fn() runs."""
    seen = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    params = {p.untyped_storage().data_ptr() for p in _saved_bytes.model.parameters()}
    return out, sum(n for ptr, n in seen.items() if ptr not in params)


def _rank(rank, world, a):
    groups = build_groups(Topology(cp=world), torch.device("cpu"))
    run = Config()
    run.model, run.parallel.cp, run.parallel.cp_comm_type = _model_cfg(a), world, a.comm
    run.training.micro_batch_size, run.training.global_batch_size = 1, 1
    run.training.kernels, run.training.seed = "torch", 1
    # s/cp tokens of each sequence
    (model,), _ = parallelize(run, validate(run, world), groups, data_parallel=False)
    cfg = run.model
    _saved_bytes.model = model
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, a.seq + 1), generator=g)
    ((tokens, labels, *shard),) = shard_batch([(ids[:, :-1], ids[:, 1:])], world, rank)
    kw = {"shard": shard[0]} if shard else {}
    times, saved = [], 0
    tl = timeline.Timeline((1, a.rounds + 2), rank, groups.topo.coords(rank))
    for r in range(a.rounds + 1):
        model.zero_grad()
        groups.ledger.reset()
        torch.distributed.barrier()
        t0 = time.perf_counter()
        with groups.ledger.recording(tl.at(r + 1)):  # the ring records the hops it waited for
            loss, saved = _saved_bytes(lambda: model(tokens, labels, **kw))
            loss.backward()
        tl.record("schedule", t0, time.perf_counter())
        t = torch.tensor([time.perf_counter() - t0])
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)  # the slowest rank
        if r:  # the first round warms up
            times.append(t.item())
    spans = [s for s in tl.relative_spans() if s["step"] > 1]  # after the warm-up round
    exposed = timeline.exposed_share({"ranks": [{"spans": spans}]})
    return saved, statistics.median(times), groups.ledger.bytes.get("cp", 0), exposed


def _planned(a, cp: int) -> tuple[float, int]:
    cfg = Config()
    cfg.model = _model_cfg(a)
    cfg.training.micro_batch_size, cfg.training.kernels = 1, "torch"
    cfg.parallel.cp_comm_type = a.comm
    lay = layouts.layout(cfg, cp=cp)
    kw = {"layers": list(range(a.layers)), "has_embedding": True, "has_head": True}
    fwd, bwd = traffic.cp_layer_bytes(cfg, lay)
    return activations.chunk_activations(cfg, lay, kw)[0], a.layers * (fwd + bwd)


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--comm", choices=("p2p", "a2a"), default="p2p")
    ap.add_argument("--cps", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--summary", default=None)
    a = ap.parse_args()
    print(machine())
    print(f"seq {a.seq}, {a.layers} layers, hidden {a.hidden}, {a.heads} heads ({a.groups} kv), "
          f"fp32, torch ops, cp attention {a.comm}\n")  # fmt: skip
    rows = []
    for cp in map(int, a.cps.split(",")):
        out = spawn(_rank, cp, a, timeout=1800)
        saved = max(o[0] for o in out)
        step = out[0][1]
        sent = max(o[2] for o in out)
        exposed = statistics.mean(o[3] for o in out)
        plan_act, plan_sent = _planned(a, cp)
        rows.append((cp, saved, plan_act, a.seq / step, sent, plan_sent, exposed))
    base_mem, base_tps = rows[0][1], rows[0][3]
    head = f"{'cp':>3} {'activations/rank':>17} {'x cp=1':>7} {'planned':>12} {'tokens/s':>9} "
    print(head + f"{'x cp=1':>7} {'cp bytes/rank':>14} {'planned':>12} {'cp exposed':>10}")
    for cp, saved, plan_act, tps, sent, plan_sent, exposed in rows:
        print(f"{cp:>3} {saved / 2**20:>13.1f} MiB {saved / base_mem:>7.3f} "
              f"{plan_act / 2**20:>8.1f} MiB {tps:>9.0f} {tps / base_tps:>7.2f} "
              f"{sent / 2**20:>10.1f} MiB {plan_sent / 2**20:>8.1f} MiB {exposed:>10.1%}")  # fmt: skip
    # not exactly 1/cp: the q/k/v and gate/up weights that fused_column_linear keeps for
    # backward (counted by the hooks) are the same on every rank
    figures = [
        figure(
            f"activation bytes per rank at cp={cp} over cp=1",
            round(saved / base_mem, 3),
            how="saved-tensor hooks, one forward",
        )  # fmt: skip
        for cp, saved, *_ in rows[1:]
    ]
    figures += [figure(f"tokens/s at cp={cp} over cp=1", round(tps / base_tps, 2))
                for cp, _, _, tps, *_ in rows[1:]]  # fmt: skip
    figures += [figure(f"ring hops exposed at cp={cp}, share of forward+backward",
                       round(exposed, 3), how="timeline cp spans / schedule")
                for cp, *_, exposed in rows[1:]]  # fmt: skip
    write_summary(a.summary, "context_parallel", figures, " ".join(sys.argv))


if __name__ == "__main__":
    main()
