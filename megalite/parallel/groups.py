"""torch.distributed set-up and the one `ProcessGroups` object that the rest is handed.

Launched by torchrun, the rank and world come from its environment; launched as a plain
`python pretrain_gpt.py`, the run is a world of one. NCCL is used with CUDA, gloo otherwise.
"""

import dataclasses
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from megalite.parallel.axes import batch_axis, replica_axis, shard_copies_axis, zero_shard_axis
from megalite.parallel.comm import Group
from megalite.parallel.expert_parallel import ExpertGroups
from megalite.parallel.ledger import CommLedger
from megalite.parallel.topology import Topology, world_from_env


class ProcessGroups:
    """The groups of one rank: one per axis of the topology (`groups.tp`, `groups.dp`, ...), with
    experts `groups.ep` and `groups.edp` (Topology.experts; with etp > 1 also `groups.etp`
    and the token exchange's `etp+ep`), the products of axes the run needs
    (`groups.get("dp+cp")`), `cp_levels` (a2a+p2p's two levels of cp), `embed` (the pipeline
    stages holding the tied word embedding and the head; None elsewhere) and `world`. All share
    one `CommLedger`.

    Four products are named for what they are (axes.py's predicates pick their axes):
    - `replica`: the ranks holding the same parameters (every replicated axis: dp, cp, dpr);
      gradients are averaged over it, and the loss with them;
    - `zero_shard`: of those, the ranks ZeRO shards the state over (dp x cp; without
      --dp-replicate the replica group itself);
    - `shard_copies`: the copies of a ZeRO shard group (dpr, --dp-replicate), each shard
      all-reduced over them once a step; one rank unless hybrid sharding;
    - `batch`: the ranks that train on different samples (dp x dpr): the sampler's split and
      the dropout seeds."""

    def __init__(self, topo: Topology, rank: int, device: torch.device, groups: dict,
                 embed: Group | None, world: Group, ledger: CommLedger | None = None):  # fmt: skip
        self.topo, self.rank, self.device = topo, rank, device
        self.groups, self.embed, self.world = groups, embed, world
        self.ledger = ledger or CommLedger()

    def get(self, expr: str) -> Group:
        """The group along an axis or a product of axes ("dp+cp"); size-1 axes do not count."""
        key = _key(self.topo, expr)
        if key not in self.groups:
            raise KeyError(f"no {expr} group was built (build_groups(products=...))")
        return self.groups[key]

    @property
    def experts(self) -> ExpertGroups | None:
        """The expert groups to build an MoE model with (`LayerEnv(experts=...)`), or None where
        the topology has no expert decomposition (experts whole on each rank). The exchange
        runs over etp+ep, counted in the ledger as "ep"."""
        if self.topo.expert is None:
            return None
        etp = self.topo.expert.size("etp")
        g = self.groups["etp+ep"] if etp > 1 else self.groups["ep"]
        return ExpertGroups(dataclasses.replace(g, kind="ep"), etp)

    def __getattr__(self, axis: str) -> Group:
        groups = self.__dict__.get("groups", {})
        if axis in groups:
            return groups[axis]
        raise AttributeError(axis)

    @property
    def cp_levels(self) -> tuple[Group, Group] | None:
        """a2a+p2p's (inner, outer) groups of cp (hierarchical_attention), or None when the
        topology's cp is flat (`topo.cp_a2a`)."""
        if "cp_a2a" not in self.groups:
            return None
        return self.groups["cp_a2a"], self.groups["cp_p2p"]

    @property
    def replica(self) -> Group:
        return self.get(self.topo.product(replica_axis))

    @property
    def zero_shard(self) -> Group:
        return self.get(self.topo.product(zero_shard_axis))

    @property
    def shard_copies(self) -> Group:
        return self.get(self.topo.product(shard_copies_axis))

    @property
    def batch(self) -> Group:
        return self.get(self.topo.product(batch_axis))


def _key(topo: Topology, expr: str) -> str:
    """A group's name: its axes of size > 1 in rank order ("dp+cp" and "cp+dp" are one group)."""
    axes = Topology.split(expr)
    big = [a for a in topo.axes if a in axes and topo.size(a) > 1]
    return "+".join(big) if big else axes[0]


CP_LEVELS = ("cp_a2a", "cp_p2p")  # a2a+p2p's groups; their traffic is counted as cp's


def cp_levels(cp: list[int], rank: int, a2a: int) -> dict[str, list[int]]:
    """a2a+p2p's groups of `rank` in its cp group `cp` (in cp order): the all-to-all's `a2a`
    adjacent cp ranks (cp rank a + a2a·p: a there) and the ring's ranks at the same place of
    every all-to-all group (p there)."""
    i = cp.index(rank)
    first = i - i % a2a
    return {"cp_a2a": cp[first : first + a2a], "cp_p2p": cp[i % a2a :: a2a]}


