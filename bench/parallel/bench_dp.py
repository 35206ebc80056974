"""Data parallelism side by side: megalite ZeRO 0/1/2 against torch DDP and FSDP2 at dp=2.

    .venv/bin/python bench/parallel/bench_dp.py [--layers 8] [--hidden 256] [--heads 4] [--seq 256]
        [--vocab 2048] [--gbs 32] [--mbs 4] [--bucket-mb 4] [--rounds 5] [--block 2]
        [--methods ddp zero0 zero1 zero2 fsdp2] [--summary PATH]

Two gloo processes on CPU (megalite/testing.py, one thread each) hold one model per method, all the
same `GPTChunk` (llama flavour, torch reference ops, fp32) with the same initial weights, and
train on the same data (each rank its own half of the global batch, in gbs/(2*mbs) micro-batches).
A step: zero the gradients, forward + backward of every micro-batch (loss / m), clip the global
norm at 1.0, AdamW (lr 1e-4, betas 0.9/0.95, weight decay 0.1 except norms); the sides'
steps are `_dp_sides.py`:

- megalite zero0/1/2: the pipeline executor at pp=1 (what the trainer runs) and
  `DistributedOptimizer` (flat buffers; ZeRO-1/2 gather the updated parameters overlapped with
  the next forward, as by default);
- ddp: `DistributedDataParallel(gradient_as_bucket_view=True)`, `no_sync()` on all but the last
  micro-batch, torch.optim.AdamW(foreach=True; `--torch-adamw fused|single` for the others),
  clip_grad_norm_(foreach=True);
- fsdp2: `fully_shard` per layer and the root, `reshard_after_forward=False`, and the
  parameters kept gathered from one micro-batch to the next (`set_reshard_after_backward(False)`
  until the last): one parameter all-gather per step and a reduce-scatter per micro-batch, as
  megalite's ZeRO-2 does; the same foreach AdamW and clipping on its DTensors.

Gradient buckets are --bucket-mb on every side (DDP's bucket_cap_mb, megalite's bucket size;
FSDP2 communicates per layer). The methods take turns in one pair of processes: each round runs
--block consecutive steps of every method (the order rotates), after warm-up rounds; a method's
step time is its block's time / block, the slower rank's, median over rounds. One first step of
each on the same batch must give the same loss, or the benchmark stops.

The optimizer is not the same code on both sides: megalite's `DistributedOptimizer` runs its
own AdamW over flat buffers (in slices), torch's `AdamW` runs over the parameters (foreach: a
few multi-tensor kernels). So each step is also split in two and timed per rank: the optimizer
phase (global norm, clipping, AdamW update; for megalite `opt.step`, which also launches ZeRO-1/2's
parameter gather) and the rest (forward, backward and the data-parallel communication and its
waits). The headline "vs DDP" / "vs FSDP2" figures compare the rest: data parallelism itself,
whatever either optimizer costs; the whole-step and optimizer-only ratios are printed beside.

Also reported: the bytes of parameters, gradients and optimizer state each rank keeps (counted
storage by storage); megalite's exposed DP wait (the time `finalise_grads` blocks for the
reductions still in flight after backward) as a share of its step; ZeRO-2's peak gradient
bytes (`GradBuffer.peak_staged_bytes` plus the shard accumulators) against the formula
4N/dp + (in_flight + 1) staged buckets; and megalite's buffers for bf16 parameters against
the ZeRO bytes-per-parameter formulas.
"""

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megalite.kernels import TORCH_OPS  # noqa: E402

from bench._common import figure, machine, timed, write_summary  # noqa: E402
from bench.parallel._dp_sides import (  # noqa: E402
    ADAMW_IMPL,
    make_batches,
    megalite_rank,
    megalite_side,
    model_config,
    torch_side,
)
from megalite.model.env import LayerEnv  # noqa: E402
from megalite.model.gpt import GPTChunk  # noqa: E402
from megalite.parallel.groups import build_groups  # noqa: E402
from megalite.parallel.topology import Topology  # noqa: E402
from megalite.parallel.zero import ZERO  # noqa: E402
from megalite.testing import spawn  # noqa: E402

