"""Activation and gradient exchange between pipeline stages: one batch of isend/irecv at a time.

Shapes are known ahead (every tensor between stages is the caller's `hidden_shape`), so there is
no shape handshake: a receive is just an empty buffer. A batch is posted with
`batch_isend_irecv` and waited for as a whole before the caller goes on; that is the model
`verify.py` checks schedules against. Messages between two ranks are matched in posting order
(gloo and NCCL alike), which the verifier also checks, so no tags are used.
"""

import time

import torch
import torch.distributed as dist

from megalite.parallel.comm import Group

_ready: set[int] = set()  # process groups that have run a collective


def _warm_up(group: Group, device: torch.device):
    """NCCL wants the first operation on a group to involve all its ranks; a pipeline batch only
    involves neighbours, so run one tiny all-reduce over the group first (once per group)."""
    if id(group.pg) in _ready:
        return
    if dist.get_backend(group.pg) != "gloo":
        dist.all_reduce(torch.zeros(1, device=device), group=group.pg)
    _ready.add(id(group.pg))


def exchange(ops: list[tuple[bool, torch.Tensor, int]], group: Group) -> float:
    """Post `ops`, a list of (is_send, tensor, peer index in `group`), as one batch and wait for
    all of them. Receives fill their tensors in place. Returns the seconds spent, and records
    the bytes sent in the group's ledger."""
    t0 = time.perf_counter()
    if not ops:
        return 0.0
    device = ops[0][1].device
    _warm_up(group, device)
    p2p = [
        dist.P2POp(dist.isend if send else dist.irecv, t, group=group.pg, group_peer=peer)
        for send, t, peer in ops
    ]
    for work in dist.batch_isend_irecv(p2p):
        work.wait()
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # the received data is needed now
    seconds = time.perf_counter() - t0
    sent = sum(t.numel() * t.element_size() for send, t, _ in ops if send)
    group.ledger.add(group.kind, sent, seconds)
    return seconds
