"""A fake world: chosen ranks of a large layout run their real training step, one process
each, on fake tensors (CPU ones standing for the GPU; `--fake-world-device cuda` on a machine
with one) over torch's fake process group, to prove without a GPU that

- every group's members issue the same collectives in the same order (op, shape, dtype): a
  rank that skips or adds one hangs NCCL or corrupts the result (the schedule's p2p is proven
  by pipeline/verify.py; this covers the rest);
- a non-logging step reads the host once (the optimizer's status), counted on the CUDA path:
  host reads and blocking host-to-device copies (megalite/training/fake_cuda.py);
- each rank's device memory peaks where the planner says (megalite/plan/: the peak of the
  storages its ops create, fake_memory.py, next to the plan of the torch ops that ran).

Witnesses: the members of a group differ only along that group's axes, so comparing a group
needs ranks that differ along them. `witnesses()` takes rank 0 and, for each axis, its
neighbours along that axis (every position of pp; the first, second and last of the others:
positions in between run the same code on the same shapes), at the first and the last
pipeline stage (the embedding and the head differ). Every group with two witnesses or more in
it is compared; the world's and the products' groups too.

`run_roles(cfg, world, ranks)` runs them (one spawned process each: the default process group
is global per process); `match(reports)` compares; `--dry-run --fake-world` prints it all.
"""

import contextlib
import multiprocessing as mp
import os
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megalite.errors import MegaliteError

COLLECTIVES = ("all_reduce", "all_gather_single", "reduce_scatter_single", "broadcast",
               "all_to_all_single", "all_gather_object", "gather_object", "barrier")  # fmt: skip


@dataclass
class RoleReport:
    """One rank's fake step: per group (its ranks) the collectives it issued in order, the
    groups it belongs to, host syncs of the counted step (and where), device bytes at peak."""

    rank: int
    coords: dict
    calls: dict  # ranks tuple -> [(op, shape, dtype), ...]
    groups: dict  # kind -> ranks tuple: every group this rank is a member of
    syncs: int = 0
    where: list = field(default_factory=list)
    peak_bytes: int = 0  # at any moment (fake_memory.StorageTrace)
    planned_bytes: int = 0  # the planner's total for this rank's stage
    seconds: float = 0.0
    phases: dict = field(default_factory=dict)  # launch phase -> seconds (launch_phases.py)
    group_count: object = None  # fake_groups.GroupCount: how its groups were made


class Recorder:
    """Patches torch.distributed's collectives (comm.py and p2p.py call them through the module)
    to note (op, shape, dtype) per group before passing the call on."""

    def __init__(self, world_size: int):
        self.calls = defaultdict(list)
        self.world = tuple(range(world_size))
        self._ranks = {}

    def ranks(self, pg) -> tuple:
        if pg is None or pg is dist.group.WORLD:
            return self.world
        if pg not in self._ranks:
            self._ranks[pg] = tuple(dist.get_process_group_ranks(pg))
        return self._ranks[pg]

    def note(self, op: str, pg, t):
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else ()
        if op == "all_to_all_single" and shape:  # the rows sent depend on the routing
            shape = ("*", *shape[1:])
        dtype = str(t.dtype).removeprefix("torch.") if isinstance(t, torch.Tensor) else "object"
        self.calls[self.ranks(pg)].append((op, shape, dtype))

    def __enter__(self):
        self.saved = {n: getattr(dist, n) for n in COLLECTIVES}

        def wrap(name, fn):
            def recorded(*args, **kw):
                pg = kw.get("group")
                t = args[1] if name in ("all_gather_single", "reduce_scatter_single") else (
                    args[0] if args and name != "barrier" else None)  # fmt: skip
                self.note(name, pg, t)
                return fn(*args, **kw)

            return recorded

        for name, fn in self.saved.items():
            setattr(dist, name, wrap(name, fn))
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def witnesses(topo, full: bool = True) -> list[int]:
    """Rank 0's neighbours along each axis at the first and the last pipeline stage, and every
    pipeline stage of rank 0 (see the module's docstring). Not `full`: every stage of rank 0
    and its next neighbour along each other axis (the first stage's groups compared only)."""
    if not full:
        others = {topo.stride(a) for a in topo.axes if a != "pp" and topo.size(a) > 1}
        return sorted({*(topo.rank(pp=i) for i in range(topo.size("pp"))), *others})
    last = topo.size("pp") - 1
    out = set()
    for stage in {0, last}:
        base = topo.rank(pp=stage)
        for axis in topo.axes:
            n = topo.size(axis)
            picks = range(n) if axis == "pp" else sorted({0, min(1, n - 1), n - 1})
            for i in picks:
                if axis == "pp":
                    out.add(topo.rank(pp=i))
                else:
                    out.add(base + i * topo.stride(axis))
    return sorted(out)


