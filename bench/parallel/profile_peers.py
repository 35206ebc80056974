"""Where a data-parallel or a pipeline step goes: megalite against torch's DDP, FSDP2 and
Schedule1F1B, profiled op by op into profile_tp.py's buckets.

    .venv/bin/python bench/parallel/profile_peers.py dp [bench_dp.py's flags] [--profile-steps 2]
    .venv/bin/python bench/parallel/profile_peers.py ds [bench_dp.py's flags] [--profile-steps 2]
    .venv/bin/python bench/parallel/profile_peers.py pp|zb [bench_pipeline.py's flags] [--profile-steps 2]

dp: megalite ZeRO-0 and DDP, megalite ZeRO-2 and FSDP2 (reshard_after_forward=False), built by
bench_dp.py (same model, weights, batches and foreach AdamW) at dp=2. ds: megalite ZeRO-1/2/3
and DeepSpeed's stages 1/2/3, built by bench_deepspeed.py (which runs it in .venv-peers,
creating it on first use). pp: megalite 1F1B and
torch's Schedule1F1B at pp=2, built by bench_pipeline.py; zb: megalite ZB-V and torch's
ScheduleZBVZeroBubble, the same way. Two gloo processes of one thread each; every side runs
one warm-up step, then --profile-steps steps under torch.profiler, and the training thread's
events go into profile_tp.py's buckets (gemm, other compute, collectives, dispatch, python).

Labelled as collectives besides megalite's `comm` calls: megalite's p2p waits and torch
pipelining's (`_wait_batch_p2p`). gloo's records of asynchronous work ("gloo:send", a bucket's
"gloo:allreduce" ...) span the time the work was in flight, overlapping compute, and are left
out; waits for asynchronous reductions (megalite's `finalise_grads`, DDP's reducer, FSDP2's)
are not operators: they count as python.

dp and ds also time the phases of a step (a second table, inclusive seconds per step, each
phase labelled with `record_function`; their own Python time stays in the python bucket):
megalite's gradient zeroing, gradient hooks (the copy or add into the bucket, launching its
reduction), the wait for the reductions after backward, the global norm, AdamW, the launch of
and the waits for the parameter gathers, ZeRO-3's gathers and frees, and the whole
optimizer step (norm, clipping, AdamW, gather launch); DeepSpeed's bucket reductions, its
norm, its optimizer step and its engine's backward and step calls.

Per pair, what it implies: the peer's step over megalite's compute (gemm + other compute) is the
best ratio megalite could reach with no time outside compute at all, set beside the target.
"""

import importlib.util
import logging
import os
import statistics
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench._common import machine  # noqa: E402
from bench.parallel import _dp_sides, bench_dp  # noqa: E402
from bench.parallel.profile_tp import _labelled, buckets, label_comm, profile, table  # noqa: E402
from bench.pipeline import bench_pipeline  # noqa: E402
from megalite.parallel import p2p  # noqa: E402
from megalite.parallel.groups import build_groups  # noqa: E402
from megalite.parallel.topology import Topology  # noqa: E402
from megalite.testing import spawn  # noqa: E402

# gloo's records of asynchronous work (p2p, bucket reductions): spans of work in flight
ASYNC = ("gloo:",)
# (megalite side, peer, target ratio: the peer's step over megalite's)
PAIRS = {"dp": [("zero0", "ddp", 1.05), ("zero2", "fsdp2", 1.2)],
         "ds": [(f"zero{s}", f"ds{s}", 1.2) for s in (1, 2, 3)],
         "pp": [("megalite 1F1B", "torch Schedule1F1B", 1.1)],
         "zb": [("megalite zbv", "torch ScheduleZBVZeroBubble", 1.0)]}  # fmt: skip


