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
from megalite.plan.activations import peak_activations
from megalite.plan.links import link_bytes
from megalite.plan.memory import buckets, state_memory
from megalite.plan.ranking import Cluster, GiB, step_time
from megalite.plan.traffic import comm_bytes, zero3_notes
from megalite.shape import RunShape, derive, validate


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


def check_model(cfg: Config) -> None:
    """Reject, with validate's sentence, what no layout can fix (the model, the batch, the
    flags), before a search: validate at one rank, the layout flags left out (the search tries
    its own; cp and ep stay where the search keeps them, its layouts are checked one by one)."""
    par = replace(cfg.parallel, tp=1, pp=1, cp=1, dp=None, vpp=1, ep=1, pp_schedule=None,
                  sequence_parallel=False)  # fmt: skip
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
    par = replace(cfg.parallel, vpp=vpp, sequence_parallel=sequence_parallel,
                  pp_schedule=name, **sizes)  # fmt: skip
    return derive(
        replace(cfg, parallel=par, optimizer=replace(cfg.optimizer, zero_stage=zero)), world
    )


def plan(cfg: Config, shape: RunShape, cluster: Cluster | None = None, all_stages=True) -> Plan:
    """Memory per pipeline rank, traffic and bubble of one layout (`layout()`, or the run's
    shape from `validate`); `cfg` gives the model, the batch and the training settings."""
    mb = shape.microbatches
    stages = []
    # Middle stages hold no embedding or head and fewer micro-batches in flight than the
    # first: the search looks at the first and the last stage only.
    ranks = range(shape.pp) if all_stages else sorted({0, shape.pp - 1})
    comms = []
    for r in ranks:
        bs = buckets(cfg, shape, r)
        comms.append(comm_bytes(cfg, shape, r, mb, bs=bs))
        mem = state_memory(cfg, shape, r, bs)
        mem["activations"] = peak_activations(cfg, shape, r, mb)
        # what the p2p tensors and a backward's working memory add at the worst moment
        mem["buffers"] = peak_activations(cfg, shape, r, mb, buffers=True) - mem["activations"]
        mem["total"] = sum(mem[k] for k in ("params", "grads", "optimizer", "activations"))
        mem["total"] += mem["buffers"]
        mem["total"] += mem["staged_grads"] + mem["gathered_params"]
        stages.append(mem)
    worst = max(range(len(stages)), key=lambda i: stages[i]["total"])
    kinds = ("tp", "pp", "dp", "dp_gather", "cp", "cp+dp", "embed", "world", "ep", "ep_sizes",
             "edp")  # fmt: skip
    comm = {k: max(c.get(k, 0) for c in comms) for k in kinds}
    bubble = bubble_theory(shape.pp, shape.vpp, mb, shape.schedule)
    p = Plan(shape, stages[worst], stages, {k: v for k, v in comm.items() if v}, bubble, mb)
    if shape.zero.shard_params:
        p.notes += zero3_notes(cfg, shape, ranks[worst], mb)
    if cluster is not None:
        p.fits = p.memory["total"] <= cluster.usable * cluster.gpu_memory_gib * GiB
        p.links = link_bytes(shape, p.comm, cluster.gpus_per_node, cfg.parallel.cp_comm_type)
    return p


def search(
    cfg: Config, cluster: Cluster, flops_per_token: float, limit=None, zero_stages=None
) -> list[Plan]:
    """Layouts of cluster.gpus that fit, fastest first by ranking.step_time (`flops_per_token`:
    the model's hardware FLOPs per token, training/flops.py). Tried: every tp that divides the
    GPUs within a node (TP stays inside a node), every pp that divides the rest and the layers,
    dp for the rest, vpp 1 and 2, and the ZeRO stages `zero_stages` (default: those the search
    tries; ZeRO-3 trades traffic for memory: planned when asked for, not searched); a layout
    `validate` refuses (the batch does not split over its dp, ...) is skipped. Ties go to the
    fewer bytes, then the lower memory."""
    # cp stays as given: it sets how many tokens of a sequence a rank holds, the user's choice
    cp = cfg.parallel.cp
    n = cluster.gpus // cp if cluster.gpus % cp == 0 else 0
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    tried = (
        [ZERO[z] for z in zero_stages] if zero_stages else [z for z in ZERO.values() if z.searched]
    )
    plans = []
    for tp in (d for d in divisors if d <= cluster.gpus_per_node):
        for pp in (p for p in divisors if (n // tp) % p == 0 and cfg.model.num_layers % p == 0):
            dp = n // (tp * pp)
            stages = [z for z in tried if dp > 1 or not z.shard_state]
            for vpp in (1, 2) if pp > 1 else (1,):
                for zero in stages:
                    try:
                        shape = layout(cfg, tp, pp, dp, vpp, zero.stage, tp > 1,
                                       **({"cp": cp} if cp > 1 else {}))  # fmt: skip
                    except MegaliteError:
                        continue
                    if not _state_fits(cfg, shape, cluster):  # before walking schedules
                        continue
                    p = plan(cfg, shape, cluster, all_stages=False)
                    if p.fits:
                        p.step_time = step_time(cfg, p, cluster, flops_per_token)
                        plans.append(p)
    plans.sort(key=lambda p: (p.step_time, sum(p.comm.values()), p.memory["total"]))
    return plans[:limit] if limit else plans


def _state_fits(cfg: Config, shape: RunShape, cluster: Cluster) -> bool:
    """Whether the first and the last stage's parameters, gradients and optimizer state alone
    fit (the activations come on top): most layouts of a large model fail this, and it needs
    no schedule."""
    usable = cluster.usable * cluster.gpu_memory_gib * GiB
    for r in sorted({0, shape.pp - 1}):
        mem = state_memory(cfg, shape, r)
        if sum(mem[k] for k in ("params", "grads", "optimizer", "gathered_params")) > usable:
            return False
    return True
