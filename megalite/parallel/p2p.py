"""Point-to-point exchange between neighbours of a group: batches posted now, waited for later.

The pipeline's stages (pipeline/executor.py) pass activations and gradients with it, context
parallelism's ring (context_parallel.py) its K/V blocks, generation (generation.py) one token's
hidden states stage after stage. Shapes are known ahead (the caller allocates every receive),
so there is no shape handshake: a receive is just an empty buffer. A batch of sends and
receives is posted with `batch_isend_irecv` (`post`) and returns at once; the caller waits for
it (`Batch.wait`) only when it needs a received tensor, or to bound what is in flight. On NCCL
that wait is a dependency of the compute stream, not a host wait. Batches complete in posting
order and messages between two ranks are matched in posting order (gloo and NCCL alike): that
is the model pipeline/verify.py proves schedules deadlock-free against. No tags are used.
"""

import time

import torch
import torch.distributed as dist

from megalite.parallel.comm import Group
from megalite.parallel.ledger import clock_start

_ready: set[int] = set()  # process groups that have run a collective


def _warm_up(group: Group, device: torch.device):
    """NCCL wants the first operation on a group to involve all its ranks; a batch only
    involves neighbours, so run one tiny all-reduce over the group first (once per group)."""
    if id(group.pg) in _ready:
        return
    if dist.get_backend(group.pg) != "gloo":
        dist.all_reduce(torch.zeros(1, device=device), group=group.pg)
    _ready.add(id(group.pg))


class Batch:
    """Posted sends and receives; keeps every tensor alive until they complete."""

    def __init__(self, ops, works, group: Group):
        self.ops, self.works, self.group = ops, works, group
        self.waited: set[int] = set()  # works already waited for: gloo's p2p works must not be
        self.done = False  # waited twice (a second wait on a receive waits for another message)

    def wait(self, op: int | None = None) -> float:
        """Block until operation `op` of the batch (default: every one) completed; returns the
        host seconds blocked (on NCCL ~0: the wait only orders the streams; the ledger times it
        on the device, ledger.CommLedger). Where the backend fused the batch into one work
        (NCCL), that is the whole batch anyway."""
        if self.done:
            return 0.0
        t0 = time.perf_counter()
        start = clock_start(self.ops[0][1] if self.ops else None)
        whole = op is None or len(self.works) != len(self.ops)
        for i in range(len(self.works)) if whole else [op]:
            if i not in self.waited:
                self.works[i].wait()
                self.waited.add(i)
        if whole:
            self.done, self.ops = True, None  # the tensors may go now
        self.group.ledger.add_span(self.group.kind, start)
        return time.perf_counter() - t0


def post(ops: list[tuple[bool, torch.Tensor, int]], group: Group) -> Batch:
    """Post `ops`, a list of (is_send, tensor, peer index in `group`), as one batch. Receives
    fill their tensors in place once the batch completes. Records the bytes sent."""
    if not ops:
        return Batch([], [], group)
    for _, t, _ in ops:
        group.check(t)
    _warm_up(group, ops[0][1].device)
    p2p = [
        dist.P2POp(dist.isend if send else dist.irecv, t, group=group.pg, group_peer=peer)
        for send, t, peer in ops
    ]
    works = dist.batch_isend_irecv(p2p)
    sent = sum(t.numel() * t.element_size() for send, t, _ in ops if send)
    group.ledger.add(group.kind, sent)
    return Batch(ops, works, group)


def exchange(ops: list[tuple[bool, torch.Tensor, int]], group: Group) -> float:
    """Post `ops` as one batch and wait for all of them; returns the seconds spent."""
    t0 = time.perf_counter()
    post(ops, group).wait()
    return time.perf_counter() - t0
