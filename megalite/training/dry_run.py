"""`pretrain_gpt.py --dry-run` and tools/plan.py: the plan of a layout, then the layouts that fit
the cluster, fastest first (megalite/plan/); the dry run then what `parallelize` applies and
where each parameter lives (`print_applied`). Needs no process group and no GPU."""

from dataclasses import replace

from megalite.config import Config
from megalite.plan.layouts import plan, search
from megalite.plan.ranking import Cluster, GiB, step_time
from megalite.plan.report import format_plan, format_ranking
from megalite.shape import RunShape
from megalite.training.flops import hardware_flops_per_token, peak_flops


def cluster_from_env(world_size: int, precision: str = "bf16") -> Cluster:
    """The cluster a dry run plans for: the local GPU's memory, peak and kind when there is one (no
    process group needed), else an 80 GiB H100's; GPUs per node from torchrun's
    LOCAL_WORLD_SIZE, else 8."""
    import os

    import torch

    memory, peak, gpu = 80.0, Cluster(1).peak_tflops, Cluster(1).gpu
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        memory = torch.cuda.get_device_properties(0).total_memory / GiB
        peak = (peak_flops(name, precision) or peak * 1e12) / 1e12
        # compute.GPUS by name (its bandwidth and GEMM efficiency); an unlisted one as an H100
        gpu = next((k for k in ("b200", "h200", "a100") if k.upper() in name), gpu)
    node = int(os.environ.get("LOCAL_WORLD_SIZE", min(world_size, 8)))
    return Cluster(world_size, round(memory, 1), node, peak_tflops=peak, gpu=gpu)


def print_plan(
    cfg: Config,
    shape: RunShape | str,
    cluster: Cluster | None = None,
    top: int = 8,
    zero_stages=None,
    micro_batch_sizes=None,
    recomputes=None,
):
    """The plan of `shape` (`validate`'s: the layout given), then the best layouts for as many
    GPUs. `shape` may instead be the sentence why the layout given cannot run on the cluster
    (tools/plan.py): the search still runs. `zero_stages`, `micro_batch_sizes`: those the search
    tries (layouts.search); `recomputes`: the granularities it tries (default: cfg's). The
    ranking ends with the launch line of the layout it prefers."""
    # the built-in tokenizer's vocabulary is known before it is trained
    vocab = cfg.model.vocab_size or cfg.data.tokenizer_vocab_size
    cfg = replace(cfg, model=replace(cfg.model, vocab_size=vocab))
    flops = hardware_flops_per_token(cfg.model, cfg.training.recompute)
    if isinstance(shape, str):
        print(f"the layout given does not run on {cluster.gpus} GPUs: {shape}")
    else:
        cluster = cluster or cluster_from_env(shape.world_size, cfg.training.precision)
        given = plan(cfg, shape, cluster)
        given.step_time = step_time(cfg, given, cluster, flops)
        print(format_plan(given, cluster, given.step_time))
    misses = []  # what was planned and did not fit: the nearest is named when none fits
    tried = None
    if recomputes:  # {granularity: hardware FLOPs per token} for the search
        tried = {r: hardware_flops_per_token(cfg.model, r) for r in recomputes}
    plans = search(cfg, cluster, flops, None, zero_stages, misses, micro_batch_sizes, tried)
    shown = None if isinstance(shape, str) else given  # placed among the layouts searched
    print(format_ranking(plans, cluster, misses, cfg, shown, top), flush=True)


def print_applied(cfg: Config, shape: RunShape):
    """What `parallelize` applies on the first and the last pipeline stage, in its order, then
    each parameter's placement on them (training/applied.py): the chunks built as training
    builds them, on the meta device with groups that have no communicator."""
    from megalite.parallel.groups import described_groups
    from megalite.training.applied import applied, module_plan
    from megalite.training.build import parallelize

    if shape.model.vocab_size is None:  # the built-in tokenizer's, as print_plan's
        shape = shape.with_vocab(cfg.data.tokenizer_vocab_size)
    topo = shape.topology()
    chunks = []
    for stage in sorted({0, shape.pp - 1}):
        groups = described_groups(topo, topo.group("pp", 0)[stage])
        mine, _ = parallelize(cfg, shape, groups, data_parallel=False, meta=True)
        print(f"applied on pipeline stage {stage}, in order:")
        print("\n".join("  " + line for line in applied(cfg, shape, mine, stage)))
        chunks += mine
    print("per-module plan (name: placement, gradient sums):")
    print("\n".join("  " + line for line in module_plan(chunks)), flush=True)


def print_schedule(cfg: Config, shape: RunShape):
    """The run's pipeline schedule proved as data before any rank runs it (pipeline/verify.py:
    every send matched by its receive, each forward before its backward, no deadlock, each
    rank's live activations at the schedule's bound), at each micro-batch count the run steps
    with (a batch-size ramp-up has several); a ScheduleError names the rank and action."""
    from megalite.pipeline.verify import verify

    for m in shape.microbatch_counts(cfg.training):
        r = verify(shape.schedule, shape.pp, shape.vpp, m)
        print(f"schedule {shape.schedule} pp={shape.pp} vpp={shape.vpp} m={m} verified: sends "
              f"matched, no deadlock; live activations at peak {max(r.peak_activations)}, "
              f"simulated idle of the first stage {r.idle[0]:.1%}", flush=True)  # fmt: skip
