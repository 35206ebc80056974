"""What `parallelize` (training/build.py) applied to a rank's chunks, read back from them: one
line per transformation in the order applied, and each parameter's placement (column, row,
vocab, expert or replicated, with the gradient sums its layout needs), one line per parameter
of a layer for all the layers alike, as torchtitan's TP plan reads. `--dry-run` prints both
(training/dry_run.py); nothing here is a copy of the config: the lines come from the chunks'
`LayerEnv`, their layers' kernels and the parameters' `ParamSpec`s, the data-parallel line
from the run shape's ZeRO stage object."""

import re

import torch

from megalite.config import Config
from megalite.kernels.fp8_linear import fp8_linears
from megalite.optim.loss_scaler import ConstantLossScaler, scaler_for
from megalite.parallel.axes import zero_shard_axis
from megalite.parallel.buckets import bucket_numel, grad_dtype
from megalite.parallel.specs import ParamSpec, spec_of
from megalite.shape import RunShape
from megalite.training.compile import is_compiled


def applied(cfg: Config, shape: RunShape, chunks, pp_rank: int = 0) -> list[str]:
    """One line per transformation applied to `chunks` (pipeline rank `pp_rank`'s), in
    `parallelize`'s order: the pipeline stage, tensor, sequence, context and expert
    parallelism, FP8, recompute, compile, data parallelism / ZeRO and the gradient sums the
    layout adds; the precision with its loss scaling, and dropout, where they apply."""
    env = chunks[0].env
    params = _params(chunks)
    out = [_stage(shape, chunks, pp_rank)]
    if env.tp.size > 1:
        line = f"tensor parallel tp={env.tp.size} (column/row linears"
        if any(_vocab(s) for s in params.values()):
            line += ", vocab-parallel embedding and head"
        whole_kv = [n for n, s in params.items()
                    if n.endswith(("attention.k.weight", "attention.v.weight"))
                    and s.split_dim is None]  # fmt: skip
        out.append(line + (", k/v heads replicated)" if whole_kv else ")"))
    if env.sequence_parallel and env.tp.size > 1:
        overlap = ", its collectives behind the matmuls" if env.tp_comm_overlap else ""
        out.append(f"sequence parallel (norms and dropout on s/tp rows{overlap})")
    if env.cp.size > 1:
        levels = f" ({env.cp_levels[0].size} x {env.cp_levels[1].size})" if env.cp_levels else ""
        out.append(f"context parallel cp={env.cp.size} {env.cp_comm_type}{levels}")
    if env.experts.group.size > 1:
        out.append(f"expert parallel ep={env.experts.ep} etp={env.experts.etp}")
    out += _fp8(cfg, chunks)
    if env.recompute != "none":
        out.append(f"recompute {env.recompute}")
    compiled = sum(is_compiled(layer) for c in chunks for layer in c.layers.values())
    if compiled:
        out.append(f"compile: each layer's math ({compiled} on this stage)")
    out += _precision(cfg) + _dropout(shape)
    out.append(_data_parallel(cfg, shape, env.dtype))
    sums = _grad_sums(params)
    if sums:
        out.append("gradient sums after the data-parallel reduction: " + "; ".join(sums))
    if shape.model.moe_router_enable_expert_bias:  # (the optimizer's finalise_grads)
        out.append(
            "then the routers' expert biases move toward balanced loads (a world all-reduce)"
        )
    return out


def module_plan(chunks) -> list[str]:
    """`name  placement` per parameter of `chunks`, the layers' collapsed into
    `layers.{i-j}.<name>` where they place alike."""
    rows: dict[tuple, list[int]] = {}  # (name in a layer or in the chunk, placement) -> layers
    for name, spec in _params(chunks).items():
        m = re.match(r"layers\.(\d+)\.(.*)", name)
        key = (bool(m), m.group(2) if m else name, placement(spec))
        rows.setdefault(key, []).append(int(m.group(1)) if m else -1)
    names = {k: f"layers.{{{_ranges(i)}}}.{k[1]}" if k[0] else k[1] for k, i in rows.items()}
    width = max(map(len, names.values()), default=0)
    return [f"{names[k]:<{width}}  {k[2]}" for k in rows]


def placement(spec: ParamSpec) -> str:
    """How a parameter is held: "column" / "row" (split over tp by output / input features),
    "vocab" (rows of the vocabulary over tp), "expert" (over ep, "+etp" also inside each
    expert), "replicated"; then the gradient sums over groups its layout adds, and what it is
    a tied copy of."""
    if spec.expert:
        where = f"expert ep={spec.split_size}" + (f" etp={spec.cut.size}" if spec.cut else "")
    elif spec.split_dim is None or spec.split_size == 1:
        where = "replicated"
    elif spec.vocab_dim is not None:
        where = f"vocab tp={spec.split_size}"
    else:
        kind = {0: "column", 1: "row"}.get(spec.split_dim, f"dim {spec.split_dim}")
        where = f"{kind} tp={spec.split_size}"
    if spec.grad_sum:
        where += ", grad sum " + "+".join(spec.grad_sum)
    if spec.tied_to:
        where += f", tied to {spec.tied_to}"
    return where


