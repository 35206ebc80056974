"""megalite ZeRO-1/2/3 against DeepSpeed's ZeRO stages 1/2/3 at dp=2, in one pair of processes.

    .venv/bin/python bench/parallel/bench_deepspeed.py [bench_dp.py's shape flags: --layers 8
        --hidden 256 --heads 4 --seq 256 --vocab 2048 --gbs 32 --mbs 4 --bucket-mb 4]
        [--rounds 3] [--block 2] [--methods zero1 ds1 zero2 ds2 zero3 zero3k ds3] [--summary PATH]

DeepSpeed is never a dependency of megalite: the first run creates `.venv-peers` at the top of
the checkout (gitignored; not under bench/, whose files tests walk): `python -m venv`, then pip
installs this interpreter's torch version, `deepspeed` (DEEPSPEED below) and megalite itself
with `-e . --no-deps`; it then re-runs itself there, and later runs reuse it. DeepSpeed runs on
its CPU accelerator (DS_ACCELERATOR=cpu), whose communication backend is gloo when oneCCL is
absent: the same gloo process group megalite uses (DeepSpeed adopts it).

Both sides train bench_dp.py's model (the same `GPTChunk`, llama flavour, torch reference ops,
fp32, the same initial weights) on bench_dp.py's batches: gbs/(2*mbs) micro-batches per rank, the
loss of each divided by their number, the global norm clipped at 1.0, AdamW (lr 1e-4, betas
0.9/0.95, eps 1e-8, weight decay 0.1 except the norms).

- megalite zeroN: bench_dp.py's megalite side (the pipeline executor at pp=1 and
  `DistributedOptimizer` at --zero-stage N, --bucket-mb buckets; ZeRO-1/2 gather the updated
  parameters overlapped with the next forward, ZeRO-3 gathers each layer before its forward and
  again before its backward); zero3k: ZeRO-3 with --zero3-keep-params (each layer gathered once
  per micro-batch and kept until its backward, closer to what DeepSpeed's stage 3 does by
  default: it keeps the parameters it will use again within stage3_max_reuse_distance);
- DeepSpeed dsN: `deepspeed.initialize` with torch.optim.AdamW(foreach=True) as its client
  optimizer, `zero_optimization.stage` N, reduce_bucket_size and allgather_bucket_size (and at
  stage 3 stage3_prefetch_bucket_size) of --bucket-mb, overlap_comm and contiguous_gradients on,
  gradient_clipping 1.0, gradient_accumulation_steps = the micro-batches (its engine divides
  each loss by them); a step is `engine(tokens, labels)`, `engine.backward(loss)`,
  `engine.step()` per micro-batch, the last one stepping the optimizer.

The methods take turns: each round runs --block consecutive steps of every method (the order
rotates, so A B A B), after --warmup untimed rounds; a method's step time is its block's time
/ block on the slower rank. Reported per megalite stage: its speed against the DeepSpeed stage
of the same number, the median of the per-round ratios (> 1: megalite is faster). One first step
of each method on the same batch must give the same loss (1e-4), or the benchmark stops.
"""

import argparse
import importlib.util
import logging
import os
import statistics
import subprocess
import sys
import warnings
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parents[1]
PEERS = ROOT / ".venv-peers"  # (not under bench/: tests walk its files)
DEEPSPEED = "deepspeed==0.19.8"  # the version docs/bench_dp.md's figures were measured with
# zero3k: megalite ZeRO-3 with --zero3-keep-params (each layer gathered once per micro-batch,
# kept from its forward to its backward, as DeepSpeed's stage 3 keeps parameters it will reuse
# within stage3_max_reuse_distance); compared with ds3 as zero3 is
METHODS = ("zero1", "ds1", "zero2", "ds2", "zero3", "zero3k", "ds3")
LABEL = {"zero1": "megalite ZeRO-1", "zero2": "megalite ZeRO-2", "zero3": "megalite ZeRO-3",
         "zero3k": "megalite ZeRO-3 --zero3-keep-params", "ds1": "DeepSpeed stage 1",
         "ds2": "DeepSpeed stage 2", "ds3": "DeepSpeed stage 3"}  # fmt: skip
TARGET = 1.2  # issue 34: megalite ZeRO-N >= 1.2x DeepSpeed stage N


