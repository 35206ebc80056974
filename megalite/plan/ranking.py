"""The cluster a plan is for, and the estimated step time the layout search ranks by: the compute
timed op by op by its shape (compute.py; or the FLOPs at a flat `Cluster.mfu`), stretched by the
pipeline bubble, the optimizer step, plus the communication not hidden behind compute at the
cluster's bandwidths (inside a node: NVLink; across nodes: the network):

- the pipeline moves at its busiest rank's pace: its layers, and the output layer (and MTP
  modules) where it holds them (stages.py; an uneven split evens them out);
- every group's bytes go over NVLink inside a node and the network across nodes as links.py
  splits them (ring, all-to-all or p2p; the slower link sets a group's pace);
- TP traffic is on the critical path (TP stays inside a node) but for what runs behind a
  matmul (`_tp_exposed`): with SP each fused block's backward re-gather of its input and
  reduce-scatter of its input gradient, and with --tp-comm-overlap all but one chunk of the
  other collectives of the fused and row-parallel layers; never more than the busiest rank's
  compute. Exposed whole: the experts' all-to-alls (ep) and context parallelism's attention (cp);
- pipeline p2p is hidden in the steady state, exposed on the hops of warm-up and cool-down:
  2(p-1), or 2(pv-1) interleaved (every boundary between virtual stages on two ranks);
- each gradient reduction the ZeRO stage makes (`ZeroStage.collectives`) runs behind one
  micro-batch's backward: at stages 0/1 the last micro-batch's (the buckets fill only then),
  at stage 2 each one's; the all-gather of the updated shards behind the next step's first
  forward (--overlap-param-gather); ZeRO-3's gathers behind the whole compute. A bucket never
  spans two chunks: an interleaved rank reduces each chunk's buckets once its last backward
  starts, behind the backwards that follow, and needs each chunk's gathered shards by the end
  of its first forward, after the forwards that precede (`chunk_windows`). What outlasts its
  window is exposed, and at least a tenth (the last bucket, the first). Each bucket's ring adds
  its n - 1 steps of latency (the slowest hop's).

A simple model (each link kind one latency per algorithm step and one asymptotic bus bandwidth:
links.seconds, the steps from each kind's message size, traffic.latency_steps), but one that orders
layouts by what they cost rather than by memory alone;
docs/planner.md calibrates it on Megatron-LM's README table and checks it against Llama 3 405B
and Narayanan et al. 2021, Table 1 (published.py).
"""

import math
from dataclasses import dataclass
from functools import lru_cache

from megalite.config import Config
from megalite.pipeline.actions import B, F, I, W, compute_seconds
from megalite.pipeline.schedules import bubble_theory, schedule
from megalite.plan import compute as by_shape
from megalite.plan import links, stages
from megalite.plan.activations import schedule_steps
from megalite.plan.memory import fused_blocks
from megalite.plan.traffic import latency_steps

GiB = 2**30


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpu_memory_gib: float = 80.0
    gpus_per_node: int = 8
    usable: float = 0.9  # CUDA context, allocator fragmentation, NCCL buffers, temporaries
    # For the estimated step time (ranking.step_time): dense peak per GPU at the training
    # precision (H100/H200 SXM bf16), a flat MFU if given (else compute.py times each op on
    # `gpu`), and the bandwidth per GPU and
    # direction inside a node (NVLink 4: 450 GB/s) and across nodes (a 400 Gb/s NIC per GPU,
    # InfiniBand NDR or RoCE: 50 GB/s), in GB/s: an H100 SXM node as DGX H100 builds it. An A100
    # node: 312 TFLOP/s, 300 GB/s (NVLink 3) and 25 GB/s (200 Gb/s HDR).
    peak_tflops: float = 989.0
    mfu: float | None = None  # a flat MFU instead of compute.py's time by shape
    gpu: str = "h100"  # compute.GPUS: its bandwidth, SMs and best GEMM throughput
    intra_node_gbps: float = 450.0
    inter_node_gbps: float = 50.0
    # A ring collective's step waits for its slowest hop: about a microsecond over NVLink, a few
    # across nodes (NCCL's ring, InfiniBand/RoCE): n - 1 steps per reduce-scatter or all-gather.
    intra_node_latency_us: float = 1.0
    inter_node_latency_us: float = 5.0


