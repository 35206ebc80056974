"""ZeRO-3 side by side: megalite `--zero-stage 3` against torch FSDP2 (`fully_shard`).

    .venv/bin/python bench/parallel/bench_zero3.py [--dp 2] [--layers 8] [--hidden 384] [--heads 6]
        [--seq 256] [--vocab 4096] [--gbs 8] [--mbs 2] [--steps 4] [--summary PATH]

--dp gloo processes on CPU (megalite/testing.py, one thread each) train the same `GPTChunk` (llama
flavour, torch reference ops, fp32, the same initial weights and data: each rank its 1/dp of the
global batch in gbs/(dp*mbs) micro-batches). A step: forward + backward of every micro-batch
(loss / m), clip the global norm at 1.0, AdamW. Both sides shard every parameter over the dp
ranks, per layer, with the same policy:

- megalite: `DistributedOptimizer` at ZeRO-3 and the pipeline executor at pp=1 (what the trainer
  runs): each layer gathered before its forward (the next one prefetched), freed after it,
  gathered again before its backward, its gradient reduce-scattered every micro-batch;
- fsdp2: `fully_shard` on each layer and on the root, `reshard_after_forward=True` (its
  default): the same gathers and reduce-scatters, torch.optim.AdamW(foreach=True) and
  clip_grad_norm_(foreach=True) on its DTensors.

Each method runs in its own processes (its memory is its own), --repeats times, alternating
(megalite, fsdp2, megalite, ...) so a change in the machine's load hits both. Measured per rank,
slower rank reported: tokens/s (global batch tokens / the median step time over every repeat's
--steps steps, each repeat after one warm-up step), and the peak resident memory during the timed steps (Linux VmHWM, reset to the current
RSS after the warm-up through /proc/self/clear_refs), with glibc's mmap threshold fixed at 64 KiB
so freed parameter storage goes back to the OS. The headline memory figure is that peak minus
the RSS before the model was built (both sides import the same modules first): what the
method holds at its worst moment (shards, optimizer state, gathered layers, gradients,
activations), without the interpreter's and torch's own. The first step's loss must agree
(1e-4), or the benchmark stops. The ratios are megalite over FSDP2: tokens/s above 1 means
megalite is faster, memory below 1 means it holds less.
"""

import argparse
import os
import statistics
import sys

# before any process starts: freed blocks of 64 KiB and more are unmapped at once, so the peak
# RSS sees what each side really holds (spawned processes inherit it)
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megalite.kernels import TORCH_OPS  # noqa: E402

from bench._common import figure, machine, memory, reset_peak, timed, write_summary  # noqa: E402
from megalite.config import Config, ModelConfig  # noqa: E402
from megalite.model.env import LayerEnv  # noqa: E402
from megalite.model.gpt import GPTChunk  # noqa: E402
from megalite.parallel.groups import build_groups  # noqa: E402
from megalite.parallel.specs import spec_of  # noqa: E402
from megalite.parallel.topology import Topology  # noqa: E402
from megalite.shape import validate  # noqa: E402
from megalite.testing import spawn  # noqa: E402
from megalite.training.build import build_rank  # noqa: E402

LR, CLIP, WD, BETAS, EPS = 1e-4, 1.0, 0.1, (0.9, 0.95), 1e-8


def model_config(a) -> ModelConfig:
    return ModelConfig(
        flavour="llama", num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
        seq_length=a.seq, vocab_size=a.vocab,
    )  # fmt: skip


def megalite_side(a, m):
    groups = build_groups(Topology(dp=a.dp), torch.device("cpu"))
    cfg = Config()
    cfg.model = m
    o = cfg.optimizer
    o.zero_stage, o.clip_grad, o.weight_decay, o.lr = 3, CLIP, WD, LR
    (o.adam_beta1, o.adam_beta2), o.adam_eps = BETAS, EPS
    cfg.training.micro_batch_size, cfg.training.global_batch_size = a.mbs, a.gbs
    cfg.training.kernels = "torch"
    parts = build_rank(cfg, validate(cfg, a.dp), groups)  # 1F1B over gbs / (dp * mbs)
    opt = parts.opt

    def step(batch):
        opt.zero_grad(parts.microbatches)  # (the run shape's count)
        r = parts.run(batch)
        opt.step(LR)
        return r.loss

    return step


def fsdp2_side(a, m):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = GPTChunk(m, LayerEnv(ops=TORCH_OPS, seed=1234))
    no_decay = {id(p) for p in model.parameters() if spec_of(p).no_weight_decay}
    mesh = init_device_mesh("cpu", (a.dp,))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    # DTensors now (no specs): the norms are the 1-d parameters, as no_decay above
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    assert len(other) == len(no_decay)
    params = decay + other
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WD}, {"params": other, "weight_decay": 0.0}],
        lr=LR, betas=BETAS, eps=EPS, foreach=True,
    )  # fmt: skip

    def step(batch):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for tokens, labels in batch:
            loss = model(tokens, labels)
            (loss / len(batch)).backward()
            total += loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(params, CLIP, foreach=True)
        if hasattr(norm, "full_tensor"):
            norm.full_tensor()
        opt.step()
        loss = total / len(batch)
        dist.all_reduce(loss)  # the mean over the ranks, as megalite's loss reads it
        return float(loss) / a.dp

    return step