METHODS = ("ddp", "zero0", "zero1", "zero2", "fsdp2")
LABEL = {
    "ddp": "torch DDP",
    "zero0": "megalite ZeRO-0",
    "zero1": "megalite ZeRO-1",
    "zero2": "megalite ZeRO-2",
    "fsdp2": "torch FSDP2 (reshard_after_forward=False)",
}


def _slowest(x: float) -> float:
    t = torch.tensor(x, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def run(rank, world, a):
    torch.set_num_threads(1)
    m = model_config(a)
    groups = build_groups(Topology(dp=world), torch.device("cpu"))
    steps = {}
    for method in a.methods:
        if method.startswith("zero"):
            steps[method] = megalite_side(a, m, groups, int(method[-1]))
        else:
            steps[method] = torch_side(a, m, method)
    batches = make_batches(a, m, rank, 2)
    out = timed_rounds(a, steps, batches)
    out["persistent"] = {k: s.persistent() for k, s in steps.items()}
    out["params"] = sum(p.numel() for p in GPTChunk(m, LayerEnv(ops=TORCH_OPS)).parameters())
    ran = 1 + (a.warmup + a.rounds) * a.block
    out["wait_s"] = {k: s.wait_s / ran for k, s in steps.items() if hasattr(s, "wait_s")}
    if "zero2" in steps:
        buf = steps["zero2"].opt.buffer
        sizes = sorted((b.numel * 4 for b in buf.buckets), reverse=True)
        out["zero2"] = {
            "peak_staged": buf.peak_staged_bytes,
            "shards": sum(b.shard_grad.numel() * b.shard_grad.element_size() for b in buf.buckets),
            "numel": buf.numel,
            "buckets": sizes,
        }
    out["bf16"] = _formula(a, m, groups)
    return out


def _formula(a, m, groups):
    """megalite's buffers for bf16 parameters (fp32 gradients, masters, moments), per stage."""
    out = {}
    for stage in (0, 1, 2):
        parts = megalite_rank(a, m, groups, stage, "bf16")
        (model,), opt = parts.chunks, parts.opt
        buf = opt.buffer
        grads = buf.grad_buffer.numel() * 4 if buf.grad_buffer is not None else 0
        grads += 0 if buf.zero.grad_buffer else sum(b.shard_grad.numel() * 4 for b in buf.buckets)
        out[stage] = {
            "params": buf.param_buffer.numel() * 2,
            "grads": grads,
            "state": opt.state_bytes(),
            "n": sum(p.numel() for p in model.parameters()),
        }
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--gbs", type=int, default=32, help="samples per step over both ranks")
    ap.add_argument("--mbs", type=int, default=4, help="samples per micro-batch")
    ap.add_argument("--bucket-mb", type=float, default=4.0)
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--block", type=int, default=2, help="consecutive steps per method per round")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--torch-adamw", default="foreach", choices=list(ADAMW_IMPL),
                    help="torch.optim.AdamW implementation on the DDP and FSDP2 sides")  # fmt: skip
    ap.add_argument("--summary", help="write the headline figures as JSON here")
    return ap


