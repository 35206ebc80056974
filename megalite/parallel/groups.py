"""torch.distributed set-up and the one `ProcessGroups` object that the rest is handed.

Launched by torchrun, the rank and world come from its environment; launched as a plain
`python pretrain_gpt.py`, the run is a world of one. NCCL is used with CUDA, gloo otherwise.
"""

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from megalite.parallel.comm import CommLedger, Group
from megalite.parallel.topology import Topology, world_from_env


@dataclass
class ProcessGroups:
    """The groups of one rank: tp, pp, dp, mp (tp+pp: one model replica) and embed (the first
    and last pipeline stage, which hold the tied embedding), plus world."""

    topo: Topology
    rank: int
    device: torch.device
    tp: Group
    pp: Group
    dp: Group
    mp: Group
    embed: Group
    world: Group
    ledger: CommLedger = field(default_factory=CommLedger)

    @property
    def is_first_stage(self) -> bool:
        return self.pp.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp.rank == self.pp.size - 1

    @property
    def next_rank(self) -> int:
        return self.topo.next_stage(self.rank)

    @property
    def prev_rank(self) -> int:
        return self.topo.prev_stage(self.rank)


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
        if backend == "nccl":
            kw["device_id"] = device
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


def build_groups(
    topo: Topology, device: torch.device, timeout_minutes: float = 10.0
) -> ProcessGroups:
    """Create every group of the topology (all ranks take part in creating each) and keep ours."""
    rank = dist.get_rank()
    if dist.get_world_size() != topo.world_size:
        raise RuntimeError(f"world size {dist.get_world_size()} does not match the layout {topo}")
    ledger = CommLedger()
    timeout = timedelta(minutes=timeout_minutes)

    def make(kind: str, all_groups: list[list[int]]) -> Group:
        mine = None
        for ranks in all_groups:
            pg = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
            if rank in ranks:
                mine = Group(kind, ranks, ranks.index(rank), pg, ledger)
        return mine

    groups = {kind: make(kind, topo.groups(kind)) for kind in ("tp", "pp", "dp")}
    groups["mp"] = make("mp", topo.groups("tp+pp"))
    embed = make("embed", topo.embedding_groups())
    world = Group(
        "world",
        list(range(topo.world_size)),
        rank,
        dist.group.WORLD if topo.world_size > 1 else None,
        ledger,
    )
    return ProcessGroups(
        topo=topo, rank=rank, device=device, embed=embed, world=world, ledger=ledger, **groups
    )


def destroy(barrier: bool = False):
    """Tear down torch.distributed. `barrier` (a clean finish): wait until every rank is done,
    since gloo aborts a rank whose peer closes its connections while it still tears down."""
    if dist.is_initialized():
        if barrier and dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()
