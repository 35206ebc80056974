"""Tensor parallelism side by side: megalite at tp=2 against torch DTensor TP, same model.

    .venv/bin/python bench/parallel/bench_tp.py [--layers 8] [--hidden 256] [--heads 4] [--groups 4]
        [--vocab 2048] [--seq 256] [--mbs 4] [--micro 8] [--rounds 5] [--summary PATH]

Two gloo processes on CPU (megalite/testing.py: forkserver, file:// rendezvous, one thread each) run
four variants of one training step, interleaved round by round (the order rotates each round),
after warm-up rounds:

- megalite: `GPTChunk` (llama flavour, torch reference ops) at tp=2, the pipeline executor at
  pp=1 and `DistributedOptimizer` (AdamW, clipping at 1.0), with and without
  `sequence_parallel=True`;
- torch: a plain-module model of the same shape and parameter names (nn.Embedding, nn.RMSNorm,
  nn.Linear; attention, rotary and SwiGLU through the same reference functions as megalite)
  parallelised with `parallelize_module` (ColwiseParallel q/k/v/gate/up, RowwiseParallel
  out/down, a vocab-sharded embedding, a ColwiseParallel head with Shard(-1) logits and
  `loss_parallel()`); with SP, torchtitan's plan (SequenceParallel norms, PrepareModuleInput
  Shard(1) -> Replicate, RowwiseParallel output Shard(1)). torch.optim.AdamW(foreach=True) on
  the DTensor parameters and clipping through torch.nn.utils.get_total_norm (`clip` below:
  without SP the norm weights stay plain tensors, which clip_grad_norm_ cannot stack with
  DTensors).

Both load the same logical weights; one step on the same batch first checks the losses agree.
Reported: each variant's median step time (the slower rank's per step) and the ratios; the bytes
each variant actually put on the wire in one step (TCP payload sent per rank, from the kernel's
per-socket counters, bench/_common.py `tcp_bytes`); megalite's TP traffic as its `CommLedger`
books it (bus bytes per rank, group kind "tp"), broken down by origin and checked against the
formula 8(t-1)/t*b*s*h per layer (a check of the ledger's bookkeeping, not a measurement of
traffic: the wire figure is the measurement); torch's collectives per step (calls and bus
bytes) seen by a TorchDispatchMode. Both counters are in `_tp_traffic.py`.
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megalite.kernels import TORCH_OPS  # noqa: E402

from bench._common import figure, machine, tcp_bytes, timed, write_summary  # noqa: E402
from bench.parallel._tp_torch import TorchGPT, clip, parallelize  # noqa: E402
from bench.parallel._tp_traffic import CollectiveCounter, ledger_by_origin  # noqa: E402
from megalite.config import Config, ModelConfig  # noqa: E402
from megalite.model.env import LayerEnv  # noqa: E402
from megalite.model.gpt import GPTChunk  # noqa: E402
from megalite.parallel.groups import build_groups  # noqa: E402
from megalite.parallel.topology import Topology  # noqa: E402
from megalite.shape import validate  # noqa: E402
from megalite.testing import spawn  # noqa: E402
from megalite.training.build import build_rank  # noqa: E402

LR, WD, BETAS, EPS, CLIP = 3e-4, 0.1, (0.9, 0.95), 1e-8, 1.0
VARIANTS = ("megalite", "megalite-sp", "megalite-sp-overlap", "torch", "torch-sp")


# ---- the four variants as step functions -------------------------------------------------------


def model_config(a) -> ModelConfig:
    return ModelConfig(
        flavour="llama", num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
        num_query_groups=a.groups, seq_length=a.seq, vocab_size=a.vocab,
    )  # fmt: skip


def megalite_side(m, a, groups, sequence_parallel, overlap=False):
    cfg = Config()
    cfg.model = m
    cfg.training.micro_batch_size, cfg.training.global_batch_size = a.mbs, a.mbs * a.micro
    cfg.optimizer.weight_decay, cfg.optimizer.clip_grad = WD, CLIP
    cfg.optimizer.adam_beta1, cfg.optimizer.adam_beta2 = BETAS
    cfg.optimizer.adam_eps = EPS
    cfg.parallel.tp, cfg.parallel.sequence_parallel = groups.tp.size, sequence_parallel
    cfg.parallel.tp_comm_overlap = overlap
    cfg.training.kernels = "torch"
    parts = build_rank(cfg, validate(cfg, groups.topo.world_size), groups)  # 1F1B over a.micro
    (model,), opt = parts.chunks, parts.opt

    def backward(batch):
        opt.zero_grad(parts.microbatches)  # (the run shape's count)
        return parts.run(batch)

    def step(batch):
        loss = backward(batch).loss
        opt.step(LR)
        return loss

    step.model, step.backward, step.opt = model, backward, opt
    return step


def torch_side(m, a, full_state, mesh, sequence_parallel):
    from torch.distributed.tensor.parallel import loss_parallel

    torch.manual_seed(0)
    model = TorchGPT(m)
    model.load_state_dict(full_state)
    parallelize(model, mesh, sequence_parallel)
    params = list(model.parameters())
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=LR,
        betas=BETAS,
        eps=EPS,
        foreach=True,
    )

    def step(batch):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for tokens, labels in batch:
            with loss_parallel():
                logits = model(tokens)  # DTensor (b, s, V) sharded on V
                loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
                (loss / len(batch)).backward()
            total += loss.full_tensor().item()
        clip(params, CLIP)
        opt.step()
        return total / len(batch)

    return step


def variants(m, a, world: int) -> tuple:
    """megalite's process groups and the four step functions (VARIANTS), all loaded with the
    same logical weights."""
    from torch.distributed.device_mesh import init_device_mesh

    groups = build_groups(Topology(tp=world), torch.device("cpu"))
    mesh = init_device_mesh("cpu", (world,))
    full = {
        n: p.detach().clone()
        for n, p in GPTChunk(m, LayerEnv(ops=TORCH_OPS, seed=1234)).named_parameters()
    }
    return groups, {
        "megalite": megalite_side(m, a, groups, False),
        "megalite-sp": megalite_side(m, a, groups, True),
        "megalite-sp-overlap": megalite_side(m, a, groups, True, overlap=True),
        "torch": torch_side(m, a, full, mesh, False),
        "torch-sp": torch_side(m, a, full, mesh, True),
    }


def make_batches(m, a, n: int) -> list:
    """n steps of micro-batches [(tokens, labels)], the same on every rank."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        toks = torch.randint(0, m.vocab_size, (a.micro, a.mbs, m.seq_length + 1), generator=g)
        out.append([(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in toks])
    return out


def run(rank, world, a):
    torch.set_num_threads(1)
    m = model_config(a)
    groups, steps = variants(m, a, world)
    batches = make_batches(m, a, 2)
    out = {"check": {k: s(batches[0]) for k, s in steps.items()}}

    # traffic of one step of each megalite variant, total and by origin
    out["traffic"] = {}
    for name in ("megalite", "megalite-sp", "megalite-sp-overlap"):
        out["traffic"][name] = ledger_by_origin(steps[name], groups, batches[1], LR)

    # torch's collectives per step, counted like megalite's ledger (bus bytes per rank)
    out["torch_comm"] = {}
    for name in ("torch", "torch-sp"):
        with CollectiveCounter() as counter:
            steps[name](batches[1])
        out["torch_comm"][name] = {k: (c, b, sorted(z)) for k, (c, b, z) in counter.by.items()}

    # bytes on the wire in one step of each variant: TCP payload this rank sent and received
    out["wire"] = {}
    for name, step in steps.items():
        dist.barrier()
        time.sleep(0.2)
        s0 = tcp_bytes()
        step(batches[1])
        time.sleep(0.2)  # the last segments leave the socket
        s1 = tcp_bytes()
        out["wire"][name] = (s1[0] - s0[0], s1[1] - s0[1])

    times = {k: [] for k in steps}
    order = list(steps)
    for r in range(a.warmup + a.rounds):
        k = r % len(order)
        for name in order[k:] + order[:k]:  # rotate the order each round
            with timed(barrier=dist.barrier) as one:
                steps[name](batches[r % 2])
            t = torch.tensor(one.wall, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slower rank's step
            if r >= a.warmup:
                times[name].append(t.item())
    out["times"] = times
    return out


# ---- report ------------------------------------------------------------------------------------


def model_args(ap: argparse.ArgumentParser):
    """The model and batch flags (shared with profile_tp.py)."""
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--groups", type=int, default=4, help="key/value heads (GQA)")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--micro", type=int, default=8, help="micro-batches per step")


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    model_args(ap)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--summary", help="write the headline figures as JSON here")
    a = ap.parse_args()
    t = 2
    m = model_config(a)
    print(f"machine: {machine()}; tp=2 on CPU gloo, 2 processes x 1 thread")
    print(f"model: llama L={m.num_layers} h={m.hidden_size} heads={m.num_attention_heads} "
          f"kv={m.heads_kv} ffn={m.ffn} V={m.vocab_size} s={m.seq_length}; {a.micro} micro-batches "
          f"of {a.mbs} per step, fp32")  # fmt: skip
    res = spawn(run, t, a, timeout=1200)
    r0 = res[0]
    print("check (step 1 loss, same batch):",
          ", ".join(f"{k} {v:.6f}" for k, v in r0["check"].items()))  # fmt: skip
    losses = list(r0["check"].values())
    if max(losses) - min(losses) > 1e-3 * abs(losses[0]):
        raise SystemExit("the variants do not compute the same loss; the comparison is void")

    med = {k: statistics.median(v) for k, v in r0["times"].items()}
    tokens = a.micro * a.mbs * m.seq_length

    def speed(k, ref):  # median of the per-round ratios ref / k
        return statistics.median(y / x for x, y in zip(r0["times"][k], r0["times"][ref]))

    # each megalite variant against torch with the same SP (the overlap against torch-sp too)
    pair = {k: speed(k, "torch-sp" if "-sp" in k else "torch") for k in VARIANTS if "megalite" in k}
    pair[""], pair["-sp"] = pair["megalite"], pair["megalite-sp"]
    overlap = speed("megalite-sp-overlap", "megalite-sp")
    print(f"\nstep time, median of {a.rounds} interleaved rounds (slower rank per step), "
          f"{tokens} tokens per step:")  # fmt: skip
    print("| variant | median s/step | min | max | tokens/s | megalite speed vs torch |")
    print("| --- | --- | --- | --- | --- | --- |")
    for k, v in r0["times"].items():
        vs = f"**{pair[k]:.3f}x**" if k.startswith("megalite") else "1.000x"
        print(f"| {k} | {med[k]:.4f} | {min(v):.4f} | {max(v):.4f} | {tokens / med[k]:.0f} | "
              f"{vs} |")  # fmt: skip
    print("(speed = torch's step time / megalite's, median of the per-round ratios; ratio of "
          f"medians: no SP {med['torch'] / med['megalite']:.3f}x, "
          f"SP {med['torch-sp'] / med['megalite-sp']:.3f}x)")  # fmt: skip
    print(f"--tp-comm-overlap against SP without it: {overlap:.3f}x the speed")

    # measured: bytes on the wire (TCP payload per rank) against what each side books
    booked = {n: sum(v["bytes"] for v in r0["traffic"][n]["total"].values())
              for n in VARIANTS if "megalite" in n}  # fmt: skip
    booked.update({n: sum(x[1] for x in r0["torch_comm"][n].values())
                   for n in ("torch", "torch-sp")})  # fmt: skip
    wire = {n: max(r["wire"][n][0] for r in res) for n in r0["wire"]}
    print("\nbytes on the wire in one step (TCP payload sent, the larger rank; measured with the "
          "kernel's per-socket counters) against the bus bytes each side books:")  # fmt: skip
    print("| variant | wire bytes sent | booked bus bytes | wire / booked | wire vs torch |")
    print("| --- | --- | --- | --- | --- |")
    for n in wire:
        ref = wire["torch-sp" if "-sp" in n else "torch"]
        print(f"| {n} | {wire[n]:,} | {booked[n]:,} | {wire[n] / booked[n]:.3f} | "
              f"{wire[n] / ref:.3f}x |")  # fmt: skip

    # the ledger's bookkeeping against the formula (not a traffic measurement)
    b, s, h, L = a.mbs, m.seq_length, m.hidden_size, m.num_layers
    el = 4  # fp32
    bsh = b * s * h
    layer_formula = (
        8 * (t - 1) / t * bsh * el
    )  # bytes per layer, forward + backward, per micro-batch
    print("\nmegalite's ledger (bus bytes it books per rank, kind 'tp') checked against the "
          "formula; this checks the bookkeeping, the wire table above is the measurement:")  # fmt: skip
    ledger_ok = []
    for name in ("megalite", "megalite-sp"):
        tr = r0["traffic"][name]
        total = tr["total"].get("tp", {"bytes": 0, "calls": 0})
        by = tr["by"]
        layers = sum(sum(v) for k, v in by.items() if k.startswith("layer "))
        per_layer = layers / L / a.micro
        ledger_ok.append(per_layer / layer_formula)
        print(f"  {name}: total {total['bytes']:,} B in {total['calls']} calls "
              f"(other kinds: {({k: v['bytes'] for k, v in tr['total'].items() if k != 'tp'})})")  # fmt: skip
        print(f"    layers: {layers:,} B = {per_layer:,.0f} B per layer per micro-batch; "
              f"formula 8(t-1)/t*b*s*h*4 = {layer_formula:,.0f} B -> {per_layer / layer_formula:.4f}x")  # fmt: skip
        for k, sizes in by.items():
            if not k.startswith("layer "):
                nb = sum(sizes)
                print(f"    {k}: {nb:,} B in {len(sizes)} calls {sorted(set(sizes))} "
                      f"({nb / a.micro / (bsh * el):.4f} x b*s*h*4 per micro-batch)")  # fmt: skip
    print("\ntorch DTensor collectives per step (functional collectives seen by a dispatch mode):")
    for k, v in r0["torch_comm"].items():
        total = sum(x[1] for x in v.values())
        print(
            f"  {k}: total {total:,} B in {sum(x[0] for x in v.values())} calls; "
            + "; ".join(f"{op} {c} calls {nb:,} B (sizes {z})" for op, (c, nb, z) in v.items())
        )
    how = f"bench_tp.py, median of {a.rounds} interleaved per-round ratios"
    figures = [
        figure("TP=2 tokens/s, megalite vs DTensor TP", round(pair[""], 3), target=">= 1.4x",
               met=pair[""] >= 1.4, how=how),
        figure("TP=2 tokens/s with SP, megalite vs DTensor TP + SP", round(pair["-sp"], 3),
               target=">= 1.4x", met=pair["-sp"] >= 1.4, how=how),
        figure("TP=2 SP tokens/s, --tp-comm-overlap vs without", round(overlap, 3), how=how),
        figure("TP=2 bytes on the wire per step, megalite vs DTensor", round(wire["megalite"] / wire["torch"], 3),
               how="TCP payload sent per rank in one step (kernel socket counters)"),
        figure("TP=2 bytes on the wire per step with SP, megalite vs DTensor",
               round(wire["megalite-sp"] / wire["torch-sp"], 3),
               how="TCP payload sent per rank in one step (kernel socket counters)"),
        figure("TP ledger bytes per layer / 8(t-1)/t*b*s*h (bookkeeping check, not traffic)",
               round(max(ledger_ok), 4), target="1.0", met=all(abs(x - 1) < 1e-3 for x in ledger_ok),
               how="CommLedger kind tp, layers only"),
    ]  # fmt: skip
    write_summary(a.summary, "bench_tp", figures, " ".join(sys.argv))
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
