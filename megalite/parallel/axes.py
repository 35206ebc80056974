"""The parallel axes: one registered entry each, read by the topology, the run shape, the
process groups, the optimizer and the sampler. Adding an axis is one `register_axis` call (plus
the config field its size comes from).

An axis says what it means for the rest of megalite:

- `replicated`: the model's parameters are the same on every rank of the axis, so gradients are
  averaged over it and ZeRO shards over it (dp, cp);
- `shards`: of a replicated axis, whether ZeRO shards over it (the default). One that does not
  (dpr, --dp-replicate) holds copies of the shards: gradients are reduce-scattered over the
  sharding axes, then each shard is all-reduced over it (hybrid sharding, HSDP);
- `splits_batch`: ranks along the axis train on different samples (dp), so the sampler and the
  dropout seeds tell them apart;
- `size(cfg)`: its size from the config; None for the one axis that takes the rest of the world
  (dp);
- `check(cfg, sizes)`: why these sizes cannot run this model (one sentence), or None.

Nothing here imports torch: the run shape is validated before any process group exists.
"""

from collections.abc import Callable
from dataclasses import dataclass

from megalite.errors import MegaliteError


@dataclass(frozen=True)
class Axis:
    name: str
    doc: str
    replicated: bool = False
    splits_batch: bool = False
    shards: bool = True
    size: Callable | None = None
    check: Callable | None = None


# The groups a run reduces over, as predicates on an axis (Topology.product's argument), each
# named after the ProcessGroups group it picks: the replica group (the same parameters:
# gradients averaged over it); of its axes those ZeRO shards over (the zero_shard group) and
# those holding copies of that group (shard_copies, --dp-replicate); and the ranks that split
# the batch (the batch group).
def replica_axis(a: "Axis") -> bool:
    return a.replicated


def zero_shard_axis(a: "Axis") -> bool:
    return a.replicated and a.shards


def shard_copies_axis(a: "Axis") -> bool:
    return a.replicated and not a.shards


def batch_axis(a: "Axis") -> bool:
    return a.splits_batch


AXES: dict[str, Axis] = {}
INFERRED = "dp"  # the axis whose size is the world's remainder when not given


def register_axis(name: str, doc: str, **meaning) -> Axis:
    """Make `name` a parallel axis (see the module docstring for `meaning`)."""
    if not name.isalpha() or not name.islower():
        raise ValueError(f"axis name {name!r} must be a short lowercase word")
    AXES[name] = Axis(name, doc, **meaning)
    return AXES[name]


def ranks(sizes: dict, *, splits_batch: bool) -> int:
    """The product of the sizes of the axes that split the batch (True: the data-parallel ranks,
    the user's --dp) or of those that do not (False: the ranks one model copy spans, tp*cp*pp);
    an axis of size None (dp before it is inferred) counts 1."""
    n = 1
    for a, k in sizes.items():
        n *= (k or 1) if AXES[a].splits_batch == splits_batch else 1
    return n


def split_batch(global_batch_size: int, micro_batch_size: int, data: int) -> int:
    """Micro-batches per step on each of the `data` ranks that split the batch (the product of
    the `splits_batch` axes), or MegaliteError: the one place the batch split is checked (the
    run shape and the sampler both read it)."""
    if global_batch_size % (micro_batch_size * data):
        raise MegaliteError(
            f"global_batch_size={global_batch_size} is not divisible by micro_batch_size*dp="
            f"{micro_batch_size}*{data}; make it a multiple of {micro_batch_size * data}"
        )
    return global_batch_size // (micro_batch_size * data)


def _check_tp(cfg, sizes: dict) -> str | None:
    m, tp = cfg.model, sizes["tp"]
    kv = m.num_query_groups or m.num_attention_heads
    if tp > m.num_attention_heads:
        return f"tp={tp} is larger than num_attention_heads={m.num_attention_heads}; lower --tp"
    if m.num_attention_heads % tp:
        return f"num_attention_heads={m.num_attention_heads} is not divisible by tp={tp}"
    if kv % tp and tp % kv:
        return (
            f"num_query_groups={kv} is not divisible by tp={tp} (nor tp by it); "
            "choose query groups that divide or are a multiple of tp"
        )
    if m.hidden_size % tp:
        return f"hidden_size={m.hidden_size} is not divisible by tp={tp}"
    if m.ffn % tp:
        return f"ffn_hidden_size={m.ffn} is not divisible by tp={tp}"
    if cfg.parallel.sequence_parallel and tp > 1 and m.seq_length % tp:
        return (
            f"seq_length={m.seq_length} is not divisible by tp={tp} (needed by --sequence-parallel)"
        )
    return None