def _params(chunks) -> dict[str, ParamSpec]:
    """{logical name: spec} of the chunks' parameters, each once, in chunk order."""
    return {n: spec_of(p) for c in chunks for n, p in c.named_parameters()}


def _vocab(spec: ParamSpec) -> bool:
    return spec.vocab_dim is not None and spec.split_size > 1


def _stage(shape: RunShape, chunks, pp_rank: int) -> str:
    parts = []
    for c in chunks:
        layers = _ranges(int(i) for i in c.layers)
        ends = [e for e, held in (("embedding", c.has_embedding), ("head", c.has_head)) if held]
        parts.append(" + ".join([f"layers {layers}" if c.layers else "no layers", *ends]))
    vpp = f" vpp={shape.vpp}" if shape.vpp > 1 else ""
    return f"pipeline stage {pp_rank} of pp={shape.pp}{vpp} ({shape.schedule}): " + "; ".join(parts)


def _fp8(cfg: Config, chunks) -> list[str]:
    """The layers whose linears run in FP8 and those kept in the run's precision."""
    low, high = [], []
    for c in chunks:
        for i, layer in c.layers.items():
            (low if fp8_linears(layer.modules()) else high).append(int(i))
    if not low:
        return []
    t = cfg.training
    line = f"fp8 {t.fp8_format} {t.fp8_recipe} on layers {_ranges(low)}"
    return [line + (f" (layers {_ranges(high)} in {t.precision})" if high else "")]


def _precision(cfg: Config) -> list[str]:
    """Below fp32: the precision, and the loss scale the optimizer holds (optim/loss_scaler.py),
    which the executor applies to each micro-batch's loss (and MoE's auxiliary losses) as
    scale/m and the optimizer takes off the gradients before its update."""
    t = cfg.training
    if t.precision == "fp32":
        return []
    scaler = scaler_for(t.precision, cfg.optimizer)
    if scaler is None:
        return [f"precision {t.precision}, no loss scaling"]
    kind = "static" if isinstance(scaler, ConstantLossScaler) else "dynamic, from"
    return [f"precision {t.precision}, loss scale {kind} {scaler.scale:g}: each micro-batch's "
            "loss times scale/m in the executor, unscaled by the optimizer"]  # fmt: skip


def _dropout(shape: RunShape) -> list[str]:
    """Dropout's streams: the trainer seeds one per pipeline stage, batch rank and cp rank
    (parallel/random.seed_replicated); activations split over tp (sequence parallelism) draw
    from each TP rank's own stream (the chunk's ShardedRNG)."""
    m = shape.model
    if not (m.hidden_dropout or m.attention_dropout):
        return []
    return [f"dropout {m.hidden_dropout:g} hidden, {m.attention_dropout:g} attention: a stream "
            "per pipeline stage, batch rank and cp rank; each TP rank its own on s/tp rows"]  # fmt: skip


def _data_parallel(cfg: Config, shape: RunShape, dtype: torch.dtype) -> str:
    """The ZeRO stage and the dense gradient buckets as `build_buffers` makes them (the stage's
    own answers; the bucket size of parallel/buckets.py for the shard group)."""
    zero, o, topo = shape.zero, cfg.optimizer, shape.topology()
    shard = topo.size(topo.product(zero_shard_axis))
    line = f"data parallel dp={shape.dp} zero-{zero.stage} ({zero.doc})"
    if shard != shape.dp:  # hybrid sharding (--dp-replicate)
        line += f" over groups of {shard}"
    if zero.shard_params:  # units per layer (parallel/zero3.py)
        return line + ", gathered layer by layer"
    size = torch.empty((), dtype=grad_dtype(dtype, cfg.training.grad_reduce_in_bf16)).element_size()
    line += ": each parameter a view of a flat bucket, its gradient hooked into the reduction"
    line += f", buckets of {bucket_numel(o.bucket_size_mb, shard, size) * size / 2**20:g} MB"
    if zero.shard_state and o.overlap_param_gather:
        line += ", parameter gather overlapped with the forward"
    return line


def _grad_sums(params: dict[str, ParamSpec]) -> list[str]:
    """The line "group (what)" of each group some gradients are summed over (ParamSpec.grad_sum):
    the modules whose parameters take part (a layer's by their name in the layer)."""
    owners: dict[str, list[str]] = {}
    for name, spec in params.items():
        for group in spec.grad_sum:
            owner = re.sub(r"^layers\.\d+\.", "", name).rpartition(".")[0] or name
            if owner not in owners.setdefault(group, []):
                owners[group].append(owner)
    return [f"{g} ({', '.join(o)})" for g, o in owners.items()]


def _ranges(indices) -> str:
    """The ranges ("0-3,5") of sorted distinct indices ("" for the non-layer rows' -1)."""
    out, run = [], []
    for i in sorted(set(indices)):
        if i < 0:
            continue
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [i]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)
