"""Token dispatch and combine over the expert-parallel group: two all-to-alls per MoE layer.

Experts are split over the `ep` ranks of a group (Topology.experts): rank j holds the global
experts [j E/ep, (j+1) E/ep). A rank routes its own tokens; each routed copy ("assignment")
goes to the rank holding its expert and comes back weighted. Shapes: T tokens on this rank, k
experts per token, h hidden, n_send assignments this rank sends (T k without drops), n_recv
the assignments it receives.

With expert tensor parallelism (--expert-tensor-parallel-size etp) each ep slot is etp ranks,
each holding a 1/etp slice of every expert's width (column-parallel fc1, row-parallel fc2):
the exchange runs over the etp x ep ranks of `ExpertGroups.group`, every one of them routing
its own tokens. An assignment goes to each of the etp ranks of its expert's slot (dispatch
sends its rows etp times: what Megatron's all-gather over etp after the all-to-all moves),
each returns its partial fc2 output, and the sender sums the etp partials in a fixed order
(Megatron's reduce-scatter over etp): so the etp ranks of a slot hold the same tokens.

1. `plan`: this rank's assignments per global expert (E,) are all-gathered over the group
   ((etp ep, E), counted under the ledger kind "ep_sizes"), then read on the host once: the
   all-to-all split sizes must be known before the exchange. That read is the one host sync a
   dropless MoE layer makes (with ep etp > 1; without expert parallelism and drops it makes
   none). The permutation of the received rows into expert order and the grouped GEMM's
   offsets stay on the device.
2. `dispatch`: rows sorted by global expert (so by destination slot) -> each slot's rows once
   per etp rank -> all-to-all -> rows grouped by source rank -> permuted into local-expert
   order for `grouped_mm`.
3. `combine`: the reverse permutation, the all-to-all back, and the sum of the etp partials.
"""

import dataclasses
from dataclasses import dataclass

import torch

from megalite.parallel import comm
from megalite.parallel.comm import Group


@dataclass(frozen=True)
class ExpertGroups:
    """The ranks an MoE layer's experts are spread over (ProcessGroups.experts): `group`, the
    etp x ep ranks of the token exchange, etp fastest (Topology.experts), so its member
    i + etp j holds slice i (of etp) of the experts of ep slot j."""

    group: Group
    etp: int = 1

    @property
    def ep(self) -> int:
        return self.group.size // self.etp

    @property
    def ep_rank(self) -> int:
        return self.group.rank // self.etp

    @property
    def etp_rank(self) -> int:
        return self.group.rank % self.etp


@dataclass
class DispatchPlan:
    n_send: int  # assignments this rank sends (kept ones: dropped ones are never sent)
    send_sizes: list  # rows to each rank of the group (host)
    recv_sizes: list  # rows from each rank of the group (host)
    offsets: torch.Tensor  # (E_local + 1,) rows of each local expert in the sorted rows
    order: torch.Tensor | None = None  # (n_recv,) received rows -> local-expert order
    inverse: torch.Tensor | None = None  # (n_recv,) the way back
    slot_sizes: list | None = None  # assignments to each ep slot (host)
    etp: int = 1


def plan(counts: torch.Tensor, ex: ExpertGroups, n_all: int, dropping: bool) -> DispatchPlan:
    """counts (E,) int64: this rank's kept assignments per global expert; `n_all` its
    assignments with the dropped ones (T k). Reads the host once when etp ep > 1 or when
    dropping (the number sent must be known); never otherwise."""
    e, g, etp = counts.numel(), ex.group, ex.etp
    if g.size == 1:
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        n = int(counts.sum().item()) if dropping else n_all  # the host read (drops only)
        return DispatchPlan(n, [n], [n], offsets)
    e_local = e // ex.ep
    sizes = dataclasses.replace(g, kind="ep_sizes")  # counted apart from the token exchange
    matrix = counts.new_empty(g.size * e)
    comm.all_gather(matrix, counts, sizes)
    matrix = matrix.view(g.size, e)  # [source rank, global expert]
    host = matrix.tolist()  # the host read: split sizes for both all-to-alls
    lo, hi = ex.ep_rank * e_local, (ex.ep_rank + 1) * e_local
    slots = [sum(host[g.rank][j * e_local : (j + 1) * e_local]) for j in range(ex.ep)]
    send = [slots[d // etp] for d in range(g.size)]  # each slot's rows to each of its etp ranks
    recv = [sum(row[lo:hi]) for row in host]
    mine = matrix[:, lo:hi]  # (etp ep, E_local): rows from each source for each local expert
    offsets = torch.cat([counts.new_zeros(1), mine.sum(0).cumsum(0)])
    # Received rows come in (source, expert) blocks; their expert, then a stable sort.
    n_recv = sum(recv)
    ends = mine.reshape(-1).cumsum(0)  # (etp ep E_local,) end row of each block
    rows = torch.arange(n_recv, device=counts.device)
    expert = torch.searchsorted(ends, rows, right=True) % e_local
    order = torch.sort(expert, stable=True).indices
    inverse = torch.empty_like(order)
    inverse[order] = rows
    return DispatchPlan(sum(slots), send, recv, offsets, order, inverse, slots, etp)


def dispatch(x: torch.Tensor, p: DispatchPlan, ex: ExpertGroups) -> torch.Tensor:
    """x (n_send, h) sorted by global expert -> (n_recv, h) sorted by local expert."""
    if ex.group.size == 1:
        return x
    if p.etp > 1:  # each slot's rows once per etp rank of the slot: (etp n_send, h)
        x = torch.cat([piece for piece in x.split(p.slot_sizes) for _ in range(p.etp)])
    got = comm.all_to_all(x, ex.group, p.recv_sizes, p.send_sizes)  # grouped by source rank
    return got.index_select(0, p.order)


def combine(y: torch.Tensor, p: DispatchPlan, ex: ExpertGroups) -> torch.Tensor:
    """y (n_recv, h) in local-expert order (partial sums over etp) -> (n_send, h) in the order
    dispatch took them, the etp partials summed."""
    if ex.group.size == 1:
        return y
    y = y.index_select(0, p.inverse)  # back to (source, expert) blocks
    back = comm.all_to_all(y, ex.group, p.send_sizes, p.recv_sizes)
    if p.etp == 1:
        return back
    pieces = back.split(p.send_sizes)  # slot j's rows from each of its etp ranks, in order
    return torch.cat([sum(pieces[j * p.etp + 1 : (j + 1) * p.etp], pieces[j * p.etp])
                      for j in range(len(p.slot_sizes))])  # fmt: skip
