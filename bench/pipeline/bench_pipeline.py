"""Pipeline schedules side by side, and megalite's 1F1B and interleaved 1F1B next to torch's.

    python bench/pipeline/bench_pipeline.py [--pp 2] [--microbatches 8] [--micro-batch 4] [--seq 256]
        [--layers 8] [--hidden 256] [--vocab 2048] [--steps 5] [--summary PATH]
        [--timeline-dir DIR] [--only LABEL ...]

Runs pp gloo processes on CPU (or NCCL on GPUs; one thread each) over the real GPTChunk (llama
flavour, fp32). Each rank builds every variant over the same weights (the same seed):

- megalite GPipe, 1F1B, interleaved (vpp=2), ZB-H1 and ZB-V, run by the pipeline executor;
- torch.distributed.pipelining's Schedule1F1B (one stage per rank) and ScheduleInterleaved1F1B
  (chunk c of rank r = virtual stage c*pp + r, megalite's split), the loss a cross entropy over
  the head's logits;
- the zero-bubble schedules: megalite's zb-h1 and zbv against torch's
  ScheduleInterleavedZeroBubble (interleaved placement) and ScheduleZBVZeroBubble (the same V
  placement as megalite's zbv: chunk 0 at stage r, chunk 1 at 2pp-1-r);
- megalite's dualpipev against torch's ScheduleDualPipeV (the same V).

A step is one schedule (forward and backward of every micro-batch, with the p2p exchange) plus
zeroing the gradients; no optimizer (the same for both). The variants take turns, one step each
per round (1 warm-up round, then --steps rounds), so that all see the same machine; a step's
time is the slowest rank's. For each megalite run the first stage's measured idle share of
the step (`executor.idle_share` of its `first_stage_times`) is given beside its schedule's
theory as a share of the step ((pp-1)/(vpp*m + pp-1) for 1F1B and interleaved; torch's rows show that formula),
and, from a `megalite.training.timeline.Timeline` recorded during the timed steps, its exposed
communication: the share of the first stage's schedule spent blocked in p2p waits (the
receives it waited for and the sends still in flight at the end). Prints markdown tables.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as Fn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench._common import figure, machine, timed, write_summary  # noqa: E402
from megalite.clock import Clock  # noqa: E402
from megalite.config import ModelConfig  # noqa: E402
from megalite.model.env import LayerEnv  # noqa: E402
from megalite.model.gpt import GPTChunk  # noqa: E402
from megalite.parallel.groups import build_groups  # noqa: E402
from megalite.parallel.topology import Topology  # noqa: E402
from megalite.pipeline.executor import first_stage_times, idle_share, run_schedule  # noqa: E402
from megalite.pipeline.partition import rank_chunks  # noqa: E402
from megalite.pipeline.schedules import (  # noqa: E402
    SCHEDULES,
    bubble_theory,
    get_schedule,
    idle_theory,
)
from megalite.training.timeline import COMPUTE, P2P, Timeline  # noqa: E402


def _cfg(a):
    return ModelConfig(
        flavour="llama", num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
        seq_length=a.seq, vocab_size=a.vocab,
    )  # fmt: skip


def _data(a, device):
    g = torch.Generator().manual_seed(0)
    shape = (a.micro_batch, a.seq)
    return [
        (torch.randint(a.vocab, shape, generator=g).to(device),
         torch.randint(a.vocab, shape, generator=g).to(device))
        for _ in range(a.microbatches)
    ]  # fmt: skip


def _megalite(a, groups, rank, name, vpp):
    """A function running one step; returns the PipelineResult."""
    cfg, device = _cfg(a), groups.device
    placement = SCHEDULES[name].placement
    chunks = [GPTChunk(cfg, LayerEnv(dtype=torch.float32, device=device, seed=1234), **kw)
              for kw in rank_chunks(a.layers, a.pp, vpp, rank, placement)]  # fmt: skip
    data = _data(a, device)
    actions = get_schedule(name, a.pp, vpp, a.microbatches, rank)
    shape = (a.micro_batch, a.seq, a.hidden)

    def step(timeline=None):
        r = run_schedule(actions, chunks, groups, data, hidden_shape=shape, dtype=torch.float32,
                         timeline=timeline, placement=placement)  # fmt: skip
        for c in chunks:
            c.zero_grad(set_to_none=True)
        return r

    return step


class _TorchStage(nn.Module):
    """torch's stages take one tensor and return one: the head chunk returns logits."""

    def __init__(self, chunk):
        super().__init__()
        self.chunk = chunk

    def forward(self, x):
        return self.chunk(x)


