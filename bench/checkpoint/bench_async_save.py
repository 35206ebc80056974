"""The training stall of a checkpoint save, synchronous against --async-save, side by side.

    .venv/bin/python bench/checkpoint/bench_async_save.py [--layers 12] [--hidden 768] [--seq 128]
        [--steps 12] [--every 4] [--zero 0 1] [--repeat 1]

Two gloo processes on CPU (megalite/testing.py, one thread each) train a GPT-2-124M-shaped model
(12 layers, h=768, vocabulary 50257, 1024 positions; --seq tokens per sample so that a step
takes seconds, not minutes, on a CPU) at dp=2, for each ZeRO stage given:

- stall per save: the wall time `Checkpointer.save()` holds the training loop, on the slower
  rank, two saves of each kind (and the bytes a save sends other than the world's index
  entries and RNG states: 0, nothing is gathered over DP). Synchronous: each rank writes and hashes its shard, fsync,
  index, rename. Async: the copy of the shard to host memory and the RNG states' all-gather;
  the background write's own duration is reported beside it.
- loop time: --steps steps without saves, then the same steps saving every --every steps
  (async, then sync), each including its final wait for the last write; the steps alone
  (without that wait) are reported too: what periodic saves cost a long run. With --repeat R
  the three loops run R rounds in turn and the best round of each is reported.

Every figure is measured in the same processes, one after the other, so the ratios compare
like with like; absolute seconds depend on the machine's load (see docs/bench_async_save.md).
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench._common import seconds, timed  # noqa: E402
from megalite.config import Config  # noqa: E402
from megalite.parallel.groups import build_groups  # noqa: E402
from megalite.shape import validate  # noqa: E402
from megalite.testing import spawn  # noqa: E402
from megalite.training.logger import Logger  # noqa: E402


def _trainer(root, a, zero):
    from megalite.training.trainer import Trainer

    cfg = Config()
    m, t, c = cfg.model, cfg.training, cfg.checkpoint
    m.num_layers, m.hidden_size, m.num_attention_heads = a.layers, a.hidden, 12
    m.seq_length, m.max_position_embeddings, m.vocab_size = a.seq, 1024, 50257
    t.micro_batch_size, t.global_batch_size, t.train_iters = 1, 2, 10**6
    cfg.optimizer.zero_stage = zero
    c.save, c.keep_checkpoints = str(root), 1
    cfg.logging.wandb_mode = "disabled"
    shape = validate(cfg, dist.get_world_size())
    groups = build_groups(shape.topology(), torch.device("cpu"))
    tokens = np.random.default_rng(0).integers(0, 50257, (64, a.seq + 1))
    tr = Trainer(cfg, shape, groups, data=SimpleNamespace(train=tokens, valid=None, tokenizer=None))
    tr.logger = Logger(cfg, enabled=False)
    tr.checkpointer.log = lambda *_: None
    return tr


def _timed(fn) -> float:
    """Seconds of `fn()` on this rank, the ranks starting together."""
    return seconds(fn, barrier=dist.barrier)


def _loop(tr, steps, every, mode) -> tuple[float, float, float]:
    """`steps` steps, saving every `every` (mode: None, "async", "sync"): (seconds of the steps
    and their saves, seconds then waited for the last write, CPU seconds of the process)."""
    ck = tr.checkpointer
    if mode:
        tr.cfg.checkpoint.async_save = mode == "async"
    with timed() as whole:  # its CPU time: this process's, every thread (the writer's included)
        steps_s = _timed(lambda: [_step_and_save(tr, every, mode) for _ in range(steps)])
        wait_s = _timed(lambda: (ck.wait(), tr.opt.wait_params()))
    return steps_s, wait_s, whole.cpu


def _step_and_save(tr, every, mode):
    tr.train_step(log=False)
    if mode and tr.iteration % every == 0:
        tr.checkpointer.save(tr.state())


def _measure(tr, a) -> dict:
    ck, r = tr.checkpointer, {}
    r["params"] = sum(p.numel() for c in tr.chunks for p in c.parameters())
    r["step_s"] = _timed(lambda: tr.train_step(log=False))  # (warm-up, one step)
    for mode in ("sync", "async", "sync", "async"):
        tr.cfg.checkpoint.async_save = mode == "async"
        tr.train_step(log=False)
        tr.groups.ledger.reset()  # what the save sends beyond the world's small objects
        r.setdefault(f"{mode}_stall_s", []).append(_timed(lambda: ck.save(tr.state())))
        if mode == "async":
            r.setdefault("async_background_s", []).append(_timed(ck.wait))
        off_world = sum(n for k, n in tr.groups.ledger.bytes.items() if k != "world")
        r.setdefault(f"{mode}_save_bytes_not_world", []).append(off_world)
    # --repeat rounds of the three loops in turn, the best round of each kept: on a machine
    # shared with other jobs a burst of load then spoils one round, not the comparison
    best = {}
    for _ in range(a.repeat):
        for mode in (None, "async", "sync"):
            steps_s, wait_s, cpu_s = _loop(tr, a.steps, a.every, mode)
            if mode not in best or steps_s + wait_s < best[mode][0] + best[mode][1]:
                best[mode] = (steps_s, wait_s, cpu_s)
    for mode, (steps_s, wait_s, cpu_s) in best.items():
        r[f"loop_{mode or 'nosave'}_s"] = steps_s + wait_s
        r[f"loop_{mode or 'nosave'}_steps_s"] = steps_s  # without the wait for the last write
        r[f"loop_{mode or 'nosave'}_cpu_s"] = cpu_s
    return r


def _run(rank, world, root, a):
    return {f"zero{z}": _measure(_trainer(Path(root) / f"zero{z}", a, z), a) for z in a.zero}


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="directory for the checkpoints (default: a temporary one)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--zero", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--repeat", type=int, default=1, help="rounds of the loops (best kept)")
    a = ap.parse_args()
    root = Path(a.out or tempfile.mkdtemp(prefix="bench_async_"))
    try:
        per_rank = spawn(_run, 2, str(root), a, timeout=7200)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report = {"load_average": os.getloadavg(), "args": vars(a)}
    for key, r in per_rank[0].items():  # the slower rank of each figure
        slow = {k: (max(p[key][k] for p in per_rank) if not isinstance(v, list) else
                    [max(p[key][k][i] for p in per_rank) for i in range(len(v))])
                for k, v in r.items()}  # fmt: skip
        slow["stall_ratio"] = min(slow["async_stall_s"]) / min(slow["sync_stall_s"])
        slow["loop_ratio_async"] = slow["loop_async_s"] / slow["loop_nosave_s"]
        slow["loop_ratio_sync"] = slow["loop_sync_s"] / slow["loop_nosave_s"]
        # the steps alone: what periodic saves cost a long run, the last write waited for apart
        slow["steps_ratio_async"] = slow["loop_async_steps_s"] / slow["loop_nosave_steps_s"]
        report[key] = slow
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
