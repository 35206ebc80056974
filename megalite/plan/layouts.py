"""The planner's layouts: a layout is the run shape `validate` derives for it (`layout()`, the
one layout type of validate, --dry-run and the planner), planned without a process group or a
GPU (`plan()`: memory per pipeline rank from memory.py and activations.py, traffic from
traffic.py, the schedule's bubble), and the layouts of a cluster searched and ranked by the
estimated step time of ranking.py (`search()`). docs/planner.md gives the formulas."""

from dataclasses import dataclass, field, replace

from megalite.config import Config
from megalite.errors import MegaliteError
from megalite.parallel.zero import ZERO
from megalite.pipeline.schedules import bubble_theory, check_shape
from megalite.plan import stages
from megalite.plan.activations import peaks
from megalite.plan.links import link_bytes
from megalite.plan.memory import buckets, state_memory
from megalite.plan.ranking import Cluster, GiB, compute_bound, step_time
from megalite.plan.traffic import comm_bytes, zero3_notes
from megalite.shape import RunShape, derive, validate

SPLITS_TRIED = 3  # per layout, best first, until one fits (stages.splits)
MIN_CP_TOKENS = 2048  # the fewest tokens of a sequence per context-parallel rank (cp_sizes)
VPPS = (1, 2, 4, 8)  # interleaving degrees tried (pp > 1; at least a layer per chunk)
MICRO_BATCH_SIZES = (1, 2, 4, 8)  # tools/plan.py's search, where --micro-batch-size is not given
RECOMPUTES = ("none", "selective", "full")  # tools/plan.py's, where --recompute-granularity is not
PRUNE = 0.3  # a layout whose compute alone is this much slower than the fastest is not planned


@dataclass
class Plan:
    layout: RunShape
    memory: dict  # bytes on the fullest pipeline rank: params, grads, optimizer, activations,
    # buffers (p2p, a backward's working memory), staged_grads, gathered_params, total
    stages: list  # the same dict for every pipeline rank
    comm: dict  # bytes per step sent by the busiest rank, per group kind
    bubble: float  # the schedule's theory: Megatron's (pp-1)/(vpp*m) for 1F1B and interleaved
    microbatches: int
    fits: bool = True
    step_time: float | None = None  # estimated seconds per step (ranking.step_time)
    notes: list = field(default_factory=list)
    links: dict = field(default_factory=dict)  # kind -> {link: bytes per step} (links.py)
    buckets: int = 0  # gradient buckets on the rank with the most (each a collective per round)
    split: tuple = ()  # the pipeline split's flags, ((name, value), ...) (stages.py); () even
    recompute: str | None = None  # the granularity the search planned it at (None: cfg's)


def check_model(cfg: Config) -> None:
    """Reject, with validate's sentence, what no layout can fix (the model, the batch, the
    flags), before a search: validate at one rank, the layout flags left out (the search tries
    its own; cp and ep stay where the search keeps them, its layouts are checked one by one;
    --tp-comm-overlap goes with sequence parallelism, which `layout` turns on at tp > 1)."""
    par = replace(cfg.parallel, tp=1, pp=1, cp=1, dp=None, vpp=1, ep=1, pp_schedule=None,
                  sequence_parallel=False, tp_comm_overlap=False, **stages.NO_SPLIT)  # fmt: skip
    validate(replace(cfg, parallel=par), 1)