def _int_fill(cfg, shape) -> int:
    """The routing counts a fake read returns: each expert's share of a rank's assignments
    under balanced routing (T tokens x k choices / E experts)."""
    m = cfg.model
    if not m.num_experts:
        return 1
    tokens = cfg.training.micro_batch_size * m.seq_length // (shape.cp * shape.tp)
    return max(1, tokens * m.moe_router_topk // m.num_experts)


def _grouped_mm(x, w, offsets):
    """Grouped GEMM's shapes and gradients without reading `offsets` (the torch reference checks
    them on the host, where the GPU kernel reads them on the device): (n, in) x (E, out, in)."""
    return x @ w[0].transpose(0, 1)


@contextmanager
def _fake_kernels():
    """The ops the model is built with, with `_grouped_mm` in place of the grouped GEMM."""
    from megalite import kernels

    real = kernels.select
    kernels.select = lambda mode, device: kernels.override(real(mode, device),
                                                           grouped_mm=_grouped_mm)  # fmt: skip
    try:
        yield
    finally:
        kernels.select = real


def run_role(cfg, world_size: int, rank: int, steps: int = 2) -> RoleReport:
    """Play `rank` of a `world_size` run of `cfg`: build its trainer on fake CUDA tensors over
    the fake process group and run `steps` non-logging steps; the last is counted. In a fresh
    process (it starts the default process group)."""
    from dataclasses import replace
    from types import SimpleNamespace

    import numpy as np
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megalite.parallel.groups import build_groups
    from megalite.plan.layouts import plan
    from megalite.shape import validate
    from megalite.training.fake_cuda import fake_cuda
    from megalite.training.fake_groups import GroupCounter, member_groups
    from megalite.training.fake_memory import StorageTrace
    from megalite.training.launch_phases import LaunchPhases
    from megalite.training.trainer import Trainer

    t0 = time.perf_counter()
    device = cfg.training.fake_world_device  # cpu unless --fake-world-device cuda
    os.environ.setdefault("LOCAL_RANK", "1")  # no layout warnings from every role
    shape = validate(cfg, world_size)
    launch = LaunchPhases()  # the phases a real launch times (launch.py), on this rank
    with launch.phase("rendezvous"):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    topo = shape.topology()
    m = cfg.model
    rows = np.random.default_rng(0).integers(0, m.vocab_size, (64, m.seq_length + 1))
    with (
        Recorder(world_size) as rec,
        fake_cuda(_int_fill(cfg, shape), gpu=device) as fake,
        _fake_kernels(),
    ):
        mem = StorageTrace()
        with launch.phase("groups"), GroupCounter(rank) as counted:
            groups = build_groups(topo, torch.device(device))
        counted.count.member_of = member_groups(groups)
        with mem:
            trainer = Trainer(cfg, shape, groups, SimpleNamespace(train=rows, valid=None,
                                                                  tokenizer=None), launch)  # fmt: skip
            rec.calls.clear()  # group creation is not a step's
            mem.reset_peak()  # the host's whole initial tensors are gone (fake_memory.py)
            for i in range(steps):
                fake.reset()
                with launch.phase("first step") if i == 0 else contextlib.nullcontext():
                    trainer.train_step(log=False)
    # by name: a2a+p2p's two levels of cp are groups of kind "cp" too (their bytes are cp's)
    named = [*groups.groups.items(), ("embed", groups.embed), ("world", groups.world)]
    members = {k: tuple(g.ranks) for k, g in named if g is not None}
    # the plan of what ran: the torch ops (Triton does not run on fake tensors)
    ran = replace(cfg, training=replace(cfg.training, kernels="torch"))
    planned = plan(ran, shape).stages[topo.coords(rank)["pp"]]["total"]
    return RoleReport(rank, topo.coords(rank), dict(rec.calls), members, fake.syncs,
                      [w for w, _ in fake.where], mem.peak, planned, time.perf_counter() - t0,
                      dict(launch.seconds), counted.count)  # fmt: skip


def _entry(cfg, world_size, rank, path):
    import pickle
    import traceback
    import warnings

    warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
    try:
        out = (run_role(cfg, world_size, rank), None)
    except BaseException as e:  # the parent reports it
        out = (None, f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    with open(path, "wb") as fh:
        pickle.dump(out, fh)


def run_roles(cfg, world_size: int, ranks: list[int], parallel: int = 2,
              timeout: float = 300) -> list[RoleReport]:  # fmt: skip
    """`run_role` for each of `ranks`, one spawned process each, `parallel` at a time; each
    hands its report back in a file."""
    import pickle
    import tempfile

    ctx = mp.get_context("spawn")
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(0, len(ranks), parallel):
            procs = []
            for r in ranks[i : i + parallel]:
                p = ctx.Process(target=_entry, args=(cfg, world_size, r, f"{tmp}/{r}.pkl"))
                p.start()
                procs.append((r, p))
            for r, p in procs:
                p.join(timeout)
                if p.is_alive():
                    p.kill()
                    raise RuntimeError(f"rank {r} of the fake world ran past {timeout}s")
                try:
                    with open(f"{tmp}/{r}.pkl", "rb") as fh:
                        report, error = pickle.load(fh)
                except FileNotFoundError:
                    report, error = None, f"exited with {p.exitcode} and no report"
                if error:
                    raise RuntimeError(f"rank {r} of the fake world failed: {error}")
                out[r] = report
    return [out[r] for r in ranks]


@dataclass
class Matching:
    """Per group kind: how many groups were compared, and the mismatches found."""

    compared: dict  # kind -> number of groups with two witnesses or more
    mismatches: list  # (kind, group ranks, rank a, rank b, first differing position, a's, b's)

    @property
    def ok(self) -> bool:
        return not self.mismatches


def match(reports: list[RoleReport]) -> Matching:
    """Compare, for every group that holds two reports or more, their sequences for it."""
    groups = {}
    for r in reports:
        for kind, ranks in r.groups.items():
            groups.setdefault(ranks, kind)
    by_rank = {r.rank: r for r in reports}
    compared, bad = defaultdict(int), []
    for ranks, kind in sorted(groups.items(), key=lambda kv: (kv[1], kv[0])):
        present = [by_rank[x] for x in ranks if x in by_rank]
        if len(ranks) < 2 or len(present) < 2:
            continue
        compared[kind] += 1
        first = present[0].calls.get(ranks, [])
        for other in present[1:]:
            seq = other.calls.get(ranks, [])
            if seq != first:
                i = next((i for i, (a, b) in enumerate(zip(first, seq)) if a != b),
                         min(len(first), len(seq)))  # fmt: skip
                bad.append((kind, ranks, present[0].rank, other.rank, i,
                            first[i] if i < len(first) else None,
                            seq[i] if i < len(seq) else None))  # fmt: skip
    return Matching(dict(compared), bad)


def expected_syncs(cfg, shape, pp_rank: int) -> int:
    """Host reads of a non-logging step on a rank of stage `pp_rank`: the optimizer's status,
    and with experts over ep > 1 the dispatch sizes of every MoE layer it holds, once per
    micro-batch (the all-to-all's split sizes, as in Megatron; the head's MTP modules' too)."""
    if shape.ep <= 1:
        return 1
    m = cfg.model
    chunks = shape.partition.rank_chunks(pp_rank)
    mtp = range(m.num_layers, m.num_layers + m.mtp_num_layers)  # layer L + k (model/mtp.py)
    moe = sum(m.is_moe_layer(i) for kw in chunks
              for i in [*kw["layers"], *(mtp if kw["has_head"] else ())])  # fmt: skip
    return 1 + moe * shape.microbatches


def print_fake_world(cfg, shape, parallel: int = 2) -> bool:
    """`--dry-run --fake-world`: the witnesses of `shape`'s world run a step; per group kind the
    groups compared and any mismatch, per rank its seconds, host syncs and memory peak next to
    the planner's. True when every group matched and every rank read the host as often as
    `expected_syncs` says (once, plus MoE dispatch sizes with ep > 1)."""
    from dataclasses import replace

    if cfg.training.fake_world_device == "cuda" and not torch.cuda.is_available():
        raise MegaliteError(
            "--fake-world-device cuda needs a CUDA build of torch and a visible GPU (without one "
            "backward and Triton fail: docs/fake_world.md); use --fake-world-device cpu"
        )
    vocab = cfg.model.vocab_size or cfg.data.tokenizer_vocab_size
    cfg = replace(cfg, model=replace(cfg.model, vocab_size=vocab))
    ranks = witnesses(shape.topology())
    print(f"fake world: {shape.world_size} ranks ({shape}), running ranks {ranks}", flush=True)
    reports = run_roles(cfg, shape.world_size, ranks, parallel)
    m = match(reports)
    for kind, n in sorted(m.compared.items()):
        bad = [x for x in m.mismatches if x[0] == kind]
        print(
            f"  {kind:>8}: {n} group(s) compared, "
            + (f"{len(bad)} MISMATCHED" if bad else "matched")
        )
    for kind, ranks_, a, b, i, first, other in m.mismatches[:10]:
        print(f"    {kind} {ranks_[:4]}...: rank {a} issues {first} at #{i}, rank {b} {other}")
    print("  rank   coords                     s  syncs  peak MiB  planned MiB    off"
          "  groups made/in  world ops")  # fmt: skip
    for r in reports:
        coords = " ".join(f"{k}{v}" for k, v in r.coords.items() if shape.size(k) > 1)
        g = r.group_count
        print(f"  {r.rank:>5}  {coords:<24} {r.seconds:5.1f}  {r.syncs:>5}  "
              f"{r.peak_bytes / 2**20:8.1f}  {r.planned_bytes / 2**20:11.1f}  "
              f"{r.peak_bytes / max(r.planned_bytes, 1) - 1:+5.0%}"
              f"  {f'{g.created}/{g.member_of}':>14}  {g.world_ops:>9}")  # fmt: skip
    from megalite.plan.links import recorded

    for r in reports[:1]:  # what rank 0 recorded, through the planner's per-link factors
        b = recorded(r.calls, min(8, shape.world_size))
        print(f"  rank {r.rank}'s recorded collectives (no p2p, no all-to-all): "
              f"{b['nvlink'] / 1e6:.2f} MB over NVLink, {b['network'] / 1e6:.2f} MB over the "
              "network (8 GPUs per node)")  # fmt: skip
    phases = {p: max(r.phases.get(p, 0.0) for r in reports) for p in reports[0].phases}
    print("  launch phases, slowest witness: "
          + ", ".join(f"{p} {s:.2f} s" for p, s in phases.items()))  # fmt: skip
    return m.ok and all(r.syncs == expected_syncs(cfg, shape, r.coords["pp"]) for r in reports)
