"""Checkpoint save/load throughput: megalite's format against torch.distributed.checkpoint.

    .venv/bin/python bench/checkpoint/bench_checkpoint.py [--out DIR] [--layers 12] [--hidden 768]
        [--summary PATH]

Two gloo processes on CPU (megalite/testing.py, one thread each) hold a GPT-2-124M-shaped model
(12 layers, h=768, vocabulary 50257, 1024 positions) at dp=2 with the ZeRO-1 optimizer; the
Adam moments are filled with random values (as after training) instead of running a step.

- megalite save: `Checkpointer.save()` (synchronous), everything included: each rank writes
  its own ZeRO shard of the weights and the moments (no gather) into its safetensors file,
  hashed (sha256) as it is written, fsync, the index, the rename and `latest`;
- megalite load: `Checkpointer.load()`: sha256 verification (each file hashed by one rank),
  then every rank reads its parameters' slices (memory-mapped): the weights and only its own
  1/dp shard of the moments (`checkpoint/regions.py FlatRead`);
- DCP, replicated moments: `torch.distributed.checkpoint.save/load` of the same logical
  tensors (weights and the full moments, replicated on both ranks; DCP's planner writes each
  replicated tensor once), timed without the DP gather that produces them (reported on its
  own). On load every rank reads the whole moments;
- DCP, sharded moments: the moments as DTensors sharded over the DP ranks (Shard(0) of each
  logical tensor, as FSDP's sharded state dict), so each rank saves and loads its half: no
  gather, and on load each rank reads the weights and its half of the moments, the same data
  per rank as megalite.

DCP's FileSystemWriter fsyncs every file it writes (`sync_files=True` by default) and writes its
metadata aside before renaming it; it computes no checksum. Bytes read per rank during a load
are measured: `rchar` of /proc/self/io (bytes through read() calls: DCP's reads, megalite's
sha256 pass and index) plus, for megalite, the bytes of the memory-mapped slices it copies out
(counted around `Checkpoint.read`; mmap reads do not pass through read()).

Save throughput is checkpoint bytes / wall time of the slower rank; loads are compared by time,
with the bytes each rank read printed beside them (they differ between the methods: compare
like for like with them in view). The files are read back from the page cache (they
were just written), so load figures are CPU-bound, not disk-bound.
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
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench._common import figure, machine, seconds, write_summary  # noqa: E402
from megalite.config import Config  # noqa: E402
from megalite.parallel.groups import build_groups  # noqa: E402
from megalite.shape import validate  # noqa: E402
from megalite.testing import spawn  # noqa: E402
from megalite.training.logger import Logger  # noqa: E402


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
    """Seconds of `fn()` on the slower rank: both start together and wait for each other."""
    return seconds(lambda: (fn(), dist.barrier()), barrier=dist.barrier)


def _rchar() -> int:
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("rchar"))


class _MappedReads:
    """Counts the bytes megalite copies out of its memory-mapped checkpoint files."""

    def __init__(self):
        from megalite.checkpoint import format as fmt

        self.nbytes, self.cls, self.orig = 0, fmt.Checkpoint, fmt.Checkpoint.read

        def read(ckpt, name, region=None):
            t = self.orig(ckpt, name, region)
            self.nbytes += t.numel() * t.element_size()
            return t

        self.cls.read = read

    def close(self):
        self.cls.read = self.orig


def _load_measured(fn, mapped: _MappedReads | None = None) -> tuple[float, int]:
    """(seconds of the slower rank, bytes this rank read) for one load."""
    r0, m0 = _rchar(), mapped.nbytes if mapped else 0
    s = _timed(fn)
    return s, _rchar() - r0 + ((mapped.nbytes - m0) if mapped else 0)


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir())


def _run(rank, world, root, layers, hidden):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    root = Path(root)
    tr = _trainer(root / "megalite", layers, hidden)
    params = sum(p.numel() for c in tr.chunks for p in c.parameters())
    out = {"params": params}
    out["megalite_save_s"] = _timed(tr.save)
    ckpt = root / "megalite" / "iter_0000000"
    out["megalite_bytes"] = _dir_bytes(ckpt)
    mapped = _MappedReads()
    out["megalite_load_s"], out["megalite_read"] = _load_measured(
        lambda: tr.checkpointer.load(ckpt), mapped
    )
    mapped.close()

    weights = {f"model.{n}": p.detach() for c in tr.chunks for n, p in c.named_parameters()}
    gathered = {}
    out["dp_gather_s"] = _timed(lambda: gathered.update(tr.opt.state_tensors()))
    moments = {f"optimizer.{k}.{name}": t for name, kinds in gathered.items()
               for k, t in kinds.items()}  # fmt: skip

    # DCP with the full moments on every rank (replicated)
    state = {**weights, **moments}
    out["dcp_save_s"] = _timed(lambda: dcp.save(state, checkpoint_id=str(root / "dcp")))
    out["dcp_bytes"] = _dir_bytes(root / "dcp")
    target = {k: torch.empty_like(v) for k, v in state.items()}
    out["dcp_load_s"], out["dcp_read"] = _load_measured(
        lambda: dcp.load(target, checkpoint_id=str(root / "dcp"))
    )
    assert all(torch.equal(target[k], state[k]) for k in state)
    del target

    # DCP with the moments sharded over DP: each rank saves and loads its half
    mesh = init_device_mesh("cpu", (world,))

    def shard(t):  # this rank's Shard(0) piece of a replicated logical tensor
        return DTensor.from_local(t.chunk(world)[rank].clone(), mesh, [Shard(0)],
                                  shape=t.shape, stride=t.stride())  # fmt: skip

    sharded = {**weights, **{k: shard(t) for k, t in moments.items()}}
    moments = gathered = state = None  # free them (the lambdas above have run)
    out["dcps_save_s"] = _timed(lambda: dcp.save(sharded, checkpoint_id=str(root / "dcps")))
    out["dcps_bytes"] = _dir_bytes(root / "dcps")
    target = {k: shard(torch.empty(v.shape)) if isinstance(v, DTensor) else torch.empty_like(v)
              for k, v in sharded.items()}  # fmt: skip
    out["dcps_load_s"], out["dcps_read"] = _load_measured(
        lambda: dcp.load(target, checkpoint_id=str(root / "dcps"))
    )
    for k, v in sharded.items():
        got = target[k].to_local() if isinstance(v, DTensor) else target[k]
        assert torch.equal(got, v.to_local() if isinstance(v, DTensor) else v), k
    return out


METHODS = {"megalite": "megalite", "dcp": "DCP, replicated moments",
           "dcps": "DCP, moments sharded over DP"}  # fmt: skip


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="directory for the checkpoints (default: a temporary one)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--summary", help="write the headline figures as JSON here")
    a = ap.parse_args()
    root = Path(a.out or tempfile.mkdtemp(prefix="bench_ckpt_"))
    try:
        per_rank = spawn(_run, 2, str(root), a.layers, a.hidden, timeout=1800)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    r = per_rank[0]
    slow = {k: max(p[k] for p in per_rank) for k in r if k.endswith("_s")}
    rows = []
    for what in METHODS:
        gb = r[f"{what}_bytes"] / 1e9
        for op in ("save", "load"):
            s = slow[f"{what}_{op}_s"]
            row = {"method": METHODS[what], "op": op, "GB": round(gb, 3), "seconds": round(s, 2),
                   "GB_per_s": round(gb / s, 3)}  # fmt: skip
            if op == "load":
                row["read_GB_per_rank"] = [round(p[f"{what}_read"] / 1e9, 3) for p in per_rank]
            rows.append(row)
    print(f"machine: {machine()}")
    print(f"{r['params']:,} parameters, dp=2, ZeRO-1, fp32 weights + Adam moments")
    print("| method | op | checkpoint GB | s (slower rank) | GB/s | GB read per rank (0, 1) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for x in rows:
        read = ", ".join(f"{v:.3f}" for v in x.get("read_GB_per_rank", [])) or "-"
        print(f"| {x['method']} | {x['op']} | {x['GB']:.3f} | {x['seconds']:.2f} | "
              f"{x['GB_per_s']:.3f} | {read} |")  # fmt: skip
    print(f"the DP gather that gives DCP its replicated moments (in no save's time): "
          f"{slow['dp_gather_s']:.2f} s")  # fmt: skip
    ratios = {
        "save vs DCP replicated (time ratio DCP / megalite)": slow["dcp_save_s"] / slow["megalite_save_s"],
        "save vs DCP sharded": slow["dcps_save_s"] / slow["megalite_save_s"],
        "load vs DCP replicated": slow["dcp_load_s"] / slow["megalite_load_s"],
        "load vs DCP sharded (DCP reads 1/dp of the moments per rank)": slow["dcps_load_s"] / slow["megalite_load_s"],
    }  # fmt: skip
    for k, v in ratios.items():
        print(f"megalite {k}: {v:.2f}x")
    print(json.dumps(rows))
    size = ("GPT-2-124M" if (a.layers, a.hidden) == (12, 768)
            else f"{a.layers} layers x h {a.hidden}, V 50257")  # fmt: skip
    write_summary(a.summary, "bench_checkpoint", [
        figure(f"checkpoint {k}, {size} + Adam, dp=2", round(v, 2),
               how="bench_checkpoint.py, one run, slower rank; > 1: megalite faster")
        for k, v in ratios.items()
    ], " ".join(sys.argv))  # fmt: skip


if __name__ == "__main__":
    main()
