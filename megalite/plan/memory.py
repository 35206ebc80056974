"""Bytes a rank holds for its parameters, computed without a process group or a GPU: the real
model built on the `meta` device, cut into buckets by the gradient buffer's own `bucket_layout`
(or ZeRO-3's `unit_layout`), then what the layout's ZeRO stage allocates for them, and the units
ZeRO-3 gathers at once. Activations are activations.py's, the traffic traffic.py's."""

import dataclasses
from functools import lru_cache

from megalite.config import Config, ModelConfig
from megalite.optim.muon import muon_on, second_moments
from megalite.parallel.buckets import ALIGN, bucket_layout, bucket_numel
from megalite.parallel.zero3 import unit_layout, unit_of
from megalite.shape import RunShape

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

# ---- parameters: built by the real model, on the meta device ------------------------------------


@lru_cache(maxsize=256)
def _template(m_fields: tuple, tp: int, sequence_parallel: bool, has_embedding: bool,
              has_head: bool, layers: tuple = (0,), ep: int = 1, etp: int = 1):  # fmt: skip
    """[(name, numel, spec)] of a GPTChunk with the given layers (one of each kind: dense, MoE),
    built on `meta`: the real model's parameters without allocating them. Layers of a kind
    differ only in their index."""
    from megalite.model.assemble import ChunkGroups
    from megalite.parallel.comm import Group
    from megalite.parallel.expert_parallel import ExpertGroups
    from megalite.parallel.specs import spec_of

    group = Group("tp", list(range(tp)), tp - 1)  # building a chunk needs no process group
    experts = ExpertGroups(Group("etp+ep", list(range(ep * etp)), ep * etp - 1), etp)
    layout = {"layers": list(layers), "has_embedding": has_embedding, "has_head": has_head}
    chunk = _built(
        ModelConfig(*m_fields), ChunkGroups(tp=group, experts=experts), sequence_parallel, layout
    )
    return tuple((n, p.numel(), spec_of(p)) for n, p in chunk.named_parameters())


def _built(
    m: ModelConfig, groups, sequence_parallel: bool, chunk: dict, training: dict | None = None
):
    """The chunk `chunk` (GPTChunk's arguments) of model `m` as training builds it
    (model/assemble.py), on the meta device: shapes, names and specs, no memory. `training`:
    TrainingConfig fields that differ from the defaults (FP8)."""
    from megalite.model.assemble import build_chunks, layer_env

    cfg = Config(model=m)
    cfg.training = dataclasses.replace(cfg.training, **(training or {}))
    (built,) = build_chunks(m, layer_env(cfg, groups, sequence_parallel, meta=True), [chunk])
    return built


def chunk_specs(
    m: ModelConfig, tp: int, layers, has_embedding, has_head, sequence_parallel=False, ep=1, etp=1
):
    """[(logical name, numel on this TP rank, ParamSpec)] in `named_parameters()` order; experts
    split over ep (and each over etp)."""
    # hashable for the cache: list fields (moe_dense_layers) as tuples
    fields = tuple(tuple(f) if isinstance(f, list) else f for f in dataclasses.astuple(m))
    return list(
        _chunk_specs(fields, tp, tuple(layers), has_embedding, has_head, sequence_parallel, ep, etp)
    )


@lru_cache(maxsize=4096)
def _chunk_specs(fields, tp, layers, has_embedding, has_head, sequence_parallel, ep, etp) -> tuple:
    m = ModelConfig(*fields)
    kinds = {}  # MoE or dense -> the model's first layer of that kind (its template, so that
    for i in layers:  # every chunk of a model shares it: the search plans thousands)
        moe = m.is_moe_layer(i)
        if moe not in kinds:
            kinds[moe] = next(j for j in range(m.num_layers + 64) if m.is_moe_layer(j) == moe)
    reps = tuple(sorted(kinds.values())) or (0,)
    template = _template(
        fields, tp, sequence_parallel and tp > 1, has_embedding, has_head, reps, ep, etp
    )
    head = ("final_norm", "output", "mtp")  # the head, then the MTP modules (model/mtp.py)
    before = [x for x in template if not x[0].startswith(("layers.", *head))]
    after = [x for x in template if x[0].startswith(head)]
    out = list(before)
    for i in layers:
        rep = f"layers.{kinds[m.is_moe_layer(i)]}."
        out += [(f"layers.{i}." + n.removeprefix(rep), k, s) for n, k, s in template
                if n.startswith(rep)]  # fmt: skip
    return tuple(out + after)


