"""Token dispatch and combine over the expert-parallel group: two all-to-alls per MoE layer.

Experts are split over the `ep` ranks of a group (Topology.experts): rank j holds the global
experts [j E/ep, (j+1) E/ep). A rank routes its own tokens; each routed copy ("assignment")
goes to the rank holding its expert and comes back weighted. Shapes: T tokens on this rank, k
experts per token, h hidden, n_send assignments this rank sends (T k without drops), n_recv
the assignments it receives.

1. `plan`: this rank's assignments per global expert (E,) are all-gathered over ep ((ep, E),
   counted under the ledger kind "ep_sizes"), then read on the host once: the all-to-all split
   sizes must be known before the exchange. That read is the one host sync a dropless MoE layer
   makes (with ep > 1; without expert parallelism and drops it makes none). The permutation of
   the received rows into expert order and the grouped GEMM's offsets stay on the device.
2. `dispatch`: rows sorted by global expert (so by destination rank) -> all-to-all -> rows
   grouped by source rank -> permuted into local-expert order for `grouped_mm`.
3. `combine`: the reverse permutation, then the all-to-all back.
"""

import dataclasses
from dataclasses import dataclass

import torch

from megalite.parallel import comm
from megalite.parallel.comm import Group


@dataclass
class DispatchPlan:
    n_send: int  # assignments this rank sends (kept ones: dropped ones are never sent)
    send_sizes: list  # rows to each ep rank (host)
    recv_sizes: list  # rows from each ep rank (host)
    offsets: torch.Tensor  # (E_local + 1,) rows of each local expert in the sorted rows
    order: torch.Tensor | None = None  # (n_recv,) received rows -> local-expert order
    inverse: torch.Tensor | None = None  # (n_recv,) the way back


def plan(counts: torch.Tensor, ep: Group, n_all: int, dropping: bool) -> DispatchPlan:
    """counts (E,) int64: this rank's kept assignments per global expert; `n_all` its
    assignments with the dropped ones (T k). Reads the host once when ep > 1 or when dropping
    (the number sent must be known); never otherwise."""
    e = counts.numel()
    if ep.size == 1:
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        n = int(counts.sum().item()) if dropping else n_all  # the host read (drops only)
        return DispatchPlan(n, [n], [n], offsets)
    e_local = e // ep.size
    sizes = dataclasses.replace(ep, kind="ep_sizes")  # counted apart from the token exchange
    matrix = counts.new_empty(ep.size * e)
    comm.all_gather(matrix, counts, sizes)
    matrix = matrix.view(ep.size, e)  # [source rank, global expert]
    host = matrix.tolist()  # the host read: split sizes for both all-to-alls
    lo, hi = ep.rank * e_local, (ep.rank + 1) * e_local
    send = [sum(host[ep.rank][j * e_local : (j + 1) * e_local]) for j in range(ep.size)]
    recv = [sum(row[lo:hi]) for row in host]
    mine = matrix[:, lo:hi]  # (ep, E_local): rows from each source for each local expert
    offsets = torch.cat([counts.new_zeros(1), mine.sum(0).cumsum(0)])
    # Received rows come in (source, expert) blocks; their expert, then a stable sort.
    n_recv = sum(recv)
    ends = mine.reshape(-1).cumsum(0)  # (ep * E_local,) end row of each block
    rows = torch.arange(n_recv, device=counts.device)
    expert = torch.searchsorted(ends, rows, right=True) % e_local
    order = torch.sort(expert, stable=True).indices
    inverse = torch.empty_like(order)
    inverse[order] = rows
    return DispatchPlan(sum(send), send, recv, offsets, order, inverse)


def dispatch(x: torch.Tensor, p: DispatchPlan, ep: Group) -> torch.Tensor:
    """x (n_send, h) sorted by global expert -> (n_recv, h) sorted by local expert."""
    if ep.size == 1:
        return x
    got = comm.all_to_all(x, ep, p.recv_sizes, p.send_sizes)  # grouped by source rank
    return got.index_select(0, p.order)


def combine(y: torch.Tensor, p: DispatchPlan, ep: Group) -> torch.Tensor:
    """y (n_recv, h) in local-expert order -> (n_send, h) in the order dispatch took them."""
    if ep.size == 1:
        return y
    y = y.index_select(0, p.inverse)  # back to (source, expert) blocks
    return comm.all_to_all(y, ep, p.send_sizes, p.recv_sizes)