def layout(cfg: Config, tp=1, pp=1, dp=1, vpp=1, zero=0, sequence_parallel=False, **axes):
    """The run shape of cfg's model and batch at this layout (`cp=2`, ...: other axes), as
    `validate` derives it for tp*pp*dp*... ranks, or MegaliteError naming why it cannot run. The
    configured --pp-schedule where it can run the layout, else the default for its vpp."""
    sizes = {"tp": tp, "pp": pp, "dp": dp, **axes}
    world = 1
    for n in sizes.values():
        world *= n
    t = cfg.training
    name = cfg.parallel.pp_schedule
    if name and t.global_batch_size % (t.micro_batch_size * dp) == 0:
        if check_shape(name, pp, vpp, t.global_batch_size // (t.micro_batch_size * dp)):
            name = None
    # --tp-comm-overlap where it applies (SP, tp > 1): the user's choice for the layouts it fits
    overlap = cfg.parallel.tp_comm_overlap and sequence_parallel and tp > 1
    par = replace(cfg.parallel, vpp=vpp, sequence_parallel=sequence_parallel,
                  pp_schedule=name, tp_comm_overlap=overlap, **sizes)  # fmt: skip
    return derive(
        replace(cfg, parallel=par, optimizer=replace(cfg.optimizer, zero_stage=zero)), world
    )


def plan(
    cfg: Config, shape: RunShape, cluster: Cluster | None = None, all_stages=True, memo=None
) -> Plan:
    """Memory per pipeline rank, traffic and bubble of one layout (`layout()`, or the run's
    shape from `validate`); `cfg` gives the model, the batch and the training settings. `memo`:
    a dict the search shares between the plans of one model and batch."""
    memo = {} if memo is None else memo
    mb = shape.microbatches
    stages = []
    # Middle stages hold no embedding or head and fewer micro-batches in flight than the
    # first: the search looks at the first and the last stage, and at the second where the
    # first is short (an uneven split: it may then hold the most layers in flight).
    ranks = range(shape.pp) if all_stages else _ends(shape)
    comms, most = [], 0
    for r in ranks:
        bs = buckets(cfg, shape, r)
        most = max(most, len(bs))
        comms.append(comm_bytes(cfg, shape, r, mb, bs=bs))
        mem = state_memory(cfg, shape, r, bs)
        # the activations and, at the worst moment, what the p2p tensors and a backward's
        # working memory add: the same at every ZeRO stage (the search's memo keeps them)
        key = (shape.sizes, shape.vpp, shape.schedule, shape.stage_layers, mb, r,
               shape.micro_batch_size, cfg.training.recompute, shape.ep, shape.etp)  # fmt: skip
        if key not in memo:
            acts, with_buffers = peaks(cfg, shape, r, mb)
            memo[key] = acts, with_buffers - acts
        mem["activations"], mem["buffers"] = memo[key]
        mem["total"] = sum(mem[k] for k in ("params", "grads", "optimizer", "activations"))
        mem["total"] += mem["buffers"]
        mem["total"] += mem["staged_grads"] + mem["gathered_params"]
        stages.append(mem)
    worst = max(range(len(stages)), key=lambda i: stages[i]["total"])
    kinds = sorted({k for c in comms for k in c})  # every group kind a stage sends over
    comm = {k: max(c.get(k, 0) for c in comms) for k in kinds}
    bubble = bubble_theory(shape.pp, shape.vpp, mb, shape.schedule)
    p = Plan(shape, stages[worst], stages, {k: v for k, v in comm.items() if v}, bubble, mb)
    p.buckets = most
    if shape.zero.shard_params:
        p.notes += zero3_notes(cfg, shape, ranks[worst], mb)
    if cluster is not None:
        p.fits = p.memory["total"] <= cluster.usable * cluster.gpu_memory_gib * GiB
        p.links = link_bytes(shape, p.comm, cluster.gpus_per_node, cfg.parallel.cp_comm_type)
    return p


def search(
    cfg: Config,
    cluster: Cluster,
    flops_per_token: float,
    limit=None,
    zero_stages=None,
    misses: list | None = None,
    micro_batch_sizes=None,
    recomputes: dict | None = None,
) -> list[Plan]:
    """Layouts of cluster.gpus that fit, fastest first by ranking.step_time (`flops_per_token`:
        the model's hardware FLOPs per token, training/flops.py). Tried: every cp of `cp_sizes`
        (the configured cp, and every power of two that leaves a rank at least MIN_CP_TOKENS tokens
        of a sequence), every tp that divides the GPUs within a node (TP stays inside a node), every
        pp that divides the rest, dp for the rest, vpp of VPPS, for each (pp, vpp) the pipeline
        splits of stages.splits (even, or Megatron's uneven flags: the first that runs and fits of
        the best few), and the ZeRO stages `zero_stages` (default: those the search tries; ZeRO-3
        trades traffic for memory: planned when asked for, not searched); a layout `validate`
        refuses (the batch does not split over its dp, ...) is skipped. Ties go to the fewer bytes,
        then the lower memory. `misses`: a list given receives the layouts planned that did not fit
        (the least memory first), to say how far the nearest is when none fits. Estimates within
    TIE of each other are one: among them the least model parallelism goes first. With ZeRO, hybrid
        sharding is tried too: the shard group filling a node (`_replicates`). `micro_batch_sizes`:
        those tried (default: cfg's), each layout keeping its fastest that fits (its plan's
        `layout.micro_batch_size`); one that does not split the batch over dp is skipped.
    `recomputes`: {recompute granularity: the model's hardware FLOPs per token with it} to try
    (tools/plan.py: none, selective and full where --recompute-granularity is not given; default
    cfg's), each layout keeping its fastest that fits. A layout whose compute alone is PRUNE
    slower than the fastest planned before it is not planned."""
    tried = (
        [ZERO[z] for z in zero_stages] if zero_stages else [z for z in ZERO.values() if z.searched]
    )
    layer, head = stages.shares(cfg, flops_per_token)
    plans, memo = [], {}
    t = cfg.training
    per_token = recomputes or {t.recompute: flops_per_token}
    cfgs = [(replace(cfg, training=replace(t, micro_batch_size=b, recompute=r)), f)
            for r, f in per_token.items()
            for b in micro_batch_sizes or (t.micro_batch_size,)]  # fmt: skip
    fastest = None  # the fastest step time planned so far
    for cp in cp_sizes(cfg, cluster.gpus):
        n = cluster.gpus // cp
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        for tp in (d for d in divisors if d <= cluster.gpus_per_node):
            for pp in (p for p in divisors if (n // tp) % p == 0 and p <= cfg.model.num_layers):
                dp = n // (tp * pp)
                zeros = [z for z in tried if dp > 1 or not z.shard_state]
                for vpp in (v for v in VPPS if pp > 1 or v == 1):
                    splits = stages.splits(cfg.model.num_layers, pp, vpp, layer, head)
                    for zero, rep, experts in (
                        (z, r, x) for z in zeros
                        for r in _replicates(dp, tp * cp, z, cluster.gpus_per_node)
                        for x in expert_sizes(cfg, tp, dp)
                    ):  # fmt: skip
                        best = None
                        for c0, f in cfgs:
                            c = replace(c0, parallel=replace(c0.parallel, **experts))
                            if t.global_batch_size % (c.training.micro_batch_size * dp):
                                continue
                            cut = (1 + PRUNE) * fastest if fastest else None
                            p = _first_fit(c, cluster, splits[:SPLITS_TRIED], tp, pp, dp,
                                           vpp, zero, cp, memo, misses, rep,
                                           (cut, f))  # fmt: skip
                            if p is None:
                                continue
                            p.step_time = step_time(c, p, cluster, f)
                            p.recompute = c.training.recompute
                            if best is None or p.step_time < best.step_time:
                                best = p
                            fastest = min(fastest or p.step_time, p.step_time)
                        if best is not None:
                            plans.append(best)
    if misses is not None:
        misses.sort(key=lambda p: p.memory["total"])
    plans.sort(key=lambda p: (p.step_time, sum(p.comm.values()), p.memory["total"]))
    plans = _ties_to_less_model_parallelism(plans)
    return plans[:limit] if limit else plans


TIE = 0.005  # step times this close are one estimate for the model (docs/planner.md)


def _ties_to_less_model_parallelism(plans: list[Plan]) -> list[Plan]:
    """Plans sorted by step time, each run of them within TIE of its first reordered by their
    model parallelism: the fewer pipeline stages, then the smaller tp·cp, then the order they
    had. Below the model's resolution the layout with more data parallelism wins, as
    Megatron-LM advises (the least model parallelism that fits, pipeline stages last: each adds
    bubble, p2p and an uneven memory the model counts only in part)."""
    out, i = [], 0
    while i < len(plans):
        j = i
        while j < len(plans) and plans[j].step_time <= (1 + TIE) * plans[i].step_time:
            j += 1
        run = plans[i:j]
        out += sorted(run, key=lambda p: (p.layout.pp, p.layout.tp * p.layout.cp))
        i = j
    return out


EXPERT_PARALLEL = (1, 2, 4, 8, 16, 32, 64)  # the ep sizes the search tries (MoE models)


def expert_sizes(cfg: Config, tp: int, dp: int) -> list[dict]:
    """The expert layouts the search tries at (tp, dp), as ParallelConfig fields: the configured
    (ep, etp), and for an MoE model each ep of EXPERT_PARALLEL that divides the experts, with
    the experts' width unsplit (etp 1: ep with or without tp) or split over tp (etp = tp), where
    ep·etp divides a stage's tp·dp ranks."""
    p, m = cfg.parallel, cfg.model
    out = [{"ep": p.ep, "etp": p.etp}]
    if not m.num_experts:
        return out
    etps = [1] + ([tp] if tp > 1 and m.moe_ffn % tp == 0 else [])
    for ep in EXPERT_PARALLEL:
        for etp in etps:
            x = {"ep": ep, "etp": etp}
            if m.num_experts % ep == 0 and (tp * dp) % (ep * etp) == 0 and x not in out:
                out.append(x)
    return out


def cp_sizes(cfg: Config, gpus: int) -> list[int]:
    """The context-parallel sizes the search tries: the configured one, and the powers of two
    that divide the GPUs and the sequence into 2 cp blocks (the causal load balance) and leave
    each rank at least MIN_CP_TOKENS tokens of a sequence (below, attention's kernels and the
    ring's messages are too small to pay; compute.py times what is above)."""
    sizes, c = {cfg.parallel.cp}, 2
    s = cfg.model.seq_length
    while gpus % c == 0 and s % (2 * c) == 0 and s // c >= MIN_CP_TOKENS:
        sizes.add(c)
        c *= 2
    return sorted(c for c in sizes if gpus % c == 0)


def _replicates(dp: int, inner: int, zero, gpus_per_node: int) -> list[int]:
    """The --dp-replicate values tried: 1, and where ZeRO shards the optimizer state over more
    ranks than a node holds of them (dp > node / (tp*cp)), the R whose shard group fills a node
    (hybrid sharding: its reductions and gathers stay on NVLink, only the copies' all-reduce of
    each shard crosses the network)."""
    shard = gpus_per_node // inner
    if zero.shard_state and 1 < shard < dp and dp % shard == 0:
        return [1, dp // shard]
    return [1]


def _first_fit(cfg, cluster, splits, tp, pp, dp, vpp, zero, cp, memo, misses,
               replicate: int = 1, cut=(None, 0.0)) -> Plan | None:  # fmt: skip
    """The plan of the first of `splits` (stages.splits: best first) with which the layout
    runs and fits the cluster, or None. `cut`: (seconds, FLOPs per token): a layout whose
    compute alone (ranking.compute_bound) passes those seconds is not planned."""
    for split in splits:
        par = {**stages.NO_SPLIT, **dict(split), "dp_replicate": replicate}
        c = replace(cfg, parallel=replace(cfg.parallel, **par))
        try:
            shape = layout(c, tp, pp, dp, vpp, zero.stage, tp > 1, **({"cp": cp} if cp > 1 else {}))
        except MegaliteError:
            continue
        # before walking schedules; the same at every micro-batch size
        key = ("state", split, tp, pp, dp, vpp, zero.stage, cp, replicate, cfg.parallel.ep,
               cfg.parallel.etp)  # fmt: skip
        if key not in memo:
            memo[key] = _state_fits(c, shape, cluster)
        if not memo[key]:
            continue
        if cut[0] is not None:
            key = ("bound", split, tp, pp, dp, vpp, cp, shape.micro_batch_size,
                   cfg.training.recompute, shape.ep, shape.etp)  # fmt: skip
            if key not in memo:
                memo[key] = compute_bound(c, shape, cluster, cut[1])
            if memo[key] > cut[0]:
                continue
        p = plan(c, shape, cluster, all_stages=False, memo=memo)
        p.split = split
        if p.fits:
            return p
        if misses is not None:
            misses.append(p)
    return None


def _ends(shape: RunShape) -> list[int]:
    """The pipeline ranks the search plans: the first, the last, and the second of an uneven
    split (its middle ranks may hold more layers than the first)."""
    ranks = {0, shape.pp - 1}
    if not shape.partition.even_split and shape.pp > 2:
        ranks.add(1)
    return sorted(ranks)


def _state_fits(cfg: Config, shape: RunShape, cluster: Cluster) -> bool:
    """Whether the first and the last stage's parameters, gradients and optimizer state alone
    fit (the activations come on top): most layouts of a large model fail this, and it needs
    no schedule."""
    usable = cluster.usable * cluster.gpu_memory_gib * GiB
    for r in _ends(shape):
        mem = state_memory(cfg, shape, r)
        if sum(mem[k] for k in ("params", "grads", "optimizer", "gathered_params")) > usable:
            return False
    return True