@lru_cache(maxsize=64)
def _fp8_layer_groups(m_fields: tuple, tp: int, sequence_parallel: bool) -> tuple:
    """The weights an FP8 layer quantises together (fp8_gather.weight_groups), as names within
    the layer (("attention.q.weight", ...), ...), from the real layer built on `meta`."""
    from megalite.model.assemble import ChunkGroups
    from megalite.parallel.comm import Group
    from megalite.parallel.fp8_gather import weight_groups

    groups = ChunkGroups(tp=Group("tp", list(range(tp)), tp - 1))
    fp8 = {"fp8_format": "hybrid", "fp8_recipe": "tensorwise", "fp8_first_last_layers_bf16": False}
    layer = {"layers": [0], "has_embedding": False, "has_head": False}
    chunk = _built(ModelConfig(*m_fields), groups, sequence_parallel, layer, fp8)
    name = {id(p): n.removeprefix("layers.0.") for n, p in chunk.named_parameters()}
    return tuple(tuple(name[id(p)] for p in g.params) for g in weight_groups([chunk], False))


def fp8_weights(cfg: Config, shape: RunShape, layers, head: bool = False) -> dict:
    """{name: (its layer, its FP8 group there)} of the FP8 linears' weights of `layers` (none
    without --fp8-format; not the first and last layers with --fp8-first-last-layers-bf16),
    and with `head` of the MTP modules' layers (model/mtp.py: always FP8). ZeRO-3 keeps them
    in a bucket of their own per unit (parallel/fp8_gather.py)."""
    m, t = cfg.model, cfg.training
    if t.fp8_format is None:
        return {}
    fields = tuple(tuple(f) if isinstance(f, list) else f for f in dataclasses.astuple(m))
    groups = _fp8_layer_groups(fields, shape.tp, shape.sequence_parallel and shape.tp > 1)
    high = (0, m.num_layers - 1) if t.fp8_first_last_layers_bf16 else ()
    prefixes = [f"layers.{i}." for i in layers if i not in high]
    prefixes += [f"mtp.{k}.layer." for k in range(m.mtp_num_layers)] if head else []
    return {p + n: (p, k) for p in prefixes for k, names in enumerate(groups) for n in names}


def kv_features(m: ModelConfig, tp: int) -> int:
    """A TP rank's k (or v) projection width: its share of the k/v heads, or all of them when tp
    does not divide them (every rank keeps them: model/layers.py `Attention.split_kv`)."""
    return m.heads_kv * m.head_dim // tp if m.heads_kv % tp == 0 else m.heads_kv * m.head_dim


def fused_blocks(m: ModelConfig, moe: bool = False) -> int:
    """How many blocks of a layer run fused column-parallel layers
    (tensor_parallel.fused_column_linear): the attention's q/k/v (not MLA's), the MLP's gate/up
    or GeLU up (in an MoE layer the shared expert's, if any). Outside FP8 they keep no weight
    copy and, of the block's all-gathered input, only this rank's rows, gathered again in
    backward (with sequence parallelism)."""
    mlp = not moe or bool(m.moe_shared_expert_intermediate_size)
    return int(not m.features.latent_attention) + int(mlp)


def fp8_layer(cfg: Config, m: ModelConfig, i: int) -> bool:
    """Whether transformer layer i runs its linears in FP8 (kernels/fp8_linear.py `covers`):
    FP8 on, and not the first or last layer under --fp8-first-last-layers-bf16."""
    from megalite.kernels.fp8_linear import covers

    t = cfg.training
    return t.fp8_format is not None and covers(i, m.num_layers, t.fp8_first_last_layers_bf16)


def fp8_saved(cfg: Config, m: ModelConfig, tp: int, layers) -> float:
    """What FP8 linears change in the bytes `layers` keep for backward per micro-batch (`m`: the
    model at the rank's sequence length), as kernels/fp8.py saves them, against what
    activations.layer_activations counts for an FP8 layer (its fused layers on their
    concatenated weights and the whole input, as FP8's linear runs them): a per-tensor recipe
    (tensorwise, delayed) keeps FP8 copies (1 byte per element, and a scale) of every linear's
    input and weight, and no longer the high-precision inputs only the linears kept (those of
    q/k/v and of the MLP's first linear(s), the MLP activation's output) nor the fused layers'
    concatenated weights; rowwise and mxfp8 keep what F.linear keeps. Dense, non-MLA layers
    (others unchanged), nothing under full recompute."""
    t = cfg.training
    if t.fp8_format is None or t.recompute == "full" or m.features.latent_attention:
        return 0.0
    from megalite.kernels.fp8 import RECIPES  # torch: only for an FP8 plan

    if not RECIPES[t.fp8_recipe].transposable:
        return 0.0
    e, n, h, f = BYTES[t.precision], m.seq_length * t.micro_batch_size, m.hidden_size, m.ffn
    kv = kv_features(m, tp)
    qkv, up = h / tp + 2 * kv, f / tp * (2 if m.features.gated_mlp else 1)  # output features
    copies = n * h + qkv * h + n * h / tp + h * h / tp  # attention: q/k/v fused, out
    copies += n * h + up * h + n * f / tp + h * f / tp + 4 * 2 * 4  # MLP; 8 scales (fp32)
    gone = 2 * n * h * e + qkv * (h + m.features.qkv_bias) * e + n * f / tp * e
    gone += 2 * f / tp * h * e if m.features.gated_mlp else 0  # gate/up concatenated
    fp8 = [i for i in layers if fp8_layer(cfg, m, i) and not m.is_moe_layer(i)]
    return len(fp8) * (copies - gone)


