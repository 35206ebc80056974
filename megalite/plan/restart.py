"""On paper: what a restart after a lost node costs, from the node-local tier or the
persistent one (checkpoint/local_tier.py, local_restore.py), for a layout on a cluster.

A checkpoint holds, per element of the model, the weight in the training precision and the
optimizer state (two moments, plus fp32 masters when the weights are narrower: the planner's
`ZeroStage.state_bytes` at one rank). Each rank writes its own part: its ZeRO shard where the
optimizer state is sharded, else data-parallel rank 0 all of its stage (the busiest writer).

- **Local save**: a rank writes its part to node-local disk and sends it to F - 1 peers over
  the network (both in the background); the step pays the copy to host memory.
- **Restart, local tier**: the agreement is one all-gather of a small record per copy
  (`RECORD_BYTES`: a ring of world - 1 steps at the inter-node latency); each rank then reads
  and hashes what it holds at disk speed, and the ranks of the lost node receive their parts
  from their peers over the network, one sender each, in parallel.
- **Restart, persistent tier**: every rank reads its part from shared storage, whose aggregate
  bandwidth all ranks share, and hashes one file.
- **Work lost**: on average half an interval of steps (the local or the persistent one).

Estimates, not measurements: docs/reliability.md holds what bench/checkpoint/bench_recovery.py measured.
"""

from megalite.plan import links
from megalite.plan.memory import BYTES, buckets, replicas

RECORD_BYTES = 64  # one (iteration, owner, saved world) record, pickled, per copy a rank holds
HASH_GBPS = 0.6  # sha256 on one core (shard_io.py: hashed beside the read, not after it)


def checkpoint_bytes(cfg, shape) -> tuple[float, float]:
    """(the whole checkpoint's bytes, the busiest writer's part), from the stages' elements."""
    prec = cfg.training.precision
    p_size, g_size = BYTES[prec], 4 if prec in ("bf16", "fp16") else BYTES[prec]
    zero, total, busiest = shape.zero, 0.0, 0.0
    writers = replicas(shape) if zero.shard_state else 1
    for stage in range(shape.pp):
        bs = buckets(cfg, shape, stage)
        numel = bs[-1][1] if bs else 0
        whole = zero.state_bytes(numel, 1, p_size, g_size)  # one rank's tp slice, unsharded
        per_tp_rank = numel * p_size + whole["optimizer"]
        total += per_tp_rank * shape.tp
        busiest = max(busiest, per_tp_rank / writers)
    return total, busiest


def restart_estimate(cfg, shape, cluster, copies: int = 2, disk_gbps: float = 5.0,
                     storage_gbps: float = 100.0, step_s: float | None = None,
                     local_interval: int = 0, persistent_interval: int = 0) -> dict:  # fmt: skip
    """Seconds and bytes of a restart after one node is lost, per tier, and per local save.
    `disk_gbps`: a node's local disk (shared by its GPUs); `storage_gbps`: the shared file
    system's aggregate read bandwidth; `copies`: --replication-factor; `step_s` with the
    intervals: the work lost, in seconds, on average."""
    world, per_node = shape.world_size, cluster.gpus_per_node
    total, part = checkpoint_bytes(cfg, shape)
    held = part * copies  # a rank's own part and the replicas it keeps
    records = world * copies * RECORD_BYTES
    agree_s = links.collective_seconds("all_gather", world, records, "network", cluster)
    read_s = held * per_node / (disk_gbps * 1e9) + held / (HASH_GBPS * 1e9)
    fetched = part * per_node  # the lost node's parts, from their peers
    fetch_s = links.collective_seconds(links.P2P, 2, part, "network", cluster)
    persistent_s = max(total / (storage_gbps * 1e9), fetch_s)
    persistent_s += part / (HASH_GBPS * 1e9)  # each file hashed by one rank before the load
    out = {
        "checkpoint_bytes": total,
        "part_bytes": part,
        "local_save": {"disk_bytes": part, "sent_bytes": part * (copies - 1)},
        "local": {
            "seconds": agree_s + read_s + fetch_s,
            "agree_s": agree_s,
            "read_s": read_s,
            "fetch_s": fetch_s,
            "network_bytes": fetched,
        },  # fmt: skip
        "persistent": {"seconds": persistent_s, "storage_bytes": total},
    }
    if step_s is not None:
        out["local"]["lost_s"] = local_interval * step_s / 2
        out["persistent"]["lost_s"] = persistent_interval * step_s / 2
    return out


def format_estimate(est: dict) -> str:
    """Three lines for a plan's report."""
    gb = 1e9
    loc, per = est["local"], est["persistent"]
    lines = [
        f"checkpoint {est['checkpoint_bytes'] / gb:.1f} GB, the busiest rank's part "
        f"{est['part_bytes'] / gb:.2f} GB; a local save sends "
        f"{est['local_save']['sent_bytes'] / gb:.2f} GB per rank to its peers",
        f"restart after a lost node, local tier: {loc['seconds']:.1f} s (agree "
        f"{loc['agree_s']:.2f} s, read + hash {loc['read_s']:.1f} s, fetch {loc['fetch_s']:.1f} s; "
        f"{loc['network_bytes'] / gb:.1f} GB over the network)",
        f"restart, persistent tier: {per['seconds']:.1f} s ({per['storage_bytes'] / gb:.1f} GB "
        "read from shared storage)",
    ]
    return "\n".join(lines)
