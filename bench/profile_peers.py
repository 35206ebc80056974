"""Where a data-parallel or a pipeline step goes: megalite against torch's DDP, FSDP2 and
Schedule1F1B, profiled op by op into profile_tp.py's buckets.

    .venv/bin/python bench/profile_peers.py dp [bench_dp.py's flags] [--profile-steps 2]
    .venv/bin/python bench/profile_peers.py pp|zb [bench_pipeline.py's flags] [--profile-steps 2]

dp: megalite ZeRO-0 and DDP, megalite ZeRO-2 and FSDP2 (reshard_after_forward=False), built by
bench_dp.py (same model, weights, batches and foreach AdamW) at dp=2. pp: megalite 1F1B and
torch's Schedule1F1B at pp=2, built by bench_pipeline.py; zb: megalite ZB-V and torch's
ScheduleZBVZeroBubble, the same way. Two gloo processes of one thread each; every side runs
one warm-up step, then --profile-steps steps under torch.profiler, and the training thread's
events go into profile_tp.py's buckets (gemm, other compute, collectives, dispatch, python).

Labelled as collectives besides megalite's `comm` calls: megalite's p2p waits and torch
pipelining's (`_wait_batch_p2p`). gloo's records of asynchronous work ("gloo:send", a bucket's
"gloo:allreduce" ...) span the time the work was in flight, overlapping compute, and are left
out; waits for asynchronous reductions (megalite's `finalise_grads`, DDP's reducer, FSDP2's)
are not operators: they count as python.

Per pair, what it implies: the peer's step over megalite's compute (gemm + other compute) is the
best ratio megalite could reach with no time outside compute at all, set beside the target.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import bench_dp, bench_pipeline  # noqa: E402
from bench._common import machine  # noqa: E402
from bench.profile_tp import _labelled, label_comm, profile, table  # noqa: E402
from megalite.parallel import p2p  # noqa: E402
from megalite.parallel.groups import build_groups  # noqa: E402
from megalite.parallel.topology import Topology  # noqa: E402
from megalite.testing import spawn  # noqa: E402

# gloo's records of asynchronous work (p2p, bucket reductions): spans of work in flight
ASYNC = ("gloo:",)
# (megalite side, peer, target ratio: the peer's step over megalite's)
PAIRS = {"dp": [("zero0", "ddp", 1.0), ("zero2", "fsdp2", 1.2)],
         "pp": [("megalite 1F1B", "torch Schedule1F1B", 1.1)],
         "zb": [("megalite zbv", "torch ScheduleZBVZeroBubble", 1.0)]}  # fmt: skip


def _sides(kind, a, rank, world):
    """{name: a function running one step} for `kind`."""
    if kind == "dp":
        m = bench_dp.model_config(a)
        groups = build_groups(Topology(dp=world), torch.device("cpu"))
        batch = bench_dp._batches(a, m, rank, 1)[0]
        zero = lambda s: bench_dp.megalite_side(a, m, groups, s)  # noqa: E731
        sides = {"zero0": zero(0), "ddp": bench_dp.torch_side(a, m, "ddp"),
                 "zero2": zero(2), "fsdp2": bench_dp.torch_side(a, m, "fsdp2")}  # fmt: skip
        return {k: (lambda s=s: (s(batch), s.finish())) for k, s in sides.items()}
    groups = build_groups(Topology(pp=world), torch.device("cpu"))
    if kind == "zb":
        return {"megalite zbv": bench_pipeline._megalite(a, groups, rank, "zbv", 2),
                "torch ScheduleZBVZeroBubble": bench_pipeline._torch(a, groups, rank, 2, "zbv")}  # fmt: skip
    return {"megalite 1F1B": bench_pipeline._megalite(a, groups, rank, "1f1b", 1),
            "torch Schedule1F1B": bench_pipeline._torch(a, groups, rank, 1)}  # fmt: skip


def run(rank, world, kind, a):
    from torch.distributed.pipelining import schedules

    torch.set_num_threads(1)
    label_comm()
    p2p.Batch.wait = _labelled(p2p.Batch.wait, "megalite.comm.p2p_wait")
    schedules._wait_batch_p2p = _labelled(schedules._wait_batch_p2p, "c10d.p2p_wait")
    return profile(_sides(kind, a, rank, world), a.profile_steps, ASYNC)


def main():
    kind, rest = sys.argv[1] if len(sys.argv) > 1 else "", sys.argv[2:]
    if kind not in PAIRS:
        raise SystemExit(
            f"usage: profile_peers.py {'|'.join(PAIRS)} [the benchmark's flags] [--profile-steps N]"
        )
    ap = bench_dp.parser() if kind == "dp" else bench_pipeline.parser()
    ap.add_argument("--profile-steps", type=int, default=2, help="profiled steps per side")
    a = ap.parse_args(rest)
    if kind != "dp" and a.pp != 2:
        raise SystemExit(f"profile_peers.py {kind} runs at --pp 2")
    print(f"machine: {machine()}; {kind} on CPU gloo, 2 processes x 1 thread")
    mean, wall = table(spawn(run, 2, kind, a, timeout=1800), a.profile_steps)
    print("\neach target against megalite's compute floor (gemm + other compute):")
    for ours, theirs, target in PAIRS[kind]:
        floor = mean[ours]["gemm"] + mean[ours]["other compute"]
        peer = mean[theirs]["gemm"] + mean[theirs]["other compute"]
        print(f"  {ours} vs {theirs}: target {target}x needs {wall[theirs] / target:.3f} s; "
              f"megalite computes {floor:.3f} s ({theirs} {peer:.3f} s) and spends "
              f"{wall[ours] - floor:.3f} s elsewhere ({theirs} {wall[theirs] - peer:.3f} s); "
              f"best possible with zero non-compute time: {wall[theirs] / floor:.2f}x; "
              f"measured {wall[theirs] / wall[ours]:.2f}x")  # fmt: skip
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
