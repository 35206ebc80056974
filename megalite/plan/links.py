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

A group's collectives take `steps · alpha + max(nvlink / busbw_nvlink, network / busbw_network)`
(`seconds`): the links work at once and the slower sets the pace, each at its asymptotic bus
bandwidth (the nominal per-GPU bandwidth of `Cluster` times `EFFICIENCY`, the busbw nccl-tests
reaches at large messages), and every step of the algorithm (a ring's n - 1 per pass, a p2p's
one) waits the latency `alpha` of the slowest link it crosses. So the achieved bus bandwidth
rises with the bytes a step carries (`busbw`): a message of a few kB is latency-bound, one of
hundreds of MB runs at the asymptote (docs/planner.md, "Bytes per link")."""

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
        dp = shape.size("dp")  # the shard group's dp axis (not --dp: its copies hold the same)
        kind = "cp+dp" if shape.cp > 1 and dp > 1 else ("cp" if shape.cp > 1 else "dp")
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


# The bus bandwidth nccl-tests reaches at large messages against the nominal per-GPU link
# (docs/planner.md): 8 x H100 NVLink all-reduce 460-480 GB/s at 8 GB, the nominal 450 or more;
# 4 nodes x 8 H100, 8 x 400 Gb/s IB each, all-reduce 331 GB/s against the 400 its 8 NICs give.
EFFICIENCY = {"nvlink": 1.0, "network": 0.83}


def bus_bytes(op: str, n: int, nbytes: float) -> float:
    """Bus bytes one rank sends for a collective of `nbytes` (the whole S) over n ranks: ring
    all-reduce 2(n-1)/n S, all-gather, reduce-scatter and all-to-all (n-1)/n S, p2p S."""
    if op == P2P:
        return nbytes
    if n <= 1:
        return 0.0
    return (2 if op == "all_reduce" else 1) * (n - 1) / n * nbytes


def steps(op: str, n: int) -> int:
    """The algorithm's steps, each waiting one link latency: a ring all-reduce 2(n-1)
    (reduce-scatter then all-gather), a ring all-gather or reduce-scatter n-1, an all-to-all
    n-1 (one exchange per peer), a p2p send 1."""
    if op == P2P:
        return 1
    return 0 if n <= 1 else (2 if op == "all_reduce" else 1) * (n - 1)


def latency(links: dict, cluster) -> float:
    """Seconds one step waits: the latency of the slowest link the group crosses."""
    us = cluster.inter_node_latency_us if links["network"] else cluster.intra_node_latency_us
    return us * 1e-6


def bandwidth(link: str, cluster) -> float:
    """The asymptotic bus bandwidth of a link kind, bytes/s per GPU."""
    gbps = cluster.intra_node_gbps if link == "nvlink" else cluster.inter_node_gbps
    return gbps * 1e9 * EFFICIENCY[link]


def busbw(link: str, chunk: float, cluster) -> float:
    """The achieved bus bandwidth (bytes/s) of steps that carry `chunk` bytes each over `link`
    (a ring's S/n, a p2p's S): chunk / (alpha + chunk / asymptote). Latency-bound for small
    chunks, the asymptote for large ones; half of it at chunk = alpha · asymptote."""
    alpha = latency({"network": link == "network"}, cluster)
    return chunk / (alpha + chunk / bandwidth(link, cluster))


def collective_seconds(op: str, n: int, nbytes: float, link: str, cluster) -> float:
    """One collective of `nbytes` over n ranks all on one `link` kind: its bus bytes at the
    achieved bus bandwidth of its steps' size (the same as `steps · alpha + bus / asymptote`)."""
    k, bus = steps(op, n), bus_bytes(op, n, nbytes)
    return bus / busbw(link, bus / k, cluster) if k else 0.0


def seconds(links: dict, cluster, n_steps: float = 0.0) -> float:
    """The time of one group's {link: bytes} made in `n_steps` algorithm steps: each step's
    latency, plus the slower link's bytes at its asymptotic bus bandwidth."""
    pace = max(links[k] / bandwidth(k, cluster) for k in LINKS)
    return pace + n_steps * latency(links, cluster) if pace or n_steps else 0.0


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
            bus = {"all_reduce": bus_bytes("all_reduce", n, s), "broadcast": s,
                   "all_gather_single": bus_bytes("all_gather", n, n * s),
                   "reduce_scatter_single": bus_bytes("reduce_scatter", n, s)}.get(op, 0.0)  # fmt: skip
            for link, b in split(bus, list(ranks), gpus_per_node, RING).items():
                out[link] += b
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
