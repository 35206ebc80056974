"""The layouts that fit a cluster, ranked by estimated step time, and the plan printed for
`--dry-run` and tools/plan.py. The memory and traffic come from planner.py; the step time is
estimated here: the model FLOPs at an assumed MFU, stretched by the pipeline bubble, plus the
communication not hidden behind compute at the cluster's bandwidths (inside a node: NVLink;
across nodes: the network):

- TP traffic is on the critical path (exposed whole; TP stays inside a node);
- pipeline p2p is hidden in the steady state, exposed on the 2(p-1) hops of warm-up and
  cool-down;
- data-parallel reductions and parameter gathers overlap compute (backward, and with
  --overlap-param-gather the next forward), except a tenth of them (the last bucket of
  backward, the first of the forward) and whatever lasts longer than the compute.

A crude model, but one that orders layouts by what they cost rather than by memory alone
(ZeRO-2 moving m times the data-parallel bytes of ZeRO-1 no longer wins because it fits).
"""

from dataclasses import replace

from megalite.config import Config
from megalite.errors import MegaliteError
from megalite.shape import derive
from megalite.training.flops import hardware_flops_per_token
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
    # cp stays as given: it sets how many tokens of a sequence a rank holds, the user's choice
    cp = cfg.parallel.cp
    n = cluster.gpus // cp if cluster.gpus % cp == 0 else 0
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    plans = []
    for tp in divisors:
        for pp in (p for p in divisors if (n // tp) % p == 0):
            dp = n // (tp * pp)
            for vpp in (1, 2) if pp > 1 else (1,):
                # ZeRO-3 is planned when asked for (plan()), not searched: it trades traffic
                # for memory, and the rules above would place it before pipelining
                for zero in (0, 1, 2) if dp > 1 else (0,):
                    lay = Layout(vpp, zero, sequence_parallel=tp > 1, tp=tp, pp=pp, dp=dp,
                                 **({"cp": cp} if cp > 1 else {}))  # fmt: skip
                    if _valid(cfg, lay, cluster):
                        p = plan(cfg, lay, cluster, all_stages=False)
                        if p.fits:
                            p.step_time = step_time(cfg, p, cluster)
                            plans.append(p)
    plans.sort(key=lambda p: (p.step_time, sum(p.comm.values()), p.memory["total"]))
    return plans[:limit] if limit else plans


def step_time(cfg: Config, p: Plan, cluster: Cluster) -> float:
    """Estimated seconds per step of a plan on the cluster (module docstring)."""
    m, t, lay = cfg.model, cfg.training, p.layout
    tokens = t.global_batch_size * m.seq_length
    flops = hardware_flops_per_token(m, t.recompute) * tokens / cluster.gpus
    compute = flops / (cluster.peak_tflops * 1e12 * cluster.mfu)
    node = cluster.gpus_per_node

    def seconds(nbytes: float, span: int) -> float:  # span: ranks from a group's first to last
        gbps = cluster.intra_node_gbps if span <= node else cluster.inter_node_gbps
        return nbytes / (gbps * 1e9)

    e = 2 if t.precision in ("bf16", "fp16") else 4
    sp = lay.sequence_parallel and lay.tp > 1
    message = t.micro_batch_size * m.seq_length * m.hidden_size * e / (lay.tp if sp else 1)
    tp = seconds(p.comm.get("tp", 0), lay.tp)
    pp = seconds(2 * (lay.pp - 1) * message, cluster.gpus)
    dp_bytes = p.comm.get("dp", 0) + p.comm.get("dp_gather", 0) + p.comm.get("embed", 0)
    cp = lay.sizes.get("cp", 1)
    dp_bytes += p.comm.get("cp+dp", 0)
    dp = seconds(dp_bytes, lay.tp * lay.dp * cp)
    # context parallelism: attention's bytes and (at dp=1) the gradients' over cp, not overlapped
    cp = seconds(p.comm.get("cp", 0), lay.tp * cp)
    return compute * (1 + p.bubble) + tp + pp + cp + 0.1 * dp + max(0.0, 0.9 * dp - compute)


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


def format_plan(p: Plan, cluster: Cluster | None = None, cfg: Config | None = None) -> str:
    lines = [f"layout {p.layout}: {p.microbatches} micro-batches per step, "
             f"bubble in theory (first stage idle / compute) = {p.bubble:.1%}"]  # fmt: skip
    lines.append(f"  {'per rank':<12}{'params':>11}{'grads':>11}{'optimizer':>11}"
                 f"{'activations':>13}{'total':>11}")  # fmt: skip
    for r, mem in enumerate(p.stages):
        extra = f"  (+{_gib(mem['staged_grads'])} staged)" if mem["staged_grads"] else ""
        if mem.get("gathered_params"):
            extra += f"  (+{_gib(mem['gathered_params'])} gathered params)"
        cells = [mem[k] for k in ("params", "grads", "optimizer")]
        lines.append(
            f"  {'stage ' + str(r):<12}" + "".join(f"{_gib(c):>11}" for c in cells)
            + f"{_gib(mem['activations']):>13}{_gib(mem['total']):>11}{extra}"
        )  # fmt: skip
    lines.append("  bytes per step: " + ", ".join(f"{k} {_bytes(v)}" for k, v in p.comm.items()))
    lines += [f"  {note}" for note in p.notes]
    if cluster is not None and cfg is not None:
        lines.append(
            f"  estimated step time {step_time(cfg, p, cluster):.3f} s (assumptions below)"
        )
    if cluster is not None:
        usable = cluster.usable * cluster.gpu_memory_gib
        verdict = "fits" if p.fits else "does NOT fit"
        lines.append(f"  {verdict} in {usable:.1f} GiB usable of {cluster.gpu_memory_gib} GiB")
    return "\n".join(lines)


def format_ranking(plans: list[Plan], cluster: Cluster) -> str:
    head = f"layouts that fit {cluster.gpus} GPUs of {cluster.gpu_memory_gib} GiB "
    head += f"({cluster.gpus_per_node} per node), fastest first,"
    head += f" at {cluster.mfu:.0%} MFU of {cluster.peak_tflops:g} TFLOP/s, "
    head += f"{cluster.intra_node_gbps:g}/{cluster.inter_node_gbps:g} GB/s in/across nodes:"
    rows = [head, f"  {'#':>2}  {'layout':<34}  {'step (est.)':>11}  {'memory':>10}  {'bubble':>6}"
                  f"  {'tp bytes':>9}  {'pp bytes':>9}  {'dp bytes':>9}"]  # fmt: skip
    for i, p in enumerate(plans, 1):
        rows.append(
            f"  {i:>2}  {str(p.layout):<34}  {p.step_time:>10.3f}s  {_gib(p.memory['total']):>10}"
            f"  {p.bubble:>6.1%}  "
            + "  ".join(f"{_bytes(p.comm.get(k, 0)):>9}" for k in ("tp", "pp", "dp"))
        )
    if not plans:
        rows.append(
            "  none: add GPUs, lower --micro-batch-size or use --recompute-granularity full"
        )
    return "\n".join(rows)


def cluster_from_env(world_size: int, precision: str = "bf16") -> Cluster:
    """The cluster a dry run plans for: the local GPU's memory and peak when there is one (no
    process group needed), else an 80 GiB H100's; GPUs per node from torchrun's
    LOCAL_WORLD_SIZE, else 8."""
    import os

    import torch

    from megalite.training.flops import peak_flops

    memory, peak = 80.0, Cluster(1).peak_tflops
    if torch.cuda.is_available():
        memory = torch.cuda.get_device_properties(0).total_memory / GiB
        peak = (peak_flops(torch.cuda.get_device_name(0), precision) or peak * 1e12) / 1e12
    node = int(os.environ.get("LOCAL_WORLD_SIZE", min(world_size, 8)))
    return Cluster(world_size, round(memory, 1), node, peak_tflops=peak)


def print_plan(cfg: Config, shape, cluster: Cluster | None = None, top: int = 8):
    """`pretrain_gpt.py --dry-run`: the plan of the run's shape (`validate`'s), then the best
    layouts for as many GPUs. Needs no process group and no GPU."""
    # the built-in tokenizer's vocabulary is known before it is trained
    vocab = cfg.model.vocab_size or cfg.data.tokenizer_vocab_size
    cfg = replace(cfg, model=replace(cfg.model, vocab_size=vocab))
    cluster = cluster or cluster_from_env(shape.world_size, cfg.training.precision)
    lay = Layout(shape.vpp, cfg.optimizer.zero_stage, shape.sequence_parallel, **dict(shape.sizes))
    print(format_plan(plan(cfg, lay, cluster), cluster, cfg))
    print(format_ranking(search(cfg, cluster, top), cluster), flush=True)