def ensure_peers() -> Path:
    """The python of .venv-peers, creating the environment on first use."""
    python = PEERS / "bin" / "python"
    if python.exists():
        return python
    import torch

    print(f"creating {PEERS} (torch {torch.__version__}, {DEEPSPEED}; once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(PEERS)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, f"torch=={torch.__version__}"], check=True)
    # deepspeed's setup.py imports torch: build it against the torch just installed
    subprocess.run([*pip, "--no-build-isolation", DEEPSPEED], check=True)
    subprocess.run([*pip, "--no-deps", "-e", str(ROOT)], check=True)
    return python


if __name__ == "__main__" and importlib.util.find_spec("deepspeed") is None:
    peers = ensure_peers()
    os.execv(str(peers), [str(peers), *sys.argv])

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

sys.path.insert(0, str(ROOT))

from megalite.kernels import TORCH_OPS  # noqa: E402

from bench._common import figure, write_summary  # noqa: E402
from bench.parallel import _dp_sides, bench_dp  # noqa: E402
from megalite.model.env import LayerEnv  # noqa: E402
from megalite.model.gpt import GPTChunk  # noqa: E402
from megalite.parallel.groups import build_groups  # noqa: E402
from megalite.parallel.specs import spec_of  # noqa: E402
from megalite.parallel.topology import Topology  # noqa: E402
from megalite.testing import spawn  # noqa: E402


def ds_config(a, stage: int) -> dict:
    bucket = int(a.bucket_mb * 2**20 / 4)  # DeepSpeed counts bucket sizes in elements (fp32)
    zero = {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
            "overlap_comm": True, "contiguous_gradients": True}  # fmt: skip
    if stage == 3:
        zero["stage3_prefetch_bucket_size"] = bucket
    return {
        "train_batch_size": a.gbs,
        "train_micro_batch_size_per_gpu": a.mbs,
        "gradient_accumulation_steps": a.gbs // (2 * a.mbs),
        "gradient_clipping": _dp_sides.CLIP,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31,
        "wall_clock_breakdown": False,
    }


def deepspeed_side(a, m, stage: int):
    import deepspeed

    model = GPTChunk(m, LayerEnv(ops=TORCH_OPS, seed=1234))
    decay = [p for p in model.parameters() if not spec_of(p).no_weight_decay]
    other = [p for p in model.parameters() if spec_of(p).no_weight_decay]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": _dp_sides.WD}, {"params": other, "weight_decay": 0.0}],
        lr=_dp_sides.LR, betas=_dp_sides.BETAS, eps=_dp_sides.EPS, foreach=True,
    )  # fmt: skip
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(a, stage),
                                      dist_init_required=False)  # fmt: skip

    def step(batch):
        total = 0.0
        for tokens, labels in batch:
            loss = engine(tokens, labels)
            engine.backward(loss)  # (divided by gradient_accumulation_steps inside)
            engine.step()  # an optimizer step at the last micro-batch only
            total += loss.detach()
        return total / len(batch)

    step.finish = lambda: None
    step.loss = lambda r: float(r)
    return step


def run(rank, world, a):
    torch.set_num_threads(1)
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)  # (its per-step info lines)
    warnings.filterwarnings("ignore", category=FutureWarning)  # (its deprecated collectives)

    m = _dp_sides.model_config(a)
    groups = build_groups(Topology(dp=world), torch.device("cpu"))
    # what DeepSpeed's launcher would set (the process group exists already: it adopts it)
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
    torch.set_num_threads(1)  # (in case DeepSpeed's accelerator changed it)
    steps = {}
    for method in a.methods:
        stage = int(method[4] if method.startswith("zero") else method[2])
        if method.startswith("zero"):
            keep = method.endswith("k")
            steps[method] = _dp_sides.megalite_side(a, m, groups, stage, keep_params=keep)
        else:
            steps[method] = deepspeed_side(a, m, stage)
    batches = _dp_sides.make_batches(a, m, rank, 2)
    out = bench_dp.timed_rounds(a, steps, batches)
    out["versions"] = {"deepspeed": deepspeed.__version__, "torch": str(torch.__version__)}
    return out


def parser() -> argparse.ArgumentParser:
    ap = bench_dp.parser()
    ap.description = __doc__.split("\n")[0]
    for action in ap._actions:  # this benchmark's own methods and a shorter default run
        if action.dest == "methods":
            action.choices, action.default = METHODS, list(METHODS)
        elif action.dest == "rounds":
            action.default = 3
    return ap


def main(argv=None):
    a = parser().parse_args(argv)
    bench_dp.describe(a)
    r0 = spawn(run, 2, a, timeout=3600)[0]
    v = r0["versions"]
    print(f"peers: deepspeed {v['deepspeed']}, torch {v['torch']} (DeepSpeed's CPU accelerator)")
    bench_dp.check_losses(r0["check"])
    times = r0["times"]
    tokens = a.gbs * a.seq
    print(f"\nstep time: median over {a.rounds} rounds of {a.block} steps (slower rank), "
          f"{tokens} tokens per step")  # fmt: skip
    print("| method | s/step | tokens/s | speed vs DeepSpeed's stage | s/step by round |")
    print("| --- | --- | --- | --- | --- |")
    figures = []
    for k, ts in times.items():
        med = statistics.median(ts)
        peer = "ds" + k[4] if k.startswith("zero") else None
        vs = "n/a"
        if peer in times:
            x = statistics.median(b / t for t, b in zip(ts, times[peer]))
            vs = f"{x:.3f}x"
            figures.append(figure(
                f"DP=2, {LABEL[k]} vs DeepSpeed {v['deepspeed']} stage {peer[2]}, whole step",
                round(x, 3), target=f">= {TARGET}x", met=x >= TARGET,
                how=f"bench_deepspeed.py, median of {a.rounds} interleaved per-round ratios",
            ))  # fmt: skip
        rounds = ", ".join(f"{t:.2f}" for t in ts)
        print(f"| {LABEL[k]} | {med:.3f} | {tokens / med:.0f} | {vs} | {rounds} |")
    print(f"load average after: {os.getloadavg()}")
    write_summary(a.summary, "bench_deepspeed", figures, " ".join(sys.argv))


if __name__ == "__main__":
    main()