def _sides(kind, a, rank, world):
    """{name: a function running one step} for `kind`."""
    if kind == "dp":
        m = _dp_sides.model_config(a)
        groups = build_groups(Topology(dp=world), torch.device("cpu"))
        batch = _dp_sides.make_batches(a, m, rank, 1)[0]
        zero = lambda s: _dp_sides.megalite_side(a, m, groups, s)  # noqa: E731
        sides = {"zero0": zero(0), "ddp": _dp_sides.torch_side(a, m, "ddp"),
                 "zero2": zero(2), "fsdp2": _dp_sides.torch_side(a, m, "fsdp2")}  # fmt: skip
        return {k: (lambda s=s: (s(batch), s.finish())) for k, s in sides.items()}
    if kind == "ds":
        import deepspeed

        from bench.parallel import bench_deepspeed

        m = _dp_sides.model_config(a)
        groups = build_groups(Topology(dp=world), torch.device("cpu"))
        os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
        deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
        batch = _dp_sides.make_batches(a, m, rank, 1)[0]
        sides = {}
        for s in (1, 2, 3):
            sides[f"zero{s}"] = _dp_sides.megalite_side(a, m, groups, s)
            sides[f"ds{s}"] = bench_deepspeed.deepspeed_side(a, m, s)
        return {k: (lambda s=s: (s(batch), s.finish())) for k, s in sides.items()}
    groups = build_groups(Topology(pp=world), torch.device("cpu"))
    if kind == "zb":
        return {"megalite zbv": bench_pipeline._megalite(a, groups, rank, "zbv", 2),
                "torch ScheduleZBVZeroBubble": bench_pipeline._torch(a, groups, rank, 2, "zbv")}  # fmt: skip
    return {"megalite 1F1B": bench_pipeline._megalite(a, groups, rank, "1f1b", 1),
            "torch Schedule1F1B": bench_pipeline._torch(a, groups, rank, 1)}  # fmt: skip


# phase labels: (module or class, attribute, label); patched before the sides are built (hooks
# bind their methods when registered)
MEGALITE_PHASES = [
    ("megalite.parallel.data_parallel:GradBuffer", "zero_grad", "zero grads"),
    ("megalite.parallel.reducers:StepReducer", "on_grad", "grad hooks"),
    ("megalite.parallel.reducers:StepReducer", "launch", "bucket launch"),
    ("megalite.parallel.data_parallel:GradBuffer", "all_gather_params", "param gather launch"),
    ("megalite.parallel.param_gather", "wait_gathers", "param gather waits"),
    ("megalite.parallel.reducers:ReduceScatterEachMicrobatch", "launch", "bucket launch"),
    ("megalite.parallel.zero3:Zero3Buffer", "_gather", "zero3 gathers"),
    ("megalite.parallel.zero3:Zero3Buffer", "_free", "zero3 frees"),
    ("megalite.optim.distributed_optimizer:DistributedOptimizer", "finalise_grads",
     "reduction wait after backward"),
    ("megalite.optim.distributed_optimizer", "step_status", "global norm"),
    ("megalite.optim.distributed_optimizer:DistributedOptimizer", "_adamw", "adamw"),
    ("megalite.optim.distributed_optimizer:DistributedOptimizer", "step", "optimizer step"),
]  # fmt: skip
DEEPSPEED_PHASES = [
    ("deepspeed.runtime.engine:DeepSpeedEngine", "backward", "ds engine.backward"),
    ("deepspeed.runtime.engine:DeepSpeedEngine", "step", "ds engine.step"),
    ("deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer", "reduce_ipg_grads",
     "ds bucket reduce"),
    ("deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer", "step", "ds optimizer step"),
    ("deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer", "get_grad_norm_direct",
     "ds global norm"),
    ("deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3", "step", "ds optimizer step"),
    ("deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3", "get_grad_norm_direct",
     "ds global norm"),
]  # fmt: skip
PHASE = "phase:"


def label_phases(kind: str):
    """Wrap each phase of PHASES in a `record_function` named PHASE + its label."""
    import importlib

    table = MEGALITE_PHASES + (DEEPSPEED_PHASES if kind == "ds" else [])
    for where, attr, label in table:
        mod, _, cls = where.partition(":")
        owner = importlib.import_module(mod)
        owner = getattr(owner, cls) if cls else owner
        fn = owner.__dict__.get(attr) if cls else getattr(owner, attr)
        if fn is not None:
            setattr(owner, attr, _labelled(fn, PHASE + label))