def step_time(cfg: Config, p, cluster: Cluster, flops_per_token: float) -> float:
    """Estimated seconds per step of a plan (layouts.Plan) on the cluster (module docstring);
    `flops_per_token`: the model's hardware FLOPs per token (training/flops.py)."""
    return sum(step_parts(cfg, p, cluster, flops_per_token).values())


def compute_bound(cfg: Config, shape, cluster: Cluster, flops_per_token: float) -> float:
    """A lower bound of a layout's step time: the busiest rank's compute stretched by the
    bubble, no communication (the search skips what cannot come near its fastest)."""
    m, t = cfg.model, cfg.training
    if cluster.mfu:
        flops = flops_per_token * t.global_batch_size * m.seq_length / cluster.gpus
        compute = flops / (cluster.peak_tflops * 1e12 * cluster.mfu)
    else:
        compute = shape.microbatches * by_shape.microbatch_seconds(cfg, shape, cluster) / shape.pp
    slowest = stages.slowest(shape.partition, *stages.shares(cfg, flops_per_token))
    bubble = bubble_theory(shape.pp, shape.vpp, shape.microbatches, shape.schedule)
    return compute * slowest * (1 + bubble)


def step_parts(cfg: Config, p, cluster: Cluster, flops_per_token: float) -> dict:
    """The step time's terms, in seconds: compute (the busiest rank's, stretched by the bubble)
    and what each group's communication adds (exposed)."""
    m, t, lay = cfg.model, cfg.training, p.layout
    tokens = t.global_batch_size * m.seq_length
    flops = flops_per_token * tokens / cluster.gpus
    if cluster.mfu:  # the average rank's compute: the FLOPs at a flat MFU
        compute, optimizer = flops / (cluster.peak_tflops * 1e12 * cluster.mfu), 0.0
    else:  # or each op by its shape (compute.py), its micro-batches over the pp ranks
        compute = p.microbatches * by_shape.microbatch_seconds(cfg, lay, cluster) / lay.pp
        optimizer = by_shape.optimizer_seconds(p.memory["optimizer"], cluster)
    node = cluster.gpus_per_node
    lay_links = p.links or links.link_bytes(lay, p.comm, node, cfg.parallel.cp_comm_type)
    n_steps = latency_steps(cfg, lay, p.comm, p.microbatches)  # from each kind's message size
    if p.comm.get("dpr"):  # --dp-replicate: each bucket's shard all-reduced over the copies
        n_steps["dpr"] = links.steps("all_reduce", lay.dpr) * p.buckets
    if p.comm.get("embed"):  # the tied embedding's all-reduce over 2 ranks
        n_steps["embed"] = links.steps("all_reduce", 2)
    if p.comm.get("world"):  # the status all-reduce: a few floats, NCCL's tree (2 log2 n steps)
        n_steps["world"] = 2 * math.ceil(math.log2(lay.world_size))

    def seconds(*kinds: str) -> float:  # the group kinds' bytes per step over their links
        return sum(links.seconds(lay_links[k], cluster, n_steps.get(k, 0.0))
                   for k in kinds if k in lay_links)  # fmt: skip

    e = 2 if t.precision in ("bf16", "fp16") else 4
    b, s, h = lay.hidden_shape  # what a stage sends: (b, s/cp, h), /tp with SP
    message = b * s * h * e
    # the first micro-batch's forward and the last one's backward cross every boundary between
    # virtual stages on different ranks: p - 1 each way, p·v - 1 interleaved (less a V's turn)
    part = lay.partition
    hops = sum(part.stage_of(v)[0] != part.stage_of(v + 1)[0] for v in range(lay.pp * lay.vpp - 1))
    hop = links.split(2 * hops * message, links.group_ranks(lay, "pp"), node, links.P2P)
    pp = links.seconds(hop, cluster, 2 * hops)
    # experts: the dispatch's all-to-alls are on the critical path (exposed whole)
    ep = seconds("ep", "ep_sizes")
    dp = seconds("dp", "cp+dp", "edp")
    # the ZeRO stage's gradient reductions (each behind the backward of one micro-batch: the
    # last one's, or every one's where each micro-batch is reduced) and parameter all-gather
    # (behind the next step's first forward)
    calls = lay.zero.collectives(p.microbatches, "step")  # ZeRO-3's gathers: dp_gather below
    rounds = calls.get("all_reduce", 0) + calls.get("reduce_scatter", 0)
    grads = (2 * calls.get("all_reduce", 0) + calls.get("reduce_scatter", 0)) * (4 if e == 2 else e)
    params = calls.get("all_gather", 0) * e
    per_mb = compute / p.microbatches
    # each bucket's ring takes n - 1 steps per reduce-scatter or all-gather (an all-reduce 2):
    # at 16,384 GPUs a 25 MB bucket's ring over 1,024 replicas is latency-bound
    step = _ring_step(lay, cluster) * p.buckets
    reduce = dp * grads / (grads + params) / rounds + step * (2 if "all_reduce" in calls else 1)
    forward, backward = chunk_windows(lay.schedule, lay.pp, lay.vpp, p.microbatches)
    unit = per_mb / (3 * lay.vpp)  # one chunk's forward of one micro-batch
    if rounds == 1:  # once a step: each chunk's buckets behind the rest of the step's backward
        exposed = _queued(reduce, [w * unit for w in backward])
    else:
        exposed = rounds * _exposed(reduce, 2 / 3 * per_mb)
    gather = dp * params / (grads + params) + step * calls.get("all_gather", 0)
    if cfg.optimizer.overlap_param_gather:  # chunk by chunk, each by the end of its first forward
        exposed += _queued(gather, [w * unit for w in forward])
    else:
        exposed += gather
    # ZeRO-3's parameter gathers run behind every micro-batch's compute
    exposed += _exposed(seconds("dp_gather"), compute)
    # --dp-replicate: each reduced shard all-reduced over its copies once, after the backward
    exposed += seconds("dpr")
    embed = seconds("embed", "world")
    # context parallelism: attention's bytes and (at dp=1) the gradients' over cp, not overlapped
    cp = seconds("cp")
    # the pipeline moves at its busiest rank's pace: its layers, and the output layer and the MTP
    # modules where it holds them (stages.py: their share of the FLOPs, recomputed under full)
    slowest = stages.slowest(lay.partition, *stages.shares(cfg, flops_per_token))
    tp = _tp_exposed(cfg, lay, seconds("tp"), compute * slowest)
    return {"compute": compute * slowest, "bubble": compute * slowest * p.bubble,
            "optimizer": optimizer, "tp": tp,
            "pp": pp, "cp": cp, "ep": ep, "embed": embed, "dp": exposed}  # fmt: skip


