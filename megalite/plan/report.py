"""Plans as text: one layout's memory, traffic and bubble (`format_plan`), and the ranking of
the layouts that fit (`format_ranking`), as `--dry-run` and tools/plan.py print them."""

from megalite.parallel.groups import communicators
from megalite.plan.launch import launch_line, preferred
from megalite.plan.layouts import Plan
from megalite.plan.ranking import Cluster, GiB
from megalite.plan.restart import format_estimate, restart_estimate
from megalite.plan.stages import flag_text


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


def format_plan(p: Plan, cluster: Cluster | None = None, step_time: float | None = None) -> str:
    """A plan as --dry-run prints it: memory per stage, bytes per step, ZeRO-3's notes, the
    estimated step time when given, whether it fits the cluster."""
    lines = [f"layout {p.layout}: {p.microbatches} micro-batches per step, "
             f"bubble in theory (first stage idle / compute) = {p.bubble:.1%}"]  # fmt: skip
    lines.append(f"  {'per rank':<12}{'params':>11}{'grads':>11}{'optimizer':>11}"
                 f"{'activations':>13}{'total':>11}")  # fmt: skip
    for r, mem in enumerate(p.stages):
        extra = f"  (+{_gib(mem['staged_grads'])} staged)" if mem["staged_grads"] else ""
        if mem.get("gathered_params"):
            extra += f"  (+{_gib(mem['gathered_params'])} gathered params)"
        if mem.get("buffers"):
            extra += f"  (+{_gib(mem['buffers'])} p2p and backward buffers)"
        cells = [mem[k] for k in ("params", "grads", "optimizer")]
        lines.append(
            f"  {'stage ' + str(r):<12}" + "".join(f"{_gib(c):>11}" for c in cells)
            + f"{_gib(mem['activations']):>13}{_gib(mem['total']):>11}{extra}"
        )  # fmt: skip
    lines.append(
        "  not counted: the allocator's cache and fragmentation, NCCL's buffers, the CUDA "
        "context (docs/planner.md)"
    )
    lines.append("  bytes per step: " + ", ".join(f"{k} {_bytes(v)}" for k, v in p.comm.items()))
    if p.links:  # links.py: where each group's bytes travel
        lines += [line[2:] for line in _link_lines(p)]
    lines += [f"  {note}" for note in p.notes]
    if step_time is not None:
        lines.append(f"  estimated step time {step_time:.3f} s (assumptions below)")
        topo = p.layout.topology()
        n = communicators(topo, topo.world_size - 1)  # the last stage's rank: the embedding too
        lines.append(
            f"  to the first step: each rank creates {n} communicators, made by their members "
            f"alone (no world-wide operation); first step about {step_time:.3f} s; rendezvous, "
            "data index and model build are measured by the run (the metrics file's first "
            "line) or by --dry-run --fake-world"
        )
    if cluster is not None:
        usable = cluster.usable * cluster.gpu_memory_gib
        verdict = "fits" if p.fits else "does NOT fit"
        lines.append(f"  {verdict} in {usable:.1f} GiB usable of {cluster.gpu_memory_gib} GiB")
    return "\n".join(lines)


def format_ranking(
    plans: list[Plan],
    cluster: Cluster,
    misses: list | None = None,
    cfg=None,
    given=None,
    top: int | None = None,
) -> str:
    """The layouts of `search`, fastest first, with the assumptions of the step time; the layout
    to launch (launch.preferred) and, with `cfg`, its launch line; `given`: the plan of the
    layout given on the command line, placed among them; `top`: the rows listed."""
    head = f"layouts that fit {cluster.gpus} GPUs of {cluster.gpu_memory_gib} GiB "
    head += f"({cluster.gpus_per_node} per node), fastest first,"
    speed = f"{cluster.mfu:.0%} MFU" if cluster.mfu else f"each op by its shape on {cluster.gpu}"
    head += f" at {speed}, {cluster.peak_tflops:g} TFLOP/s peak, "
    head += f"{cluster.intra_node_gbps:g}/{cluster.inter_node_gbps:g} GB/s in/across nodes:"
    rows = [head, f"  {'#':>2}  {'layout':<34}  {'mbs':>3}  {'recompute':>9}  {'step (est.)':>11}"
                  f"  {'memory':>10}"
                  f"  {'bubble':>6}  {'tp bytes':>9}  {'pp bytes':>9}  {'dp bytes':>9}"]  # fmt: skip
    for i, p in enumerate(plans[:top], 1):
        rows.append(
            f"  {i:>2}  {str(p.layout):<34}  {p.layout.micro_batch_size:>3}"
            f"  {p.recompute or '':>9}  {p.step_time:>10.3f}s  {_gib(p.memory['total']):>10}"
            f"  {p.bubble:>6.1%}  "
            + "  ".join(f"{_bytes(p.comm.get(k, 0)):>9}" for k in ("tp", "pp", "dp"))
        )
    if plans:
        rows += _chosen(plans, cluster, cfg, given)
    if not plans:
        rows.append(
            "  none: no layout both splits the batch (--global-batch-size, --micro-batch-size) "
            "and fits; change --gpus or the batch, or use --recompute-granularity full"
        )
        if misses:  # search(misses=): the planned layout with the least memory
            m = misses[0]
            usable = cluster.usable * cluster.gpu_memory_gib * GiB
            rows.append(
                f"  nearest: {m.layout} needs {_gib(m.memory['total'])} of {_gib(usable)} usable "
                f"(activations {_gib(m.memory['activations'])}); {launch_flags(m)}"
            )
    return "\n".join(rows)