def timed_rounds(a, steps: dict, batches) -> dict:
    """The same first step of every method ("check": their losses), then --rounds rounds after
    --warmup of --block steps of each, the order rotating: per method the slower rank's seconds
    per step ("times"), of them in clip + optimizer ("opt_times", where a step counts `opt_s`)
    and the rest ("rest_times": forward, backward, DP communication)."""
    out = {"check": {}}
    for name, step in steps.items():  # the same first step everywhere: the same loss
        out["check"][name] = step.loss(step(batches[0]))
        step.finish()
    times, opt_times, rest_times = ({k: [] for k in steps} for _ in range(3))
    order = list(steps)
    for r in range(a.warmup + a.rounds):
        shift = r % len(order)
        for name in order[shift:] + order[:shift]:
            step = steps[name]
            o0 = getattr(step, "opt_s", 0.0)
            with timed(barrier=dist.barrier) as block:
                for i in range(a.block):
                    step(batches[(r + i) % 2])
                step.finish()  # the block ends when its parameter gathers have landed
            t = block.wall / a.block
            o = (getattr(step, "opt_s", 0.0) - o0) / a.block
            t, o, rest = _slowest(t), _slowest(o), _slowest(t - o)
            if r >= a.warmup:
                times[name].append(t)
                opt_times[name].append(o)
                rest_times[name].append(rest)
    out["times"], out["opt_times"], out["rest_times"] = times, opt_times, rest_times
    return out


def describe(a):
    """Refuse a batch two ranks cannot split; print the machine and the model."""
    if a.gbs % (2 * a.mbs):
        raise SystemExit(f"--gbs {a.gbs} must be a multiple of 2 x --mbs {a.mbs}")
    m = model_config(a)
    micro = a.gbs // (2 * a.mbs)
    print(f"machine: {machine()}")
    print(f"model: llama L={m.num_layers} h={m.hidden_size} heads={m.num_attention_heads} "
          f"ffn={m.ffn} V={m.vocab_size} s={m.seq_length}, fp32; dp=2 (2 gloo processes x 1 "
          f"thread), gbs {a.gbs} = 2 ranks x {micro} micro-batches x {a.mbs}; buckets "
          f"{a.bucket_mb} MB", flush=True)  # fmt: skip


def check_losses(check: dict):
    """Print the methods' first-step losses; stop unless they agree."""
    print("check (first step, same batch, rank 0 loss):",
          ", ".join(f"{k} {v:.6f}" for k, v in check.items()))  # fmt: skip
    losses = list(check.values())
    if max(losses) - min(losses) > 1e-4 * abs(losses[0]):
        raise SystemExit("the methods do not compute the same loss; the comparison is void")