def _tp_exposed(cfg: Config, lay, seconds: float, compute: float) -> float:
    """The seconds of the TP traffic's `seconds` on the critical path, next to the busiest
    rank's `compute`. Counted in a dense layer's collectives with SP (traffic.comm_bytes): 8 + n,
    n its fused blocks (memory.fused_blocks: each gathers its input again in backward), 12 + n
    under full recompute (the forward's 4 again). Hidden: each fused block's backward re-gather
    (behind the input gradient's matmul) and reduce-scatter of its input gradient (behind the
    weight gradient's), 2n; with --tp-comm-overlap, all but one of the tp chunks along the
    sequence of the forward all-gather into each fused block, the forward reduce-scatter out
    of both row-parallel layers and the backward all-gather of their output gradient (the
    forward ones twice under full recompute), each chunk's transfer behind another chunk's
    matmul. Exposed whole: an unfused column block's all-gather and reduce-scatter (MLA's
    projections), the embedding's and the head's; MoE layers are
    counted as dense ones, the head's bytes as a layer's. Nothing hidden without SP or with
    FP8 (its fused layers keep the gathered input; their chunking is not modelled). What is
    hidden cannot outlast the compute it runs behind: at least `seconds - compute` shows."""
    n = fused_blocks(cfg.model)
    if not lay.sequence_parallel or lay.tp == 1 or cfg.training.fp8_format is not None:
        return seconds
    full = cfg.training.recompute == "full"
    total = (12 if full else 8) + n
    hidden = 2 * n
    if cfg.parallel.tp_comm_overlap:
        chunked = (n + 4) + (n + 2 if full else 0)
        hidden += chunked * (1 - 1 / lay.tp)
    return max(seconds * (1 - hidden / total), seconds - compute)