def single_process_groups(device=None) -> ProcessGroups:
    """A world of one without torch.distributed: every group is this rank alone."""
    device = torch.device(device or "cpu")
    ledger = CommLedger()
    topo = Topology()
    groups = {a: Group(a, [0], 0, None, ledger, device) for a in (*topo.axes, "ep", "edp")}
    world = Group("world", [0], 0, None, ledger, device)
    return ProcessGroups(topo, 0, device, groups, Group("embed", [0], 0, None, ledger, device),
                         world, ledger)  # fmt: skip


def described_groups(topo: Topology, rank: int, device=None) -> ProcessGroups:
    """Rank `rank`'s groups of `topo` without torch.distributed (no communicator: `pg` None),
    on the meta device by default: what a model is built with to be described, not run (the
    dry run's plan). A collective on them is an error."""
    device = torch.device(device or "meta")
    ledger = CommLedger()
    made = {kind: Group(kind, ranks, ranks.index(rank), None, ledger, device)
            for kind, ranks in rank_groups(topo, rank).items()}  # fmt: skip
    world = Group("world", list(range(topo.world_size)), rank, None, ledger, device)
    return ProcessGroups(topo, rank, device, made, made.pop("embed", None), world, ledger)


def init_distributed(
    timeout_minutes: float = 10.0,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> torch.device:
    """Start torch.distributed once per process; returns this rank's device."""
    env_rank, env_world, local_rank = world_from_env()
    rank = env_rank if rank is None else rank
    world_size = env_world if world_size is None else world_size
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        kw = {"timeout": timedelta(minutes=timeout_minutes), "rank": rank, "world_size": world_size}
        if init_method:
            kw["init_method"] = init_method
        elif "MASTER_ADDR" not in os.environ:
            kw["store"] = dist.HashStore()  # a world of one needs no rendezvous
        elif int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0:
            kw["store"] = _restart_store(rank, world_size, kw["timeout"])
        # No device_id: bound to a device, NCCL initialises the world's communicator now and
        # makes every later group by splitting it, a collective of the whole world (ranks
        # outside the group split with "no colour"). Unbound, each group's communicator is
        # made by its members alone, at its first collective (build_groups).
        dist.init_process_group(backend, **kw)
    return device


def _restart_store(rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """The rendezvous store of a group that torchrun restarted (--max-restarts). torchrun keeps
    its store across restarts, and without a fresh prefix the new ranks would read the dead
    ranks' addresses and fail to connect; so each attempt gets keys of its own."""
    env = os.environ
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun hosts the store
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size,
                          is_master=not agent and rank == 0, timeout=timeout)  # fmt: skip
    return dist.PrefixStore(f"megalite/attempt_{env['TORCHELASTIC_RESTART_COUNT']}", store)


def rank_groups(
    topo: Topology, rank: int, products: tuple[str, ...] = (), embed_stages=None
) -> dict[str, list[int]]:
    """{kind: ranks} of the groups `rank` is in, in the order build_groups creates them: each
    axis, the products (those named, then replica, batch, zero_shard and shard_copies), the
    experts' ep and edp, and "embed" where the rank holds one of `embed_stages`
    (default: the first and the last)."""
    out = {a: topo.group(a, rank) for a in topo.axes}
    wanted = [
        topo.product(p) for p in (replica_axis, batch_axis, zero_shard_axis, shard_copies_axis)
    ]
    for expr in [*products, *wanted]:
        key = _key(topo, expr)
        if key not in out:
            out[key] = topo.group(key, rank)
    if topo.expert is not None:  # experts: a second decomposition of the same ranks
        for a in _expert_kinds(topo):
            out[a] = topo.expert.group(a, rank)
    if topo.cp_a2a is not None:  # a2a+p2p: the cp group in two levels
        out.update(cp_levels(out["cp"], rank, topo.cp_a2a))
    stages = [0, topo.size("pp") - 1] if embed_stages is None else embed_stages
    pipeline = topo.group("pp", rank)  # this rank's pipeline: topo.stage_groups' group of it
    held = sorted({pipeline[s] for s in stages})
    if rank in held:
        out["embed"] = held
    return out


def _every_group(topo: Topology, kind: str, stages: list[int]) -> list[list[int]]:
    """Every group of `kind` in the world (rank_groups' kinds)."""
    if kind == "embed":
        return topo.stage_groups(stages)
    if topo.expert is not None and kind in _expert_kinds(topo):
        return topo.expert.groups(kind)
    if kind in CP_LEVELS:
        every = [cp_levels(g, r, topo.cp_a2a)[kind] for g in topo.groups("cp") for r in g]
        return [g for i, g in enumerate(every) if g not in every[:i]]
    return topo.groups(kind)


def _expert_kinds(topo: Topology) -> tuple[str, ...]:
    """The expert groups of a topology with an expert decomposition: ep and edp, and with
    expert tensor parallelism etp and the token exchange's etp+ep."""
    return ("ep", "edp", "etp", "etp+ep") if topo.expert.size("etp") > 1 else ("ep", "edp")


def communicators(topo: Topology, rank: int, **kw) -> int:
    """How many process groups build_groups creates on `rank`: its distinct groups of two
    ranks or more (the world is init_process_group's)."""
    return len({tuple(r) for r in rank_groups(topo, rank, **kw).values() if len(r) > 1})


def build_groups(
    topo: Topology, device: torch.device, timeout_minutes: float = 10.0,
    products: tuple[str, ...] = (), embed_stages: list[int] | None = None,
) -> ProcessGroups:  # fmt: skip
    """Create the groups this rank is in, and no other: each axis, the products named in
    `products` plus those the run needs (replica, batch, zero_shard, shard_copies), the experts'
    ep and edp, and the embedding group of the pipeline stages in `embed_stages` (default: the first
    and the last) where this rank holds one of them.

    One `new_group(..., use_local_synchronization=True)` per group a rank is in: only its
    members call it (torch names the group by a hash of its ranks, not by a world-wide
    counter), and its communicator is made by them alone (see init_distributed). So a rank
    makes O(its groups) calls whatever the world size, where creating every group on every
    rank made O(world) world-wide calls (pytorch #71134). `split_group` would make one
    world-wide split per axis but exists only for NCCL; `new_subgroups_by_enumeration` calls
    new_group for every group on every rank. Members must create shared groups in one order:
    every rank goes through the kinds in the same order and is in one group of each, so
    every group's members get to it (by induction over the kinds)."""
    rank = dist.get_rank()
    if dist.get_world_size() != topo.world_size:
        raise RuntimeError(f"world size {dist.get_world_size()} does not match the layout {topo}")
    ledger = CommLedger()
    timeout = timedelta(minutes=timeout_minutes)
    made = {}  # rank tuple -> process group: a product equal to an axis reuses its group
    mine = rank_groups(topo, rank, products, embed_stages)  # the embedding group last
    # torch names a group made by its members alone after its ranks and the number of groups
    # the creating rank holds. In a fresh world every member holds as many (they go through
    # the same kinds); after an earlier build_groups in the same world (tests that run several
    # layouts in one spawn) members may not (only some held an embedding group), so there
    # every rank makes every group, named by torch's world-wide counter, as it always could.
    if len(dist.distributed_c10d._world.pg_names) <= 1:  # the world alone
        for r in mine.values():
            if tuple(r) not in made:
                made[tuple(r)] = (
                    dist.new_group(r, timeout=timeout, use_local_synchronization=True)
                    if len(r) > 1
                    else None
                )
    else:
        stages = [0, topo.size("pp") - 1] if embed_stages is None else embed_stages
        for kind in [k for k in mine if k != "embed"] + ["embed"]:
            for r in _every_group(topo, kind, stages):
                if tuple(r) not in made:
                    made[tuple(r)] = dist.new_group(r, timeout=timeout) if len(r) > 1 else None
    groups = {
        k: Group("cp" if k in CP_LEVELS else k, r, r.index(rank), made[tuple(r)], ledger, device)
        for k, r in mine.items()
    }
    embed = groups.pop("embed", None)
    world = Group("world", list(range(topo.world_size)), rank,
                  dist.group.WORLD if topo.world_size > 1 else None, ledger, device)  # fmt: skip
    return ProcessGroups(topo, rank, device, groups, embed, world, ledger)


def destroy(groups: ProcessGroups | None = None, barrier: bool = False):
    """Tear down torch.distributed, on every rank in the same order; safe to call again.
    `barrier` (a clean finish): wait until every rank is done, since gloo aborts a rank whose
    peer closes its connections while it still tears down.

    Then `groups` lets go of its process groups: destroy_process_group only forgets torch's own
    references (gloo has no shutdown), and a gloo group joins its worker threads when the last
    one goes. That must happen while the interpreter is whole: a worker still releasing the
    tensors of a finished collective needs the GIL, and asking for it during finalization ends
    the thread with pthread_exit, whose unwinding through torch's noexcept release calls
    std::terminate ("terminate called without an active exception", SIGABRT)."""
    if dist.is_initialized():
        if barrier and dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()
    if groups is not None:
        for g in (groups.world, groups.embed, *reversed(groups.groups.values())):
            if g is not None:  # (embed: a middle pipeline stage has none)
                g.pg = None  # the last reference: the group joins its threads now