def _batches(a, m, rank, n):
    g = torch.Generator().manual_seed(100)
    micro = a.gbs // (a.dp * a.mbs)
    out = []
    for _ in range(n):
        toks = torch.randint(0, m.vocab_size, (a.dp, micro, a.mbs, a.seq + 1), generator=g)[rank]
        out.append([(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in toks])
    return out


def _slowest(times: list[float]) -> list[float]:
    """Each step's time on the slower rank."""
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def run(rank, world, a, method):
    from torch.distributed.fsdp import fully_shard  # noqa: F401  (both sides: the same imports)

    torch.manual_seed(0)
    m = model_config(a)
    before = memory()["VmRSS"] // 1024  # kB, before the model exists
    step = {"megalite": megalite_side, "fsdp2": fsdp2_side}[method](a, m)
    batches = _batches(a, m, rank, a.steps + 1)
    loss = step(batches[0])  # warm-up (and the loss both sides must agree on)
    if method == "megalite":  # the executor's loss is this rank's: average it like fsdp2's
        t = torch.tensor(loss, dtype=torch.float64)
        dist.all_reduce(t)
        loss = t.item() / a.dp
    dist.barrier()
    reset_peak()  # VmHWM := VmRSS: the peak from here on
    base = memory()["VmRSS"] // 1024
    times = []
    for batch in batches[1:]:
        dist.barrier()
        with timed() as t:
            step(batch)
        times.append(t.wall)
    peak = memory()["VmHWM"] // 1024
    return {"loss": loss, "times": _slowest(times), "peak_kb": peak, "base_kb": base,
            "before_kb": before}  # fmt: skip


def main(argv=None):
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--gbs", type=int, default=8, help="samples per step over all ranks")
    ap.add_argument("--mbs", type=int, default=2, help="samples per micro-batch")
    ap.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each method, alternating")
    ap.add_argument("--summary", help="write the headline figures as JSON here")
    a = ap.parse_args(argv)
    if a.gbs % (a.dp * a.mbs):
        ap.error(f"--gbs {a.gbs} must be a multiple of --dp * --mbs = {a.dp * a.mbs}")
    print(machine())
    runs = {"megalite": [], "fsdp2": []}
    for _ in range(a.repeats):
        for method in runs:
            runs[method] += spawn(run, a.dp, a, method, timeout=3600)
    res = {}
    for method, per_rank in runs.items():
        res[method] = {
            "loss": per_rank[0]["loss"],
            "step_s": statistics.median(t for r in per_rank for t in r["times"]),
            "peak": max(r["peak_kb"] for r in per_rank) * 1024,
            "held": max(r["peak_kb"] - r["before_kb"] for r in per_rank) * 1024,
            "above": max(r["peak_kb"] - r["base_kb"] for r in per_rank) * 1024,
        }
    ours, theirs = res["megalite"], res["fsdp2"]
    if abs(ours["loss"] - theirs["loss"]) > 1e-4 * abs(theirs["loss"]):
        raise SystemExit(
            f"first-step losses differ: megalite {ours['loss']} fsdp2 {theirs['loss']}"
        )
    tokens = a.gbs * a.seq
    n_params = sum(
        p.numel() for p in GPTChunk(model_config(a), LayerEnv(device="meta")).parameters()
    )
    print(f"dp={a.dp} llama {a.layers} layers h={a.hidden} s={a.seq} V={a.vocab} "
          f"({n_params / 1e6:.1f}M parameters), gbs {a.gbs}, mbs {a.mbs}, fp32, gloo CPU; "
          f"first-step loss {ours['loss']:.6f} (both)")  # fmt: skip
    print(f"{'':>10}{'tokens/s':>10}{'step s':>9}{'peak RSS':>11}{'peak - RSS before model':>25}"
          f"{'peak - RSS at step start':>26}")  # fmt: skip
    for k, r in res.items():
        print(f"{k:>10}{tokens / r['step_s']:>10.0f}{r['step_s']:>9.3f}{r['peak'] / 2**20:>9.1f}Mi"
              f"{r['held'] / 2**20:>23.1f}Mi{r['above'] / 2**20:>24.1f}Mi")  # fmt: skip
    speed = theirs["step_s"] / ours["step_s"]
    memory = ours["held"] / max(theirs["held"], 1)
    print(f"megalite / fsdp2: tokens/s x{speed:.2f}, peak memory (above the RSS before the model) "
          f"x{memory:.2f}, peak RSS x{ours['peak'] / theirs['peak']:.2f}, peak above the step's "
          f"start x{ours['above'] / max(theirs['above'], 1):.2f}")  # fmt: skip
    cmd = "bench/parallel/bench_zero3.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write_summary(a.summary, "zero3", [
        figure("ZeRO-3 tokens/s, megalite / FSDP2", round(speed, 3), how=f"dp={a.dp}, median step"),
        figure("ZeRO-3 peak memory, megalite / FSDP2", round(memory, 3),
               how="VmHWM over the timed steps minus the RSS before the model"),
    ], cmd)  # fmt: skip


if __name__ == "__main__":
    main()
