"""A trainer's checkpoint save against `torch.save` of the same state on the same disk.

    .venv/bin/python bench/checkpoint/bench_save.py [--layers 6] [--hidden 1024] [--vocab 32000]
        [--rounds 4] [--dir DIR] [--summary PATH]

One process trains one step of a llama model (fp32, AdamW: weights and two moments, about
1.7 GB at the defaults), then saves it again and again, each variant in turn (the order
rotates each round), the files deleted between saves:

- megalite: `Trainer.save()` (Checkpointer: shard_io.write_shard: the sha256 in a second thread,
  writeback handed to the disk per 64 MB range, fsync; the index, rename and `latest`);
- megalite before: the same with `writing.write_shard` (hash then write, one fsync at the end);
- torch.save: `torch.save` of the same tensors (what this rank writes) to one file, no fsync:
  its bytes may still be in the page cache when it returns;
- torch.save + fsync: the same, flushed to the disk.

Reported: the median time of each and its spread (slowest / fastest save), and the ratios
megalite / torch.save. On a shared machine a save competes for the disk with other processes'
writeback: the spread is the "steady" figure.
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench._common import figure, timed, write_summary  # noqa: E402
from megalite.checkpoint import shard_io, writing  # noqa: E402
from megalite.testing import tiny_config, tiny_trainer  # noqa: E402


def main():
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--dir", help="where the checkpoints go (default: the temp dir)")
    p.add_argument("--summary", help="write the headline figures as JSON here")
    a = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench_save_", dir=a.dir))
    cfg = tiny_config(a.hidden, a.vocab)
    cfg.model.flavour, cfg.model.num_layers, cfg.model.num_attention_heads = "llama", a.layers, 8
    cfg.training.train_iters, cfg.training.kernels = 1, "torch"
    cfg.checkpoint.save = str(root / "run")
    tr = tiny_trainer(cfg, world=1, log=[])
    tr.train()  # one step, then its save (a warm-up)
    tensors = {k: t for k, (t, _, _) in tr.checkpointer._local_tensors().items()}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"# bench_save: {nbytes / 1e9:.2f} GB in {len(tensors)} tensors, one process")
    real = shard_io.write_shard

    def trainer_save(writer):
        def run():
            shard_io.write_shard = writer
            try:
                tr.iteration += 1
                tr.save()
            finally:
                shard_io.write_shard = real
            return root / "run"

        return run

    def torch_save(sync):
        def run():
            path = root / "state.pt"
            with open(path, "wb") as fh:
                torch.save(tensors, fh)
                if sync:
                    fh.flush()
                    os.fsync(fh.fileno())
            return path

        return run

    variants = {
        "megalite": trainer_save(real),
        "megalite before": trainer_save(writing.write_shard),
        "torch.save": torch_save(False),
        "torch.save + fsync": torch_save(True),
    }
    times = {k: [] for k in variants}
    try:
        for r in range(a.rounds):
            names = list(variants)
            for k in names[r % len(names) :] + names[: r % len(names)]:
                os.sync()  # every save starts with nothing of the others left dirty
                with timed() as t:
                    out = variants[k]()
                times[k].append(t.wall)
                shutil.rmtree(out) if out.is_dir() else out.unlink()
            print(f"  round {r}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        print(f"# {k:20s} median {med[k]:6.2f} s ({nbytes / 1e9 / med[k]:.2f} GB/s), "
              f"slowest / fastest {max(v) / min(v):.2f}x")  # fmt: skip
    spread = max(times["megalite"]) / min(times["megalite"])
    figures = [
        figure("trainer save time / torch.save's (same state, same disk)",
               round(med["megalite"] / med["torch.save"], 2), "x", "<= 1.0",
               med["megalite"] <= med["torch.save"]),
        figure("trainer save time / torch.save + fsync's",
               round(med["megalite"] / med["torch.save + fsync"], 2)),
        figure("trainer save before (format.write_shard) / torch.save's",
               round(med["megalite before"] / med["torch.save"], 2)),
        figure("trainer save spread, slowest / fastest", round(spread, 2)),
    ]  # fmt: skip
    write_summary(a.summary, "bench_save", figures, " ".join(sys.argv))


if __name__ == "__main__":
    main()