def launch_flags(p: Plan) -> str:
    """The command-line flags of a plan's layout (Megatron's names, which megalite reads too)."""
    lay = p.layout
    out = f"--tensor-model-parallel-size {lay.tp} --pipeline-model-parallel-size {lay.pp}"
    out += f" --context-parallel-size {lay.cp}" if lay.cp > 1 else ""
    out += f" --num-virtual-stages-per-pipeline-rank {lay.vpp}" if lay.vpp > 1 else ""
    out += " --sequence-parallel" if lay.sequence_parallel else ""
    out += f" --zero-stage {lay.zero.stage} --micro-batch-size {lay.micro_batch_size}"
    out += f" --recompute-granularity {p.recompute}" if p.recompute else ""
    out += f" --dp-replicate {lay.dpr}" if lay.dpr > 1 else ""
    split = flag_text(p.split)
    return out + (f" {split}" if split else "")


def _chosen(plans: list[Plan], cluster: Cluster, cfg, given) -> list[str]:
    """Where the layout given ranks; the layout to launch (launch.preferred: the fastest, or one
    nearly as fast with more memory to spare, the margin said), its flags, its layers per virtual
    stage, its bytes per step over each kind of link (links.py) and, with `cfg`, its launch
    line."""
    usable = cluster.usable * cluster.gpu_memory_gib * GiB
    rows = []
    if given is not None and given.step_time is not None:
        rank = 1 + sum(q.step_time < given.step_time for q in plans)
        rows.append(f"  the layout given ({given.layout}, mbs {given.layout.micro_batch_size}): "
                    f"{given.step_time:.3f} s (est.), "
                    + ("does NOT fit; it would rank" if not given.fits else "ranks")
                    + f" #{rank} of {len(plans)}, {given.step_time / plans[0].step_time - 1:+.1%}"
                    " against the fastest")  # fmt: skip
    p, fastest = preferred(plans, usable)
    if p is fastest:
        free = usable - p.memory["total"]
        rows.append(f"  the fastest, {_gib(free)} of {_gib(usable)} usable to spare: "
                    f"{launch_flags(p)}")  # fmt: skip
    else:
        i = plans.index(p) + 1
        more = fastest.memory["total"] - p.memory["total"]
        rows.append(
            f"  chosen: #{i}, {p.step_time / fastest.step_time - 1:.1%} slower (est.) than the "
            f"fastest ({fastest.layout}) with {_gib(more)} more to spare "
            f"({_gib(usable - p.memory['total'])} of {_gib(usable)} usable, the fastest "
            f"{_gib(usable - fastest.memory['total'])}): {launch_flags(p)}"
        )
    if p.layout.pp > 1:
        counts = p.layout.partition.counts
        rows.append(f"    layers per virtual stage, in pipeline order: {_runs(counts)}")
    rows += _link_lines(p)
    if cfg is not None:
        rows.append("  on a lost node (est., --replication-factor 2, 5 GB/s local disks, 100 GB/s "
                    "of shared storage; plan/restart.py):")  # fmt: skip
        est = restart_estimate(cfg, p.layout, cluster)
        rows += ["    " + line for line in format_estimate(est).splitlines()]
        rows.append(f"  launch ({p.layout}, mbs {p.layout.micro_batch_size}):")
        rows.append("    " + launch_line(cfg, p, cluster.gpus_per_node))
    return rows


def _runs(counts) -> str:
    """Layers per virtual stage with repeats folded: "7 | 8 x 14 | 7"."""
    out, i = [], 0
    while i < len(counts):
        j = i
        while j < len(counts) and counts[j] == counts[i]:
            j += 1
        out.append(str(counts[i]) + (f" x {j - i}" if j - i > 1 else ""))
        i = j
    return " | ".join(out)


def _link_lines(p: Plan) -> list[str]:
    """Bytes per step over NVLink and over the network, with the group kinds on each."""
    rows = []
    for link, name in (("nvlink", "NVLink in a node"), ("network", "network across nodes")):
        kinds = [f"{k} {_bytes(v[link])}" for k, v in p.links.items() if v[link] >= 1]
        total = sum(v[link] for v in p.links.values())
        rows.append(f"    bytes per step over {name}: {_bytes(total)}"
                    + (f" ({', '.join(kinds)})" if kinds else ""))  # fmt: skip
    return rows
