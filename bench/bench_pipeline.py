"""Pipeline schedules side by side, and megalite's interleaved 1F1B next to torch's.

    python bench/bench_pipeline.py [--pp 4] [--microbatches 8] [--steps 5]

Runs pp gloo processes on CPU (or NCCL on GPUs) over the real GPTChunk (llama flavour, 8 layers
by default so that pp=4, vpp=2 gives one layer per virtual stage). For each of GPipe, 1F1B and
interleaved (vpp=2) it reports the median step time and the first stage's measured bubble
(idle fraction of the step) next to the theory (pp-1)/(vpp*m + pp-1); then the same model and
split (chunk c of rank r = virtual stage c*pp+r) under torch.distributed.pipelining's
ScheduleInterleaved1F1B. Prints a markdown table.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as Fn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.config import ModelConfig  # noqa: E402
from megalite.model.gpt import GPTChunk  # noqa: E402
from megalite.parallel.groups import build_groups  # noqa: E402
from megalite.parallel.topology import Topology  # noqa: E402
from megalite.pipeline.executor import run_schedule  # noqa: E402
from megalite.pipeline.partition import rank_chunks  # noqa: E402
from megalite.pipeline.schedules import bubble_theory, get_schedule, idle_theory  # noqa: E402


def _cfg(a):
    return ModelConfig(
        flavour="llama", num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=4,
        seq_length=a.seq, vocab_size=a.vocab, make_vocab_size_divisible_by=64,
    )  # fmt: skip


def _data(a, device):
    g = torch.Generator().manual_seed(0)
    shape = (a.micro_batch, a.seq)
    return [
        (torch.randint(a.vocab, shape, generator=g).to(device),
         torch.randint(a.vocab, shape, generator=g).to(device))
        for _ in range(a.microbatches)
    ]  # fmt: skip


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _megalite(a, groups, rank, name, vpp):
    """A function running one step; returns the first stage's measured bubble."""
    cfg, device = _cfg(a), groups.device
    chunks = [GPTChunk(cfg, dtype=torch.float32, device=device, **kw)
              for kw in rank_chunks(a.layers, a.pp, vpp, rank)]  # fmt: skip
    data = _data(a, device)
    actions = get_schedule(name, a.pp, vpp, a.microbatches, rank)
    shape = (a.micro_batch, a.seq, a.hidden)

    def step():
        r = run_schedule(actions, chunks, groups, data, hidden_shape=shape, dtype=torch.float32)
        for c in chunks:
            c.zero_grad(set_to_none=True)
        return r.bubble_measured

    return step


class _TorchStage(nn.Module):
    """torch's stages take one tensor and return one: the head chunk returns logits."""

    def __init__(self, chunk):
        super().__init__()
        self.chunk = chunk

    def forward(self, x):
        return self.chunk(x)


def _torch_interleaved(a, groups, rank, vpp):
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    cfg, device = _cfg(a), groups.device
    kws = rank_chunks(a.layers, a.pp, vpp, rank)
    stages = [
        PipelineStage(_TorchStage(GPTChunk(cfg, dtype=torch.float32, device=device, **kw)),
                      c * a.pp + rank, a.pp * vpp, device, group=groups.pp.pg)
        for c, kw in enumerate(kws)
    ]  # fmt: skip

    def loss_fn(logits, target):  # (b, s, V), (b, s)
        return Fn.cross_entropy(logits.flatten(0, 1).float(), target.flatten())

    schedule = ScheduleInterleaved1F1B(stages, a.microbatches, loss_fn=loss_fn)
    data = _data(a, device)
    tokens = torch.cat([t for t, _ in data])  # the schedule splits along dim 0 again
    labels = torch.cat([lab for _, lab in data])
    args = (tokens,) if rank == 0 else ()
    kwargs = {"target": labels} if rank == a.pp - 1 else {}

    def step():
        schedule.step(*args, **kwargs)
        for s in stages:
            s.submod.zero_grad(set_to_none=True)
        return None

    return step


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
        ("torch ScheduleInterleaved1F1B vpp=2", 2, _torch_interleaved(a, groups, rank, 2)),
    ]
    # round robin, so that every run sees the same (shared, noisy) machine
    times, bubbles = [[] for _ in runs], [[] for _ in runs]
    for rnd in range(a.warmup + a.steps):
        for i, (_, _, step) in enumerate(runs):
            dist.barrier()
            t0 = time.perf_counter()
            bubble = step()
            _sync(device)
            if rnd >= a.warmup:
                times[i].append(time.perf_counter() - t0)
                bubbles[i].append(bubble)
    rows = [
        {"run": label, "vpp": vpp, "step_s": statistics.median(t),
         "bubble": None if b[0] is None else statistics.median(b)}
        for (label, vpp, _), t, b in zip(runs, times, bubbles)
    ]  # fmt: skip
    # the slowest rank's step time counts; bubbles are already the first stage's
    slowest = torch.tensor([r["step_s"] for r in rows], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    for r, t in zip(rows, slowest.tolist()):
        r["step_s"] = t
    if rank == 0:
        with open(f"{tmp}/rows.json", "w") as fh:
            json.dump(rows, fh)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(a, tmp), nprocs=a.pp, start_method="spawn")
        with open(f"{tmp}/rows.json") as fh:
            rows = json.load(fh)
    base = rows[1]["step_s"]  # 1F1B
    print(f"pp={a.pp} m={a.microbatches} micro-batch={a.micro_batch} seq={a.seq} "
          f"hidden={a.hidden} layers={a.layers} | {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    print("| run | step (s) | vs 1F1B | bubble measured | idle theory | (pp-1)/(vpp*m) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        v = r["vpp"]
        measured = "n/a" if r["bubble"] is None else f"{r['bubble']:.3f}"
        print(f"| {r['run']} | {r['step_s']:.3f} | {r['step_s'] / base:.2f} | {measured} | "
              f"{idle_theory(a.pp, v, a.microbatches):.3f} | "
              f"{bubble_theory(a.pp, v, a.microbatches):.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
