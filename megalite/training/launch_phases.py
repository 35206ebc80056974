"""Time to the first step, by phase: rendezvous (the default process group), groups
(build_groups), data index (the datasets and their sample indices), locate (with the local
checkpoint tier: which copy a restart takes, checkpoint/local_restore.py), model build (chunks,
optimizer, schedule), resume (a checkpoint's load, the local tier's fetch included; 0 without
one) and the first step.

Every rank times its own phases; rank 0 prints each as it ends (the console's first lines),
and the first logged step's metrics row (the metrics file's first line) carries them reduced
over the world: per phase the slowest rank's seconds and the fastest's, from one all-reduce
(the slowest rank sets when the run starts; a wide gap names a straggling host). At 16,384
ranks the user's first question is where the hour before step 1 went (pytorch #71134)."""

import time
from contextlib import contextmanager

import torch

from megalite.parallel import comm

PHASES = ("rendezvous", "groups", "data index", "locate", "model build", "resume", "first step")


class LaunchPhases:
    def __init__(self, echo: bool = False):
        self.seconds = {}  # phase -> this rank's seconds, in the order they ran
        self.echo = echo  # print each phase as it ends (rank 0)
        self.reported = False

    @contextmanager
    def phase(self, name: str):
        if name not in PHASES:
            raise ValueError(f"unknown launch phase {name!r}; phases are {PHASES}")
        t0 = time.perf_counter()
        yield
        self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float):
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        if self.echo:
            print(f"launch: {name} {seconds:.2f} s", flush=True)

    def summary(self, world) -> dict:
        """{phase: {"max": s, "min": s}} over the ranks of `world` (a comm.Group) plus "total"
        (each rank's sum: the time to its first step), from one all-reduce of the maxima and
        the negated minima. Every rank of `world` calls it, once."""
        names = [p for p in PHASES if p in self.seconds]
        mine = [self.seconds[p] for p in names]
        mine.append(sum(mine))
        t = torch.tensor(mine + [-x for x in mine], dtype=torch.float64, device=world.device)
        comm.all_reduce(t, world, op=torch.distributed.ReduceOp.MAX)
        n = len(mine)
        out = {p: {"max": round(t[i].item(), 3), "min": round(-t[n + i].item(), 3)}
               for i, p in enumerate([*names, "total"])}  # fmt: skip
        self.reported = True
        return out


def format_summary(summary: dict) -> str:
    """One console line: each phase's seconds on the slowest rank."""
    parts = [f"{p} {v['max']:.2f} s" for p, v in summary.items() if p != "total"]
    total = summary["total"]
    return (
        f"launch: {total['max']:.2f} s to the first step on the slowest rank "
        f"({total['min']:.2f} s on the fastest): " + ", ".join(parts)
    )
