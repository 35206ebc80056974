"""The layouts that fit a cluster, ranked, and the plan printed for `--dry-run` and tools/plan.py.

The ranking follows the usual logic: the smallest model-parallel size that fits (TP inside a
node first, PP across nodes when one node cannot hold the model), data parallelism for the rest,
the lowest ZeRO stage that fits, then the smaller bubble. The figures come from planner.py.
"""

from dataclasses import replace

from megalite.config import Config
from megalite.errors import MegaliteError
from megalite.shape import derive
from megalite.training.planner import Cluster, GiB, Layout, Plan, _schedule_name, plan


def _valid(cfg: Config, lay: Layout, cluster: Cluster) -> bool:
    """The layout fits the cluster's nodes and passes the checks `validate` makes."""
    if lay.tp > cluster.gpus_per_node:  # TP stays inside a node
        return False
    par = replace(cfg.parallel, vpp=lay.vpp, sequence_parallel=lay.sequence_parallel,
                  pp_schedule=_schedule_name(cfg, lay), **lay.sizes)  # fmt: skip
    try:
        derive(replace(cfg, parallel=par), cluster.gpus)
    except MegaliteError:
        return False
    return True


def search(cfg: Config, cluster: Cluster, limit: int | None = None) -> list[Plan]:
    """Layouts of cluster.gpus that fit, best first, following Narayanan et al. 2021: the
    smallest model-parallel size tp*pp that fits (DP for the rest), TP before PP (TP inside a
    node, PP across nodes), the lowest ZeRO stage that fits (ZeRO-1 moves the bytes ZeRO-0
    moves, so it is chosen as soon as the optimizer state does not fit), then the smaller
    bubble (interleaving) and the lower memory."""
    n = cluster.gpus
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    plans = []
    for tp in divisors:
        for pp in (p for p in divisors if (n // tp) % p == 0):
            dp = n // (tp * pp)
            for vpp in (1, 2) if pp > 1 else (1,):
                for zero in (0, 1, 2) if dp > 1 else (0,):
                    lay = Layout(vpp, zero, sequence_parallel=tp > 1, tp=tp, pp=pp, dp=dp)
                    if _valid(cfg, lay, cluster):
                        p = plan(cfg, lay, cluster, all_stages=False)
                        if p.fits:
                            plans.append(p)

    def key(p: Plan):
        lay = p.layout
        return (lay.tp * lay.pp, lay.zero, -lay.tp, p.bubble, p.memory["total"])

    plans.sort(key=key)
    return plans[:limit] if limit else plans


# ---- printing ------------------------------------------------------------------------------------


def _gib(n: float) -> str:
    """Binary units, as GPU memory is quoted."""
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def format_plan(p: Plan, cluster: Cluster | None = None) -> str:
    lines = [f"layout {p.layout}: {p.microbatches} micro-batches per step, "
             f"bubble (pp-1)/(vpp*m) = {p.bubble:.1%}"]  # fmt: skip
    lines.append(f"  {'per rank':<12}{'params':>11}{'grads':>11}{'optimizer':>11}"
                 f"{'activations':>13}{'total':>11}")  # fmt: skip
    for r, mem in enumerate(p.stages):
        extra = f"  (+{_gib(mem['staged_grads'])} staged)" if mem["staged_grads"] else ""
        cells = [mem[k] for k in ("params", "grads", "optimizer")]
        lines.append(
            f"  {'stage ' + str(r):<12}" + "".join(f"{_gib(c):>11}" for c in cells)
            + f"{_gib(mem['activations']):>13}{_gib(mem['total']):>11}{extra}"
        )  # fmt: skip
    lines.append("  bytes per step: " + ", ".join(f"{k} {_bytes(v)}" for k, v in p.comm.items()))
    if cluster is not None:
        usable = cluster.usable * cluster.gpu_memory_gib
        verdict = "fits" if p.fits else "does NOT fit"
        lines.append(f"  {verdict} in {usable:.1f} GiB usable of {cluster.gpu_memory_gib} GiB")
    return "\n".join(lines)


def format_ranking(plans: list[Plan], cluster: Cluster) -> str:
    head = f"layouts that fit {cluster.gpus} GPUs of {cluster.gpu_memory_gib} GiB "
    head += f"({cluster.gpus_per_node} per node), best first:"
    rows = [head, f"  {'#':>2}  {'layout':<34}  {'memory':>10}  {'bubble':>6}  {'tp bytes':>9}"
                  f"  {'pp bytes':>9}  {'dp bytes':>9}"]  # fmt: skip
    for i, p in enumerate(plans, 1):
        rows.append(
            f"  {i:>2}  {str(p.layout):<34}  {_gib(p.memory['total']):>10}  {p.bubble:>6.1%}  "
            + "  ".join(f"{_bytes(p.comm.get(k, 0)):>9}" for k in ("tp", "pp", "dp"))
        )
    if not plans:
        rows.append(
            "  none: add GPUs, lower --micro-batch-size or use --recompute-granularity full"
        )
    return "\n".join(rows)


def cluster_from_env(world_size: int, gpu_memory_gib=None, gpus_per_node=None) -> Cluster:
    """The cluster a dry run plans for: the local GPU's memory when there is one (no process
    group needed), else 80 GiB; GPUs per node from torchrun's LOCAL_WORLD_SIZE, else 8."""
    import os

    import torch

    if gpu_memory_gib is None:
        gpu_memory_gib = 80.0
        if torch.cuda.is_available():
            gpu_memory_gib = torch.cuda.get_device_properties(0).total_memory / GiB
    if gpus_per_node is None:
        gpus_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", min(world_size, 8)))
    return Cluster(world_size, round(gpu_memory_gib, 1), gpus_per_node)


def print_plan(cfg: Config, shape, cluster: Cluster | None = None, top: int = 8):
    """`pretrain_gpt.py --dry-run`: the plan of the run's shape (`validate`'s), then the best
    layouts for as many GPUs. Needs no process group and no GPU."""
    # the built-in tokenizer's vocabulary is known before it is trained
    vocab = cfg.model.vocab_size or cfg.data.tokenizer_vocab_size
    cfg = replace(cfg, model=replace(cfg.model, vocab_size=vocab))
    cluster = cluster or cluster_from_env(shape.world_size)
    lay = Layout(shape.vpp, cfg.optimizer.zero_stage, shape.sequence_parallel, **dict(shape.sizes))
    print(format_plan(plan(cfg, lay, cluster), cluster))
    print(format_ranking(search(cfg, cluster, top), cluster), flush=True)
