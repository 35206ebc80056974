"""The parallel axes: one registered entry each, read by the topology, the run shape, the
process groups, the optimizer and the sampler. Adding an axis is one `register_axis` call (plus
the config field its size comes from).

An axis says what it means for the rest of megalite:

- `replicated`: the model's parameters are the same on every rank of the axis, so gradients are
  averaged over it and ZeRO shards over it (dp; context parallelism's cp);
- `splits_batch`: ranks along the axis train on different samples (dp), so the sampler and the
  dropout seeds tell them apart;
- `size(cfg)`: its size from the config; None for the one axis that takes the rest of the world
  (dp);
- `check(cfg, sizes)`: why these sizes cannot run this model (one sentence), or None.

Nothing here imports torch: the run shape is validated before any process group exists.
"""

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Axis:
    name: str
    doc: str
    replicated: bool = False
    splits_batch: bool = False
    size: Callable | None = None
    check: Callable | None = None


AXES: dict[str, Axis] = {}
INFERRED = "dp"  # the axis whose size is the world's remainder when not given


def register_axis(name: str, doc: str, **meaning) -> Axis:
    """Make `name` a parallel axis (see the module docstring for `meaning`)."""
    if not name.isalpha() or not name.islower():
        raise ValueError(f"axis name {name!r} must be a short lowercase word")
    AXES[name] = Axis(name, doc, **meaning)
    return AXES[name]


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


def _check_pp(cfg, sizes: dict) -> str | None:
    m, pp, vpp = cfg.model, sizes["pp"], cfg.parallel.vpp
    if m.num_layers % (pp * vpp):
        return (
            f"num_layers={m.num_layers} is not divisible by pp*vpp={pp}*{vpp}; "
            f"use a multiple of {pp * vpp} layers"
        )
    return None


register_axis("tp", "tensor parallel: each layer's weights split over the ranks",
              size=lambda cfg: cfg.parallel.tp, check=_check_tp)  # fmt: skip
register_axis("dp", "data parallel: replicas training on different samples",
              replicated=True, splits_batch=True)  # fmt: skip
register_axis("pp", "pipeline parallel: the layers cut into stages",
              size=lambda cfg: cfg.parallel.pp, check=_check_pp)  # fmt: skip