def phases(events) -> tuple[dict, float]:
    """({label: inclusive seconds}, the labels' own seconds) over the profiled steps: a label
    nested in itself counts once."""
    out, own = {}, 0.0

    def walk(e, open_labels):
        nonlocal own
        inside = open_labels
        if e.name.startswith(PHASE):
            own += e.self_cpu_time_total / 1e6
            label = e.name[len(PHASE) :]
            if label not in open_labels:
                out[label] = out.get(label, 0.0) + e.cpu_time_total / 1e6
            inside = open_labels | {label}
        for c in e.cpu_children:
            walk(c, inside)

    for e in events:
        if e.cpu_parent is None:
            walk(e, frozenset())
    return out, own


def profile_phases(steps: dict, n: int) -> dict:
    """profile_tp.profile's buckets (the phase labels' own time moved back from dispatch to
    python, where it was before they were labelled) and each side's phases, per step."""

    def digest(events, wall):
        top = [e for e in events if e.cpu_parent is None]
        thread = max({e.thread for e in top},
                     key=lambda t: sum(e.cpu_time_total for e in top if e.thread == t))  # fmt: skip
        per = buckets(events, wall, ASYNC)
        ph, own = phases([e for e in events if e.thread == thread])
        per["dispatch"] -= own
        per["python"] += own
        return {"buckets": per, "phases": ph}

    return profile(steps, n, digest=digest)


def phase_table(res: list):
    names = list(res[0])
    labels = list(dict.fromkeys(k for v in names for k in res[0][v]["phases"]))
    print("\nphases, inclusive seconds per step (mean of the ranks; nested phases count in "
          "their parents too):")  # fmt: skip
    print("| phase | " + " | ".join(names) + " |")
    print("| --- |" + " ---: |" * len(names))
    for k in labels:
        cells = [statistics.mean(r[v]["phases"].get(k, 0.0) for r in res) for v in names]
        print(f"| {k} | " + " | ".join(f"{c:.4f}" if c else "-" for c in cells) + " |")


def run(rank, world, kind, a):
    from torch.distributed.pipelining import schedules

    torch.set_num_threads(1)
    label_comm()
    p2p.Batch.wait = _labelled(p2p.Batch.wait, "megalite.comm.p2p_wait")
    schedules._wait_batch_p2p = _labelled(schedules._wait_batch_p2p, "c10d.p2p_wait")
    if kind in ("dp", "ds"):
        if kind == "ds":
            import deepspeed

            deepspeed.utils.logger.setLevel(logging.WARNING)
            warnings.filterwarnings("ignore", category=FutureWarning)
        label_phases(kind)
        sides = _sides(kind, a, rank, world)
        torch.set_num_threads(1)
        return profile_phases(sides, a.profile_steps)
    return profile(_sides(kind, a, rank, world), a.profile_steps, ASYNC)


def main():
    kind, rest = sys.argv[1] if len(sys.argv) > 1 else "", sys.argv[2:]
    if kind == "ds" and importlib.util.find_spec("deepspeed") is None:
        from bench.parallel import bench_deepspeed

        peers = bench_deepspeed.ensure_peers()
        os.execv(str(peers), [str(peers), *sys.argv])
    if kind == "ds":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if kind not in PAIRS:
        raise SystemExit(
            f"usage: profile_peers.py {'|'.join(PAIRS)} [the benchmark's flags] [--profile-steps N]"
        )
    ap = bench_dp.parser() if kind in ("dp", "ds") else bench_pipeline.parser()
    ap.add_argument("--profile-steps", type=int, default=2, help="profiled steps per side")
    a = ap.parse_args(rest)
    if kind in ("pp", "zb") and a.pp != 2:
        raise SystemExit(f"profile_peers.py {kind} runs at --pp 2")
    print(f"machine: {machine()}; {kind} on CPU gloo, 2 processes x 1 thread")
    res = spawn(run, 2, kind, a, timeout=3600)
    mean, wall = table(res, a.profile_steps)
    if "phases" in next(iter(res[0].values())):
        phase_table(res)
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
