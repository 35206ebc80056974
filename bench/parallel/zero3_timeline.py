"""Where ZeRO-3's parameter gathers wait: one step's per-unit timeline on both ranks, and
whether a gather in flight slows the compute beside it.

    .venv/bin/python bench/parallel/zero3_timeline.py [bench_dp.py's shape flags] [--steps 2]
        [--keep] [--full] [--contention-iters 6]

Timeline: bench_dp.py's megalite ZeRO-3 side (with --keep: --zero3-keep-params) at dp=2, two
gloo processes of one thread, after two untimed steps; for each timed step and rank, every
gather launch (`launch`: allocating the unit's storage and posting the all-gather), every wait
for a gather (`WAIT`, and whether it had landed when waited for), every reduce-scatter launch
and wait, and the optimizer's calls, in milliseconds from the step's start (--full prints
them all, else the sums and the units waited for longest). Nothing here changes what the step
does: the buffer's methods are wrapped, as profile_peers.py labels its phases.

Contention: per rank, the forward and backward of one of the model's layers alone; one
all-gather of a layer's bytes alone; and the layer's forward and backward while that gather is
in flight. On 2 cores with 2 ranks of one compute thread, gloo's own thread has no idle core:
the third figure minus the first is what the "overlapped" gather still costs.
"""

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megalite.kernels import TORCH_OPS  # noqa: E402

from bench._common import timed  # noqa: E402
from bench.parallel import _dp_sides, bench_dp  # noqa: E402
from megalite.model.env import LayerEnv  # noqa: E402
from megalite.model.gpt import GPTChunk  # noqa: E402
from megalite.parallel import comm  # noqa: E402
from megalite.parallel.groups import build_groups  # noqa: E402
from megalite.parallel.reducers import ReduceScatterEachMicrobatch as Reducer  # noqa: E402
from megalite.parallel.topology import Topology  # noqa: E402
from megalite.parallel.zero3 import Zero3Buffer  # noqa: E402
from megalite.testing import spawn  # noqa: E402

EVENTS: list = []  # (ms from the step's start, ms taken, what, unit, F/B, note)
START = [0.0]


def _ms() -> float:
    return (time.perf_counter() - START[0]) * 1e3


def _record(what, t, unit="", phase="", note=""):
    EVENTS.append((t, _ms() - t, what, unit, phase, note))


def instrument():
    gather, launch, complete = Zero3Buffer._gather, Reducer.launch, Reducer._complete

    def unit(reducer, b):  # (a Zero3Buffer's reducer reports each launch to it)
        buf = getattr(reducer.on_launch, "__self__", None)
        return buf._unit_of[b].name if isinstance(buf, Zero3Buffer) else ""

    def _gather(self, u, wait=True, whole=False):
        phase = "F" if torch.is_grad_enabled() else "B"  # (backward's hooks run without grad)
        if not u.gathered:
            t = _ms()
            gather(self, u, wait=False, whole=whole)
            _record("launch", t, u.name, phase)
        if wait and u.works:
            t, landed = _ms(), all(w is None or w.is_completed() for w in u.works)
            gather(self, u, wait=True, whole=whole)
            _record("WAIT", t, u.name, phase, "landed" if landed else "in flight")

    def _launch(self, b):
        t = _ms()
        launch(self, b)
        _record("rs launch", t, unit(self, b))

    def _complete(self, work, b, g, out):
        t, landed = _ms(), work is None or work.is_completed()
        complete(self, work, b, g, out)
        _record("rs wait", t, unit(self, b), note="landed" if landed else "in flight")

    Zero3Buffer._gather, Reducer.launch, Reducer._complete = _gather, _launch, _complete


def _marked(fn, what):
    def call(*args, **kwargs):
        t = _ms()
        out = fn(*args, **kwargs)
        _record(what, t)
        return out

    return call


