"""How a rank's groups are made, counted on torch's fake process group: per rank, the groups it
created, the world-wide operations made while creating them, and any creation it took part in
for a group it is not in (parallel/groups.py: build_groups makes only its own groups).

A world-wide operation is a call every rank of the world must enter: `new_group` without
`use_local_synchronization` (torch names such a group by a world-wide counter, and NCCL bound to
a device splits the world's communicator for it, ranks outside with "no colour"), `split_group`
and `new_subgroups*` (collectives of the parent group), and any collective on the world.

`count_groups(topo, ranks)` plays each of `ranks` in turn, in this process (the fake process
group costs no peer: a world of 16,384 is as cheap as one of 8)."""

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

# calls that every rank of the world enters, whatever its groups
WORLD_CALLS = ("split_group", "new_subgroups", "new_subgroups_by_enumeration")
WORLD_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast",
                     "broadcast_object_list", "barrier", "monitored_barrier")  # fmt: skip


@dataclass
class GroupCount:
    """One rank's group creation: `created` groups made (new_group calls and the splits' groups),
    `world_ops` world-wide operations among them or beside them, `foreign` creations of groups
    this rank is not in, `member_of` the distinct groups of two ranks or more it holds (what it
    needs), `seconds` spent building."""

    rank: int
    created: int = 0
    world_ops: int = 0
    foreign: int = 0
    member_of: int = 0
    seconds: float = 0.0


class GroupCounter:
    """Patches torch.distributed's group constructors and world collectives (groups.py calls them
    through the module) to count what `build_groups` does on this rank."""

    def __init__(self, rank: int):
        self.count = GroupCount(rank)

    def __enter__(self):
        names = ("new_group", *WORLD_CALLS, *WORLD_COLLECTIVES)
        self.saved = {n: getattr(dist, n) for n in names if hasattr(dist, n)}
        c = self.count

        def new_group(ranks=None, *args, use_local_synchronization=False, **kw):
            c.created += 1
            c.world_ops += not use_local_synchronization
            c.foreign += ranks is not None and c.rank not in ranks
            return self.saved["new_group"](
                ranks, *args, use_local_synchronization=use_local_synchronization, **kw
            )

        def world_call(fn):
            def counted(*args, **kw):
                c.created += 1
                c.world_ops += 1
                return fn(*args, **kw)

            return counted

        def collective(fn):
            def counted(*args, group=None, **kw):
                c.world_ops += group is None or group is dist.group.WORLD
                return fn(*args, group=group, **kw)

            return counted

        dist.new_group = new_group
        for n, fn in self.saved.items():
            if n in WORLD_CALLS:
                setattr(dist, n, world_call(fn))
            elif n in WORLD_COLLECTIVES:
                setattr(dist, n, collective(fn))
        return self

    def __exit__(self, *exc):
        for n, fn in self.saved.items():
            setattr(dist, n, fn)


def member_groups(groups) -> int:
    """The distinct groups of two ranks or more a `ProcessGroups` holds, the world left out."""
    held = [*groups.groups.values(), groups.embed]
    return len({tuple(g.ranks) for g in held if g is not None and g.size > 1})


def count_groups(topo, ranks: list[int], **build_kw) -> list[GroupCount]:
    """`build_groups(topo, ...)` as each of `ranks` of a fake world of topo.world_size ranks,
    one after the other in this process (the default process group is made and destroyed for
    each), counted."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megalite.parallel.groups import build_groups

    if dist.is_initialized():
        raise RuntimeError("count_groups needs a process without a default process group")
    out = []
    for rank in ranks:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=topo.world_size)
        try:
            t0 = time.perf_counter()
            with GroupCounter(rank) as counter:
                groups = build_groups(topo, torch.device("cpu"), **build_kw)
            counter.count.seconds = time.perf_counter() - t0
            counter.count.member_of = member_groups(groups)
            out.append(counter.count)
        finally:
            dist.destroy_process_group()
    return out