def _queued(seconds: float, windows: list) -> float:
    """What shows of a transfer of `seconds` made of one equal share per chunk, the shares sent
    one after another on one communicator, each with the window of compute it may take
    (`windows`, ascending: the first sent has the smallest). The queue's worst overrun is
    exposed, and at least a tenth (the last bucket of a backward, the first of a forward)."""
    share, queued, worst = seconds / len(windows), 0.0, 0.0
    for window in windows:
        queued += share
        worst = max(worst, queued - window)
    return max(0.1 * seconds, worst)


@lru_cache(maxsize=4096)
def chunk_windows(name: str, pp: int, vpp: int, microbatches: int) -> tuple:
    """(forward, backward): per chunk of pipeline rank 0 (the first virtual stage's, whose
    backward ends the step), ascending, in units of one chunk's forward of one micro-batch (the
    schedule's costs: F 1, B 2, I and W 1). Forward: the rank's compute from the start of the
    step to the end of the chunk's first forward (its gathered parameters needed by then, the
    shares gathered in forward order). Backward: from the start of the chunk's last backward
    (B, or W of a split backward: its weight gradients) to the end of the rank's actions (its
    buckets reduced behind them, a bucket never spanning two chunks; the latest launched has
    the smallest). The rank's compute only: the same as the timed schedule's
    (`timed.compute_times`) for 1F1B and interleaved, shorter where another rank ends the step
    (zbv). Interleaved 1F1B: chunk c has c pp + 1 and 2 (c pp + 1); one chunk: 1 and 2."""
    sched = schedule(name)
    costs = []  # (chunk, kind, seconds) of each compute
    for kind, chunk, _ in schedule_steps(name, pp, vpp, microbatches, 0):
        if kind in (F, B, I, W):
            v = sched.placement(pp, vpp, 0, chunk)
            costs.append((chunk, kind, compute_seconds(kind, v, sched.cost)))
    forward, backward = {}, {}
    for out, kinds, order in ((forward, (F,), costs), (backward, (B, W), costs[::-1])):
        elapsed = 0.0
        for chunk, kind, seconds in order:
            if kind in kinds and chunk not in out:
                out[chunk] = elapsed + seconds
            elapsed += seconds
    return tuple(sorted(forward.values())), tuple(sorted(backward.values()))


def _ring_step(lay, cluster: Cluster) -> float:
    """Seconds of latency one ring collective over the replicas (dp, or cp·dp) adds: its n - 1
    steps, each at the latency of the slowest link the ring crosses."""
    ranks = links.group_ranks(lay, "dp_gather")
    across = len({r // cluster.gpus_per_node for r in ranks}) > 1
    return links.steps("all_gather", len(ranks)) * links.latency({"network": across}, cluster)


def _exposed(seconds: float, behind: float) -> float:
    """What of a transfer of `seconds` shows next to `behind` seconds of compute it overlaps:
    what outlasts it, and at least a tenth (the last bucket of a backward, the first of a
    forward)."""
    return _queued(seconds, [behind])