def zero3_params(cfg: Config, shape: RunShape, kw: dict, specs) -> list:
    """A chunk's [(name, numel, alone)] for unit_layout, as Zero3Buffer lays them out: tied
    halves alone, FP8 weights together in a bucket of their own per layer."""
    fp8 = fp8_weights(cfg, shape, kw["layers"], kw["has_head"])
    return [(n, k, "fp8" if n in fp8 else "embed" in s.grad_sum) for n, k, s in specs]


def replicas(shape: RunShape) -> int:
    """Ranks ZeRO shards the state over (the shard group): the dp axis times cp. With
    --dp-replicate its dpr copies hold the same shards (the dp axis is the shard group's part of
    the data-parallel ranks), so the state is 1/(dp*cp) per rank, not 1/(dp*dpr*cp)."""
    return shape.size("dp") * shape.cp


def expert_parallel(shape: RunShape) -> tuple[int, int]:
    """(ep, edp) of a layout: edp = tp*dp*cp/(ep*etp) (dp x dpr: every data-parallel rank), the
    ranks holding the same expert slices."""
    return shape.ep, max(1, shape.tp * replicas(shape) * shape.dpr // (shape.ep * shape.etp))


def chunk_params(m: ModelConfig, tp: int, layers, has_embedding, has_head, sequence_parallel=False):
    """[(logical name, numel on this TP rank, gradient summed over TP)] in registration order."""
    specs = chunk_specs(m, tp, layers, has_embedding, has_head, sequence_parallel)
    return [(n, k, "tp" in s.grad_sum) for n, k, s in specs]


def buckets(cfg: Config, shape: RunShape, pp_rank: int, experts: bool = False):
    """The GradBuffer's buckets on this pipeline rank (buckets.bucket_layout):
    [(start, end, [(name, offset, numel, groups its gradient is summed over)])]. `experts`:
    those of the expert parameters instead (their own buffer, sharded over edp)."""
    m, o = cfg.model, cfg.optimizer
    prec = cfg.training.precision
    g_size = 4 if prec in ("bf16", "fp16") else BYTES[prec]  # gradients: fp32 when low
    ep, edp = expert_parallel(shape)
    sync = {}
    chunks = []
    for kw in shape.partition.rank_chunks(pp_rank):
        specs = chunk_specs(
            m, shape.tp, **kw, sequence_parallel=shape.sequence_parallel, ep=ep, etp=shape.etp
        )
        specs = [x for x in specs if x[2].expert == experts]
        zero3 = shape.zero.shard_params and not experts  # one bucket per unit, as Zero3Buffer
        if zero3:
            chunks.append(zero3_params(cfg, shape, kw, specs))
        else:
            chunks.append([(n, k, "embed" in s.grad_sum) for n, k, s in specs])
        sync.update({n: s.grad_sum for n, _, s in specs})
    if shape.zero.shard_params and not experts:
        layout = unit_layout(chunks, replicas(shape) * ALIGN)
    else:
        d = edp if experts else replicas(shape)
        layout = bucket_layout(chunks, bucket_numel(o.bucket_size_mb, d, g_size), d * ALIGN)
    return [(s, e, [(n, o, k, sync[n]) for n, o, k in ranges]) for s, e, ranges in layout]


def state_memory(
    cfg: Config, shape: RunShape, pp_rank: int, bs=None, dp_rank=0, edp_rank=0
) -> dict:
    """Bytes this rank allocates for parameters, gradients and optimizer state (Muon: the
    AdamW second moments in the shards of replica `dp_rank`, expert-data-parallel `edp_rank`)."""
    prec = cfg.training.precision
    low = prec in ("bf16", "fp16")
    p_size, g_size = BYTES[prec], 4 if low else BYTES[prec]
    bs = bs or buckets(cfg, shape, pp_rank)
    numel = bs[-1][1] if bs else 0
    zero = shape.zero
    out = zero.state_bytes(numel, replicas(shape), p_size, g_size)
    out["optimizer"] -= _unused_second_moments(cfg, shape, pp_rank, bs, dp_rank, False) * g_size
    staged = zero.staged_peak([e - s for s, e, _ in bs]) * g_size  # transient, stages 2/3
    expert_numel = 0
    if cfg.model.num_experts:  # the expert buffer: its own buckets, sharded over edp
        es = buckets(cfg, shape, pp_rank, experts=True)
        expert_numel = es[-1][1] if es else 0
        ex = zero.state_bytes(expert_numel, expert_parallel(shape)[1], p_size, g_size)
        ex["optimizer"] -= _unused_second_moments(cfg, shape, pp_rank, es, edp_rank, True) * g_size
        out = {k: out[k] + ex[k] for k in out}
        staged += zero.staged_peak([e - s for s, e, _ in es]) * g_size  # its own buckets too
    gathered = 0
    if zero.shard_params:  # whole units alive at once, on top of the shards
        gathered = zero3_units(cfg, shape, pp_rank)[reshard_policy(cfg, shape)][0]
    return {**out, "staged_grads": staged, "gathered_params": gathered,
            "numel": numel + expert_numel, "expert_numel": expert_numel}  # fmt: skip


def _unused_second_moments(cfg: Config, shape: RunShape, pp_rank: int, bs, rank: int,
                           experts: bool) -> int:  # fmt: skip
    """Shard elements without an AdamW second moment (Muon's matrices) in buckets `bs`, on
    rank `rank` of the group they are sharded over (the replicas, or edp for `experts`)."""
    if not muon_on(cfg.optimizer):
        return 0
    specs = {}
    for kw in shape.partition.rank_chunks(pp_rank):
        sequence_parallel = shape.sequence_parallel
        specs.update((n, s) for n, _, s in chunk_specs(cfg.model, shape.tp, **kw, ep=shape.ep,
                                                       sequence_parallel=sequence_parallel,
                                                       etp=shape.etp))  # fmt: skip
    dp = expert_parallel(shape)[1] if experts else replicas(shape)
    unused = 0
    for start, end, ranges in bs:
        n = shape.zero.shard(end - start, dp)
        lo = start + rank * n if n < end - start else start
        named = [(name, o, k, specs[name]) for name, o, k, _ in ranges]
        unused += n - second_moments(cfg.optimizer, named, lo, lo + n)
    return unused


# ---- ZeRO-3: units gathered, and how often -------------------------------------------------------


def reshard_policy(cfg: Config, shape: RunShape) -> str | None:
    """The policy of zero.GATHERS this layout's ZeRO stage keeps parameters gathered under."""
    return shape.zero.reshard(shape.pp > 1, cfg.optimizer.zero3_keep_params)


def zero3_units(cfg: Config, shape: RunShape, pp_rank: int) -> dict:
    """{policy: (most parameter bytes gathered at once, [padded numel of each bucket], [(bytes
    gathered, FP8 amaxes all-reduced first) of each bucket])} on this pipeline rank.
    "forward": a chunk's outer unit (embedding, head) and two neighbouring layers (the one
    computing and the one prefetched); "backward": a whole chunk (each layer kept from its
    forward to its backward); "step": every chunk of the rank. With --fp8-param-gather an FP8
    bucket is gathered at 1 byte per element, after one all-reduce of its weights' amaxes."""
    t = cfg.training
    e = BYTES[t.precision]
    per_chunk, sizes, gathers = [], [], []
    for kw in shape.partition.rank_chunks(pp_rank):
        specs = chunk_specs(cfg.model, shape.tp, **kw, sequence_parallel=shape.sequence_parallel)
        params = zero3_params(cfg, shape, kw, specs)
        fp8 = fp8_weights(cfg, shape, kw["layers"], kw["has_head"]) if t.fp8_param_gather else {}
        units = {}
        for start, end, ranges in unit_layout([params], replicas(shape) * ALIGN):
            amaxes = len({fp8[n] for n, _, _ in ranges if n in fp8})
            nbytes = (end - start) * (1 if amaxes else e)
            units[unit_of(ranges[0][0])] = units.get(unit_of(ranges[0][0]), 0) + nbytes
            sizes.append(end - start)
            gathers.append((nbytes, amaxes))
        layers = [n for u, n in units.items() if u]  # in forward order
        per_chunk.append((units.get("", 0), layers))
    # two neighbours at once (one computing, the next or previous arriving): they differ in
    # size with FP8 gathers and --fp8-first-last-layers-bf16
    pairs = lambda ls: max((a + b for a, b in zip(ls, ls[1:])), default=sum(ls))  # noqa: E731
    forward = max((outer + pairs(layers) for outer, layers in per_chunk), default=0)
    chunk = max((outer + sum(layers) for outer, layers in per_chunk), default=0)
    total = sum(outer + sum(layers) for outer, layers in per_chunk)
    return {"forward": (forward, sizes, gathers), "backward": (chunk, sizes, gathers),
            "step": (total, sizes, gathers)}  # fmt: skip