def timeline(rank, world, a):
    torch.set_num_threads(1)
    instrument()
    m = _dp_sides.model_config(a)
    groups = build_groups(Topology(dp=world), torch.device("cpu"))
    step = _dp_sides.megalite_side(a, m, groups, 3, keep_params=a.keep)
    for name in ("zero_grad", "finalise_grads", "step"):
        setattr(step.opt, name, _marked(getattr(step.opt, name), f"opt.{name}"))
    batches = _dp_sides.make_batches(a, m, rank, 2)
    for i in range(2):
        step(batches[i]), step.finish()
    out = []
    for i in range(a.steps):
        dist.barrier()
        EVENTS.clear()
        START[0] = time.perf_counter()
        step(batches[i % 2])
        out.append((_ms(), list(EVENTS)))
    return out


def contention(rank, world, a):
    torch.set_num_threads(1)
    m = _dp_sides.model_config(a)
    groups = build_groups(Topology(dp=world), torch.device("cpu"))
    layer = GPTChunk(m, LayerEnv(ops=TORCH_OPS, seed=1)).layers["0"]
    n = sum(p.numel() for p in layer.parameters()) // 2 * 2
    full, shard = torch.empty(n), torch.randn(n // 2)
    x = torch.randn(a.mbs, a.seq, a.hidden, requires_grad=True)

    def compute():
        layer(x).sum().backward()

    def gather(async_op):
        return comm.all_gather(full, shard, groups.dp, async_op=async_op)  # (as a unit's)

    def beside():
        w = gather(True)
        compute()
        w.wait()

    def alone():
        gather(False)

    runs = {"layer alone": compute, "gather alone": alone, "layer beside": beside}
    times = {k: [] for k in runs}
    for it in range(a.contention_iters + 1):
        for k, fn in runs.items():
            with timed(barrier=lambda: dist.barrier(groups.dp.pg)) as t:
                for _ in range(4):
                    fn()
            if it:  # (the first round warms up)
                times[k].append(t.wall / 4 * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}, n * 4


def _summary(events) -> str:
    total = lambda what, note=None: sum(  # noqa: E731
        e[1] for e in events if e[2] == what and (note is None or e[5] == note)
    )
    waits = {}
    for e in events:
        if e[2] == "WAIT":
            waits[f"{e[3]}/{e[4]}"] = waits.get(f"{e[3]}/{e[4]}", 0.0) + e[1]
    top = sorted(waits.items(), key=lambda kv: -kv[1])[:6]
    return (f"gather waits {total('WAIT'):.0f} ms ({total('WAIT', 'in flight'):.0f} on gathers "
            f"in flight), launches {total('launch'):.0f}, reduce-scatter launches "
            f"{total('rs launch'):.0f} (their waits {total('rs wait'):.0f} inside), optimizer "
            f"step {total('opt.step'):.0f}; longest waits (unit/F or B, ms): "
            + ", ".join(f"{k} {v:.0f}" for k, v in top))  # fmt: skip


def main():
    ap = bench_dp.parser()
    ap.description = __doc__.split("\n")[0]
    ap.add_argument("--steps", type=int, default=2, help="timed steps")
    ap.add_argument("--keep", action="store_true", help="--zero3-keep-params")
    ap.add_argument("--full", action="store_true", help="print every event of the last step")
    ap.add_argument("--contention-iters", type=int, default=6)
    a = ap.parse_args()
    res = spawn(timeline, 2, a, timeout=1800)
    for s in range(a.steps):
        print(f"step {s}: " + ", ".join(f"rank {r} {res[r][s][0]:.0f} ms" for r in (0, 1)))
        for r in (0, 1):
            print(f"  rank {r}: {_summary(res[r][s][1])}")
    if a.full:
        for r in (0, 1):
            print(f"\nrank {r}, step {a.steps - 1} (ms from its start, ms taken):")
            for t, took, what, unit, phase, note in res[r][-1][1]:
                print(f"  {t:8.1f} {took:6.1f}  {what:18s} {unit:10s} {phase} {note}")
    if a.contention_iters:
        print("\nforward + backward of one layer, median ms:")
        for r, (times, nbytes) in enumerate(spawn(contention, 2, a, timeout=900)):
            cost = times["layer beside"] - times["layer alone"]
            print(f"  rank {r}: " + ", ".join(f"{k} {v:.1f}" for k, v in times.items())
                  + f"; the gather of {nbytes / 2**20:.2f} MiB in flight costs the layer "
                  f"{cost:.1f} ms of the {times['gather alone']:.1f} it takes alone")  # fmt: skip


if __name__ == "__main__":
    main()