def main(argv=None):
    a = parser().parse_args(argv)
    describe(a)
    res = spawn(run, 2, a, timeout=3600)
    r0 = res[0]
    check_losses(r0["check"])
    n = r0["params"]
    med = {k: statistics.median(v) for k, v in r0["times"].items()}
    tokens = a.gbs * a.seq
    ref = {"zero0": "ddp", "zero1": "ddp", "zero2": "fsdp2"}

    def ratio(k, base, which="times"):  # base's time over k's: > 1 means k is faster
        return statistics.median(b / x for x, b in zip(r0[which][k], r0[which][base]))

    med_opt = {k: statistics.median(v) for k, v in r0["opt_times"].items()}
    med_rest = {k: statistics.median(v) for k, v in r0["rest_times"].items()}
    print(f"\nstep time: median over {a.rounds} rounds of {a.block} steps (slower rank), "
          f"{tokens} tokens per step; torch sides: torch.optim.AdamW({a.torch_adamw}); "
          f"'optimizer' = global norm + clipping + AdamW update, 'rest' = step - optimizer "
          f"(forward, backward, the DP communication and its waits)")  # fmt: skip
    print("| method | s/step | optimizer s | rest s | tokens/s | speed vs DDP: step | "
          "rest only | optimizer only | vs FSDP2: step | rest only | persistent MB/rank | "
          "bytes/param | exposed DP wait |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for k in r0["times"]:
        pers = max(r["persistent"][k] for r in res)
        wait = r0["wait_s"].get(k)
        vs = [
            f"{ratio(k, b, w):.3f}x" if b in med else "n/a"
            for b, w in (("ddp", "times"), ("ddp", "rest_times"), ("ddp", "opt_times"),
                         ("fsdp2", "times"), ("fsdp2", "rest_times"))
        ]  # fmt: skip
        print(f"| {LABEL[k]} | {med[k]:.3f} | {med_opt[k]:.3f} | {med_rest[k]:.3f} | "
              f"{tokens / med[k]:.0f} | {' | '.join(vs)} | {pers / 2**20:.1f} | {pers / n:.2f} | "
              f"{'n/a' if wait is None else f'{wait / med[k]:.1%}'} |")  # fmt: skip
    print(
        "(speed = the other method's time / this one's, median of per-round ratios; 'rest "
        "only' compares the steps without their optimizer phase: data parallelism itself, "
        "since megalite's flat-buffer AdamW and torch's AdamW are different implementations)"
    )
    figures = []
    targets = {"zero0": 1.0, "zero2": 1.2}
    for k, base in ref.items():
        if k in med and base in med:
            x = ratio(k, base, "rest_times")
            t = targets.get(k)
            figures.append(figure(
                f"DP=2, {LABEL[k]} vs {LABEL[base]}, step without the optimizer phase",
                round(x, 3),
                target=None if t is None else f">= {t}x", met=None if t is None else x >= t,
                how=f"bench_dp.py, median of {a.rounds} interleaved per-round ratios",
            ))  # fmt: skip
            figures.append(figure(
                f"DP=2, {LABEL[k]} vs {LABEL[base]}, whole step (torch AdamW {a.torch_adamw})",
                round(ratio(k, base), 3),
                how=f"bench_dp.py, median of {a.rounds} interleaved per-round ratios",
            ))  # fmt: skip
    if "zero2" in r0:
        z = r0["zero2"]
        for r in res:  # the larger rank
            if r["zero2"]["peak_staged"] > z["peak_staged"]:
                z = r["zero2"]
        bound = z["numel"] * 4 // 2 + ZERO[2].staged_peak(z["buckets"])
        peak = z["peak_staged"] + z["shards"]
        print(f"\nZeRO-2 gradient bytes per rank: shard accumulators {z['shards']:,} B "
              f"(4N/dp = {z['numel'] * 4 // 2:,}) + peak staged {z['peak_staged']:,} B "
              f"= {peak:,} B; bound 4N/dp + the {ZERO[2].in_flight + 1} largest buckets (staged_peak) "
              f"{bound:,} B -> {peak / bound:.3f} of the bound; {len(z['buckets'])} buckets, "
              f"largest {z['buckets'][0]:,} B; ZeRO-0/1 keep 4N = {z['numel'] * 4:,} B "
              f"({peak / (z['numel'] * 4):.2f}x of it)")  # fmt: skip
        figures.append(figure(
            "ZeRO-2 peak gradient bytes per rank / (4N/dp + (in_flight+1) buckets)",
            round(peak / bound, 3), unit="", target="<= 1", met=peak <= bound,
            how="GradBuffer.peak_staged_bytes + shard accumulators, after the timed steps",
        ))  # fmt: skip
    f = r0["bf16"]
    formula = {0: 18, 1: 6 + 12 / 2, 2: 2 + 16 / 2}
    print("\nbf16 parameters, fp32 gradients/masters/moments, megalite buffers per rank (d=2)")
    print("| stage | params B/param | grads B/param | state B/param | total | ZeRO formula |")
    print("| --- | --- | --- | --- | --- | --- |")
    for stage, r in f.items():
        k = r["n"]
        total = (r["params"] + r["grads"] + r["state"]) / k
        print(f"| {stage} | {r['params'] / k:.3f} | {r['grads'] / k:.3f} | "
              f"{r['state'] / k:.3f} | {total:.3f} | {formula[int(stage)]:.3f} |")  # fmt: skip
    print(f"load average after: {os.getloadavg()}")
    write_summary(a.summary, "bench_dp", figures, " ".join(sys.argv))


if __name__ == "__main__":
    main()