def cp_levels(p) -> tuple[int, int] | None:
    """a2a+p2p's level sizes (A, P) of cp = A*P (--hierarchical-context-parallel-sizes), or None
    for a flat cp (checked by _check_cp)."""
    levels = p.hierarchical_context_parallel_sizes
    return (levels[0], levels[1]) if p.cp_comm_type == "a2a+p2p" else None


def _check_levels(p, cp: int) -> str | None:
    levels = p.hierarchical_context_parallel_sizes
    if p.cp_comm_type != "a2a+p2p":
        if levels:
            return (
                f"--hierarchical-context-parallel-sizes is read only by --cp-comm-type a2a+p2p "
                f"(not {p.cp_comm_type}); drop it or use --cp-comm-type a2a+p2p"
            )
    elif not levels or len(levels) != 2 or min(levels) < 1 or levels[0] * levels[1] != cp:
        return (
            f"--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A P with A*P = "
            f"cp={cp} (all-to-all among A adjacent cp ranks, the ring over P), not "
            f"{' '.join(map(str, levels or [])) or 'none'}"
        )
    return None


def _check_cp(cfg, sizes: dict) -> str | None:
    m, p, cp, tp = cfg.model, cfg.parallel, sizes["cp"], sizes["tp"]
    reason = _check_levels(p, cp)
    if reason:
        return reason
    if cp == 1:
        return None
    s = m.seq_length
    if s % (2 * cp):  # the load-balanced split cuts each sequence into 2*cp chunks
        return (
            f"seq_length={s} is not divisible by 2*cp={2 * cp} (context parallelism cuts the "
            f"sequence into 2*cp chunks); use a multiple of {2 * cp}"
        )
    if tp > 1 and (s // cp) % tp and (p.sequence_parallel or m.num_experts):
        return (
            f"seq_length/cp={s // cp} is not divisible by tp={tp} (each TP rank holds 1/tp of a "
            f"context-parallel rank's tokens); use a seq_length divisible by {2 * cp * tp}"
        )
    if m.attention_dropout > 0:
        return f"attention_dropout={m.attention_dropout} is not supported with cp={cp}; set --attention-dropout 0"
    # each rank's heads are split over the all-to-all's ranks: all of cp, or a2a+p2p's A
    n = cp if p.cp_comm_type == "a2a" else (cp_levels(p) or (1,))[0]
    heads = m.num_attention_heads // tp
    kv = m.heads_kv // tp if m.heads_kv % tp == 0 else 1
    if heads % n or kv % n:
        flat = p.cp_comm_type == "a2a"
        over = f"cp={cp}" if flat else f"A={n} (of cp={cp} = A*P)"
        return (
            f"--cp-comm-type {p.cp_comm_type} splits each TP rank's {heads} query and {kv} "
            f"key/value heads over {over}, which must divide both; use --cp-comm-type p2p or a "
            + ("smaller --cp" if flat else "smaller A")
        )
    return None


register_axis("tp", "tensor parallel: each layer's weights split over the ranks",
              size=lambda cfg: cfg.parallel.tp, check=_check_tp)  # fmt: skip
register_axis("dp", "data parallel: replicas training on different samples (with --dp-replicate: "
              "the ranks of one ZeRO shard group)",
              replicated=True, splits_batch=True)  # fmt: skip
# which layers each stage holds is checked by shape.derive (pipeline/partition.py)
register_axis(
    "pp", "pipeline parallel: the layers cut into stages", size=lambda cfg: cfg.parallel.pp
)
register_axis("cp", "context parallel: each sample's sequence split over the ranks",
              replicated=True, splits_batch=False,  # the same samples, other tokens
              size=lambda cfg: cfg.parallel.cp, check=_check_cp)  # fmt: skip
register_axis("dpr", "hybrid sharding: copies of the ZeRO shard group (the user's dp = dp x dpr)",
              replicated=True, splits_batch=True, shards=False,
              size=lambda cfg: cfg.parallel.dp_replicate)  # fmt: skip
