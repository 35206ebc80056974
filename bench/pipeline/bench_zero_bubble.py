"""Zero-bubble schedules side by side with 1F1B and interleaved 1F1B, on stages that sleep.

    .venv/bin/python bench/pipeline/bench_zero_bubble.py [--pp 4] [--microbatches 8] [--t 0.05] [--rounds 3]

Every stage sleeps t per forward and t for each half of its backward (the input gradient I and
the weight gradients W: a full backward sleeps 2t), so the step time is set by the schedule
alone: its bubble, its messages and the executor's overhead, not by two oversubscribed cores.
At pp 4, m 8 and F = I = W the 1F1B bubble bounds any schedule's gain at (m + p - 1)/m =
1.375x; the target is ZB-V >= 1.25x megalite's 1F1B. Reported: step time per schedule (the
median over rounds, each schedule once per round, in turn), its ratio to 1F1B, and the first
stage's measured bubble (idle over compute, the idle counted against the longest schedule of
any rank) against the schedule's theory, and the part of it the step boundary costs: the first
stage's wait, after its own schedule, for the last rank to finish (what a step that began before
the previous one's optimizer had validated, the paper's optimizer post-validation, would win back).
"""

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from megalite.pipeline.executor import first_stage_times, idle_ratio, run_schedule  # noqa: E402
from megalite.pipeline.partition import rank_chunks  # noqa: E402
from megalite.pipeline.schedules import SCHEDULES, bubble_theory, get_schedule  # noqa: E402
from megalite.testing import SleepChunk, spawn  # noqa: E402

CASES = [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 2), ("dualpipev", 2)]


def _worker(rank, world, m, t, rounds):
    from megalite.parallel.groups import build_groups
    from megalite.parallel.topology import Topology

    groups = build_groups(Topology(pp=world), torch.device("cpu"))
    runs = {}
    for name, vpp in CASES:
        placement = SCHEDULES[name].placement
        chunks = [SleepChunk(**kw, vpp=vpp, seconds=t)
                  for kw in rank_chunks(world * vpp, world, vpp, rank, placement)]  # fmt: skip
        actions = get_schedule(name, world, vpp, m, rank)
        data = [(torch.ones(2, 4), None)] * m
        runs[name] = (chunks, actions, data, placement)
    out = {name: [] for name, _ in CASES}
    for _ in range(rounds + 1):  # the first round warms up
        for name, _ in CASES:
            chunks, actions, data, placement = runs[name]
            r = run_schedule(actions, chunks, groups, data, hidden_shape=(2, 4),
                             dtype=torch.float32, placement=placement)  # fmt: skip
            compute, step = first_stage_times([r], groups.pp)
            # on rank 0: its idle within its own schedule, had it not to wait for the last rank
            own = idle_ratio(r.compute_s, r.step_s)
            out[name].append((step, idle_ratio(compute, step), own))
    return {k: v[1:] for k, v in out.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--t", type=float, default=0.05, help="seconds per F, I or W of a stage")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    res = spawn(_worker, a.pp, a.microbatches, a.t, a.rounds, timeout=1800)[0]
    step = {k: statistics.median(s for s, _, _ in v) for k, v in res.items()}
    print(f"pp={a.pp} m={a.microbatches} F=I=W={a.t * 1e3:.0f} ms, median of {a.rounds} rounds")
    print("| schedule | step (s) | speed vs 1F1B | bubble measured | bubble theory | "
          "of which the step boundary |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, vpp in CASES:
        bub = statistics.median(b for _, b, _ in res[name])
        boundary = statistics.median(b - own for _, b, own in res[name])
        theory = bubble_theory(a.pp, vpp, a.microbatches, name)
        print(f"| {name} | {step[name]:.3f} | {step['1f1b'] / step[name]:.3f}x | {bub:.3f} | "
              f"{theory:.3f} | {boundary:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
