"""Bytes per step over each kind of link, per group kind: NVLink-class links inside a node
("nvlink") and the network across nodes ("network"), and the seconds they take.

The bytes in are bus bytes per rank, as the CommLedger records them (traffic.py): ring
all-reduce 2(n-1)/n S, all-gather and reduce-scatter (n-1)/n S of the whole S, all-to-all the
bytes a rank hands in, p2p and broadcast S. NCCL's tree all-reduce moves about 2 S per rank
too (it wins on latency, log n steps instead of n, not on bytes), so one factor serves both.

Where they travel, for a group of n ranks of which c share a node (the rank order sets c:
with "tp-cp-dp-pp" and tp = 8 a dp group has one rank per node):

- n <= c (one node): all over NVLink;
- ring collectives across nodes: NCCL runs c rings, one per NIC, each entering and leaving each
  node once, so a rank sends 1/c of its bus bytes over the network and (c-1)/c over NVLink;
- all-to-all: by destination, (n-c)/(n-1) of the bytes to other nodes, (c-1)/(n-1) inside;
- p2p (the pipeline, cp's ring): the hop to the next rank, across nodes when that rank is in
  another node (the ring's pace is its slowest hop).

A group's collectives take max(nvlink / intra bandwidth, network / inter bandwidth): the links
work at once and the slower sets the pace (Cluster's bandwidths are per GPU)."""

from megalite.shape import RunShape

LINKS = ("nvlink", "network")
RING, ALL_TO_ALL, P2P = "ring", "all_to_all", "p2p"


def pattern(kind: str, cp_comm_type: str = "p2p") -> str:
    """How a ledger kind's bytes move: pipeline sends and cp's ring attention are p2p, experts'
    dispatch (and cp's a2a attention) all-to-all, the rest rings."""
    if kind == "pp" or (kind == "cp" and cp_comm_type != "a2a"):
        return P2P
    if kind == "ep" or kind == "cp":
        return ALL_TO_ALL
    return RING


def group_ranks(shape: RunShape, kind: str) -> list[int]:
    """Rank 0's group of a ledger kind (traffic.comm_bytes' kinds) in the layout's order."""
    topo = shape.topology()
    if kind in ("ep", "ep_sizes", "edp"):
        if topo.expert is None:
            return [0]
        return topo.expert.group("ep" if kind == "ep_sizes" else kind, 0)
    if kind == "world":
        return list(range(topo.world_size))
    if kind == "embed":
        g = topo.group("pp", 0)
        return sorted({g[0], g[-1]})
    if kind == "dp_gather":  # ZeRO-3's gathers: over the replicas
        kind = "cp+dp" if shape.cp > 1 and shape.dp > 1 else ("cp" if shape.cp > 1 else "dp")
    return topo.group(kind, 0)


def split(nbytes: float, ranks: list[int], gpus_per_node: int, how: str) -> dict:
    """{link: bytes} of `nbytes` sent by a rank of the group `ranks` (module docstring)."""
    n = len(ranks)
    node = [r // gpus_per_node for r in ranks]
    c = node.count(node[0])  # the group's ranks on rank 0's node
    if n <= 1 or c == n:
        return {"nvlink": nbytes, "network": 0.0}
    if how == P2P:  # the busiest hop: one that leaves the node
        return {"nvlink": 0.0, "network": nbytes}
    share = (n - c) / (n - 1) if how == ALL_TO_ALL else 1 / c
    return {"nvlink": nbytes * (1 - share), "network": nbytes * share}


def link_bytes(shape: RunShape, comm: dict, gpus_per_node: int, cp_comm_type="p2p") -> dict:
    """{kind: {link: bytes per step}} of a plan's `comm` (bytes per step per ledger kind)."""
    return {
        kind: split(n, group_ranks(shape, kind), gpus_per_node, pattern(kind, cp_comm_type))
        for kind, n in comm.items()
    }


def seconds(links: dict, intra_gbps: float, inter_gbps: float) -> float:
    """The time of one group's {link: bytes}: the slower link sets the pace."""
    return max(links["nvlink"] / (intra_gbps * 1e9), links["network"] / (inter_gbps * 1e9))


def totals(per_kind: dict) -> dict:
    """{link: bytes} summed over the group kinds."""
    return {link: sum(v[link] for v in per_kind.values()) for link in LINKS}


def recorded(calls: dict, gpus_per_node: int) -> dict:
    """{link: bytes} of collectives a rank recorded ({group ranks: [(op, shape, dtype)]}, the
    fake world's Recorder) through the same factors: all-reduce 2(n-1)/n S, all-gather (n-1)
    times the shard sent, reduce-scatter (n-1)/n of the input, broadcast S. All-to-alls (their
    rows depend on the routing) and object collectives are left out."""
    import torch

    out = {link: 0.0 for link in LINKS}
    for ranks, ops in calls.items():
        n = len(ranks)
        for op, shape, dtype in ops:
            if dtype == "object" or "*" in shape or op == "all_to_all_single":
                continue
            size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
            s = size * _numel(shape)
            bus = {"all_reduce": 2 * (n - 1) / n * s, "all_gather_single": (n - 1) * s,
                   "reduce_scatter_single": (n - 1) / n * s, "broadcast": s}.get(op, 0.0)  # fmt: skip
            for link, b in split(bus, list(ranks), gpus_per_node, RING).items():
                out[link] += b
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