def _torch(a, groups, rank, vpp, kind="1f1b"):
    """torch's schedule `kind` (1f1b: Schedule1F1B or, at vpp 2, ScheduleInterleaved1F1B;
    zb: ScheduleInterleavedZeroBubble; zbv: ScheduleZBVZeroBubble and dualpipev:
    ScheduleDualPipeV, chunks in megalite's V)."""
    from torch.distributed.pipelining import PipelineStage, schedules

    cfg, device = _cfg(a), groups.device
    placement = SCHEDULES["zbv" if kind in ("zbv", "dualpipev") else "interleaved"].placement
    kws = rank_chunks(a.layers, a.pp, vpp, rank, placement)
    stages = [
        PipelineStage(_TorchStage(GPTChunk(cfg, LayerEnv(dtype=torch.float32, device=device, seed=1234), **kw)),
                      placement(a.pp, vpp, rank, c), a.pp * vpp, device, group=groups.pp.pg)
        for c, kw in enumerate(kws)
    ]  # fmt: skip

    def loss_fn(logits, target):  # (b, s, V), (b, s)
        return Fn.cross_entropy(logits.flatten(0, 1).float(), target.flatten())

    if kind == "1f1b" and vpp == 1:
        schedule = schedules.Schedule1F1B(stages[0], a.microbatches, loss_fn=loss_fn)
    else:
        cls = {"1f1b": "ScheduleInterleaved1F1B", "zb": "ScheduleInterleavedZeroBubble",
               "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}[kind]  # fmt: skip
        schedule = getattr(schedules, cls)(stages, a.microbatches, loss_fn=loss_fn)
    data = _data(a, device)
    tokens = torch.cat([t for t, _ in data])  # the schedule splits along dim 0 again
    labels = torch.cat([lab for _, lab in data])
    holds = {placement(a.pp, vpp, rank, c) for c in range(vpp)}  # this rank's virtual stages
    args = (tokens,) if 0 in holds else ()
    kwargs = {"target": labels} if a.pp * vpp - 1 in holds else {}

    def step(timeline=None):
        schedule.step(*args, **kwargs)
        for s in stages:
            s.submod.zero_grad(set_to_none=True)
        return None

    return step


def _exposed(tl: Timeline) -> list[dict]:
    """Per profiled step of this rank: schedule seconds, compute seconds, p2p-wait seconds."""
    out = {}
    for s in tl.relative_spans():
        d = out.setdefault(s["step"], {"schedule": 0.0, "compute": 0.0, "wait": 0.0})
        dt = s["end"] - s["start"]
        if s["kind"] == "schedule":
            d["schedule"] += dt
        elif s["kind"] in COMPUTE:
            d["compute"] += dt
        elif s["kind"] in P2P:
            d["wait"] += dt
    return [out[k] for k in sorted(out)]


def _save_timeline(a, label, ranks):
    """timeline_<run>.json and .png (megalite.training.timeline's format) in a.timeline_dir."""
    from megalite.training.timeline import plot_timeline

    first = min(s["start"] for r in ranks for s in r["spans"])
    for r in ranks:  # each rank's clock from its own first span: align the starts
        r["spans"] = [{**s, "start": s["start"] - first, "end": s["end"] - first}
                      for s in r["spans"]]  # fmt: skip
    vpp = 2 if "interleaved" in label else 1
    name = label.split()[1].lower()
    data = {"version": 1, "steps": [1, 2], "ranks": ranks,
            "meta": {"title": f"{label}, pp={a.pp} m={a.microbatches} (one step, CPU gloo)",
                     "bubble_theory": bubble_theory(a.pp, vpp, a.microbatches)}}  # fmt: skip
    os.makedirs(a.timeline_dir, exist_ok=True)
    with open(os.path.join(a.timeline_dir, f"timeline_{name}.json"), "w") as fh:
        json.dump(data, fh)
    try:
        plot_timeline(data, os.path.join(a.timeline_dir, f"timeline_{name}.png"))
    except ImportError:
        pass


def _worker(rank, a, tmp):
    torch.set_num_threads(1)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{tmp}/rdv", rank=rank, world_size=a.pp)
    groups = build_groups(Topology(pp=a.pp), device)
    runs = [
        ("megalite GPipe", 1, _megalite(a, groups, rank, "gpipe", 1)),
        ("megalite 1F1B", 1, _megalite(a, groups, rank, "1f1b", 1)),
        ("megalite interleaved vpp=2", 2, _megalite(a, groups, rank, "interleaved", 2)),
        ("torch Schedule1F1B", 1, _torch(a, groups, rank, 1)),
        ("torch ScheduleInterleaved1F1B vpp=2", 2, _torch(a, groups, rank, 2)),
        ("megalite zb-h1", 1, _megalite(a, groups, rank, "zb-h1", 1)),
        ("megalite zbv", 2, _megalite(a, groups, rank, "zbv", 2)),
        ("torch ScheduleInterleavedZeroBubble vpp=2", 2, _torch(a, groups, rank, 2, "zb")),
        ("torch ScheduleZBVZeroBubble", 2, _torch(a, groups, rank, 2, "zbv")),
        ("megalite dualpipev", 2, _megalite(a, groups, rank, "dualpipev", 2)),
        ("torch ScheduleDualPipeV", 2, _torch(a, groups, rank, 2, "dualpipev")),
    ]
    runs = [r for r in runs if a.only is None or any(o in r[0] for o in a.only)]
    timelines = {label: Timeline((1, 10**9), rank, clock=Clock(device)) for label, _, _ in runs}
    # round robin, so that every run sees the same (shared, noisy) machine
    times, bubbles, waits = ([[] for _ in runs] for _ in range(3))
    for rnd in range(a.warmup + a.steps):
        for i, (label, _, step) in enumerate(runs):
            measured = rnd >= a.warmup
            tl = timelines[label].at(rnd + 1) if measured and label.startswith("megalite") else None
            with timed(device, barrier=dist.barrier) as t:
                r = step(tl)
            elapsed = t.wall
            if measured:
                times[i].append(elapsed)
                # every pp rank reads the result: its figures are one all-reduce over pp
                bubbles[i].append(
                    None if r is None else idle_share(*first_stage_times([r], groups.pp))
                )
                waits[i].append(None if r is None else r.wait_s / max(r.step_s, 1e-12))
    rows = []
    for (label, vpp, _), t, b, w in zip(runs, times, bubbles, waits):
        exposed = _exposed(timelines[label]) if label.startswith("megalite") else []
        rows.append({
            "run": label, "vpp": vpp, "times": t,
            "bubble": None if b[0] is None else statistics.median(b),
            "wait_share": None if w[0] is None else statistics.median(w),
            "exposed": None if not exposed else statistics.median(
                e["wait"] / e["schedule"] for e in exposed),
            "compute_share": None if not exposed else statistics.median(
                e["compute"] / e["schedule"] for e in exposed),
        })  # fmt: skip
    if a.timeline_dir:  # every rank's spans of the last timed step, per megalite run
        for label, _, _ in runs:
            if not label.startswith("megalite"):
                continue
            tl = timelines[label]
            spans = [s for s in tl.relative_spans() if s["step"] == a.warmup + a.steps]
            mine = {"rank": rank, "coords": {"tp": 0, "pp": rank, "dp": 0}, "spans": spans}
            ranks = [None] * a.pp
            dist.all_gather_object(ranks, mine)
            if rank == 0:
                _save_timeline(a, label, ranks)
    # the slowest rank's step time counts, step by step; bubble and exposure: the first stage's
    for r in rows:
        t = torch.tensor(r["times"], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        r["times"] = t.tolist()
    if rank == 0:
        with open(f"{tmp}/rows.json", "w") as fh:
            json.dump(rows, fh)
    dist.barrier()
    dist.destroy_process_group()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument(
        "--only", nargs="+", help="run only the variants whose label contains one of these"
    )
    p.add_argument("--summary", help="write the headline figures as JSON here")
    p.add_argument(
        "--timeline-dir", help="write each megalite run's last step as timeline_*.json/png"
    )
    return p


def main(argv=None):
    a = parser().parse_args(argv)
    print(f"machine: {machine()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(a, tmp), nprocs=a.pp, start_method="spawn")
        with open(f"{tmp}/rows.json") as fh:
            rows = json.load(fh)
    tokens = a.microbatches * a.micro_batch * a.seq
    by = {r["run"]: r for r in rows}
    med = {r["run"]: statistics.median(r["times"]) for r in rows}
    base = med.get("megalite 1F1B", next(iter(med.values())))
    print(f"pp={a.pp} m={a.microbatches} micro-batch={a.micro_batch} seq={a.seq} "
          f"hidden={a.hidden} layers={a.layers} vocab={a.vocab}: {tokens} tokens per step; "
          f"median of {a.steps} rounds; load average after {os.getloadavg()[0]:.1f}")  # fmt: skip
    print("| run | step (s) | tokens/s | vs megalite 1F1B | idle share measured | idle theory | "
          "exposed p2p wait | compute share |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        v, t = r["vpp"], med[r["run"]]

        def pct(x):
            return "n/a" if x is None else f"{x:.1%}"

        bubble, theory = "n/a", idle_theory(a.pp, v, a.microbatches)
        if r["bubble"] is not None:  # a megalite run: its schedule's own theory, as a share
            bubble = f"{r['bubble']:.3f}"
            x = bubble_theory(a.pp, v, a.microbatches, r["run"].split()[1].lower())
            theory = x / (1 + x)
        print(f"| {r['run']} | {t:.3f} | {tokens / t:.0f} | {t / base:.2f} | {bubble} | "
              f"{theory:.3f} | {pct(r['exposed'])} | {pct(r['compute_share'])} |")  # fmt: skip
    print(f"(Megatron's bubble (pp-1)/(vpp*m): {bubble_theory(a.pp, 1, a.microbatches):.3f} at "
          f"vpp=1, {bubble_theory(a.pp, 2, a.microbatches):.3f} at vpp=2; exposed p2p wait from "
          "the Timeline, cross-check PipelineResult.wait_s/step_s: "
          + ", ".join(f"{r['run']} {r['wait_share']:.1%}" for r in rows if r["wait_share"] is not None)
          + ")")  # fmt: skip
    figures = []
    pairs = [("megalite 1F1B", "torch Schedule1F1B"),
             ("megalite interleaved vpp=2", "torch ScheduleInterleaved1F1B vpp=2"),
             ("megalite zbv", "torch ScheduleZBVZeroBubble"),
             ("megalite zbv", "torch ScheduleInterleavedZeroBubble vpp=2"),
             ("megalite dualpipev", "torch ScheduleDualPipeV")]  # fmt: skip
    for ours, theirs in pairs:
        if ours in by and theirs in by:
            x = statistics.median(b / o for o, b in zip(by[ours]["times"], by[theirs]["times"]))
            print(f"{ours} vs {theirs}: tokens/s ratio {x:.3f}x (median of per-round ratios; "
                  f"ratio of medians {med[theirs] / med[ours]:.3f}x)")  # fmt: skip
            goal = 1.0 if "zbv" in ours or "dualpipev" in ours else 1.1  # the issues' targets
            figures.append(figure(
                f"pp={a.pp} tokens/s, {ours} vs {theirs}", round(x, 3), target=f">= {goal}x",
                met=x >= goal, how=f"bench_pipeline.py, median of {a.steps} per-round ratios",
            ))  # fmt: skip
    for r in rows:
        if r["exposed"] is not None:
            figures.append(figure(
                f"pp={a.pp} {r['run']}: first stage's schedule blocked in p2p waits",
                round(r["exposed"], 3), unit="share",
                how="Timeline spans send/recv over the schedule span, median of timed steps",
            ))  # fmt: skip
    write_summary(a.summary, "bench_pipeline", figures, " ".join(sys.argv))


if __name__ == "__main__":
    main()
