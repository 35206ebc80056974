"""Checkpoint save/load throughput: megalite's format against torch.distributed.checkpoint.

    .venv/bin/python bench/bench_checkpoint.py [--out DIR] [--layers 12] [--hidden 768]

Two gloo processes on CPU (tests/spawn.py, one thread each) hold a GPT-2-124M-shaped model
(12 layers, h=768, vocabulary 50257, 1024 positions) at dp=2 with the ZeRO-1 optimizer; the
Adam moments are filled with random values (as after training) instead of running a step.

- megalite save: `Checkpointer.save()`, everything included: gathering the optimizer state
  over DP, writing the safetensors shard (DP rank 0 of the single (tp, pp) position writes),
  fsync, sha256 of each file, the index, the rename and `latest`;
- megalite load: `Checkpointer.load()`: sha256 verification (files spread over the ranks),
  then every rank reads the slices its layout needs and fills its optimizer shards;
- DCP save / load: `torch.distributed.checkpoint.save/load` of the same logical tensors
  (weights and full moments, replicated on both ranks, which DCP deduplicates between them),
  timed without the DP gather that produces them (reported on its own); DCP neither hashes
  nor fsyncs.

Throughput is checkpoint bytes / wall time of the slower rank. The files are read back from
the page cache (they were just written), so load figures are CPU-bound, not disk-bound.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.config import Config  # noqa: E402
from megalite.parallel.groups import build_groups  # noqa: E402
from megalite.shape import validate  # noqa: E402
from megalite.training.logger import Logger  # noqa: E402
from tests.spawn import spawn  # noqa: E402


class _Tokens:
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return np.zeros(1025, dtype=np.int64)


def _trainer(root, layers, hidden):
    from megalite.training.trainer import Trainer

    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads = layers, hidden, 12
    m.seq_length, m.vocab_size = 1024, 50257
    cfg.training.micro_batch_size, cfg.training.global_batch_size = 1, 2
    cfg.optimizer.zero_stage = 1
    cfg.checkpoint.save = str(root)
    cfg.logging.wandb_mode = "disabled"
    shape = validate(cfg, dist.get_world_size())
    groups = build_groups(shape.topology(), torch.device("cpu"))
    data = SimpleNamespace(train=_Tokens(), valid=None, tokenizer=None)
    tr = Trainer(cfg, shape, groups, data=data)
    tr.logger = Logger(cfg, enabled=False)
    g = torch.Generator().manual_seed(groups.rank)
    for t in tr.opt.exp_avg + tr.opt.exp_avg_sq:
        t.copy_(torch.rand(t.shape, generator=g))
    return tr


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _run(rank, world, root, layers, hidden):
    root = Path(root)
    tr = _trainer(root / "megalite", layers, hidden)
    params = sum(p.numel() for c in tr.chunks for p in c.parameters())
    out = {"params": params}
    out["megalite_save_s"] = _timed(tr.save)
    ckpt = root / "megalite" / "iter_0000000"
    out["megalite_bytes"] = sum(f.stat().st_size for f in ckpt.iterdir())
    out["megalite_load_s"] = _timed(lambda: tr.checkpointer.load(ckpt))

    state = {f"model.{n}": p.detach() for c in tr.chunks for n, p in c.named_parameters()}
    gathered = {}
    out["dp_gather_s"] = _timed(lambda: gathered.update(tr.opt.state_tensors()))
    for name, kinds in gathered.items():
        state.update({f"optimizer.{k}.{name}": t for k, t in kinds.items()})
    out["dcp_save_s"] = _timed(lambda: dcp.save(state, checkpoint_id=str(root / "dcp")))
    out["dcp_bytes"] = sum(f.stat().st_size for f in (root / "dcp").iterdir())
    target = {k: torch.empty_like(v) for k, v in state.items()}
    out["dcp_load_s"] = _timed(lambda: dcp.load(target, checkpoint_id=str(root / "dcp")))
    assert all(torch.equal(target[k], state[k]) for k in state)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="directory for the checkpoints (default: a temporary one)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    a = ap.parse_args()
    root = Path(a.out or tempfile.mkdtemp(prefix="bench_ckpt_"))
    try:
        per_rank = spawn(_run, 2, str(root), a.layers, a.hidden, timeout=1800)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    r = per_rank[0]
    slow = {k: max(p[k] for p in per_rank) for k in r if k.endswith("_s")}
    rows = []
    for what in ("megalite", "dcp"):
        gb = r[f"{what}_bytes"] / 1e9
        for op in ("save", "load"):
            s = slow[f"{what}_{op}_s"]
            rows.append({"method": what, "op": op, "GB": round(gb, 3), "seconds": round(s, 2),
                         "GB_per_s": round(gb / s, 3)})  # fmt: skip
    print(f"{r['params']:,} parameters, dp=2, ZeRO-1, fp32 weights + Adam moments")
    print(f"{'method':10} {'op':5} {'GB':>7} {'s':>7} {'GB/s':>7}")
    for x in rows:
        print(
            f"{x['method']:10} {x['op']:5} {x['GB']:7.3f} {x['seconds']:7.2f} {x['GB_per_s']:7.3f}"
        )
    print(
        f"of which the DP gather of the optimizer state (in megalite save only): {slow['dp_gather_s']:.2f} s"
    )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
