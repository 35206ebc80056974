"""The cluster a plan is for, and the estimated step time the layout search ranks by: the model
FLOPs at an assumed MFU, stretched by the pipeline bubble, plus the communication not hidden
behind compute at the cluster's bandwidths (inside a node: NVLink; across nodes: the network):

- the pipeline moves at its slowest stage's pace: the last, which also runs the output layer;
- every group's bytes go over NVLink inside a node and the network across nodes as links.py
  splits them (ring, all-to-all or p2p; the slower link sets a group's pace);
- TP traffic is on the critical path (exposed whole; TP stays inside a node), and so are the
  experts' all-to-alls (ep) and context parallelism's attention (cp);
- pipeline p2p is hidden in the steady state, exposed on the 2(p-1) hops of warm-up and
  cool-down;
- each gradient reduction the ZeRO stage makes (`ZeroStage.collectives`) runs behind one
  micro-batch's backward: at stages 0/1 the last micro-batch's (the buckets fill only then), at
  stage 2 each one's; the all-gather of the updated shards behind the next step's first forward
  (--overlap-param-gather); ZeRO-3's gathers behind the whole compute. What outlasts its window
  is exposed, and at least a tenth (the last bucket, the first).

A crude model (no GEMM efficiency by shape, no latency, one bandwidth per link kind), but one that orders
layouts by what they cost rather than by memory alone; docs/planner.md checks it against the
layouts of Narayanan et al. 2021, Table 1.
"""

from dataclasses import dataclass

from megalite.config import Config
from megalite.plan import links

GiB = 2**30


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpu_memory_gib: float = 80.0
    gpus_per_node: int = 8
    usable: float = 0.9  # CUDA context, allocator fragmentation, NCCL buffers, temporaries
    # For the estimated step time (ranking.step_time): dense peak per GPU at the training
    # precision (H100/H200 SXM bf16), the MFU the compute reaches, and the bus bandwidth per GPU
    # inside a node (NVLink) and across nodes (InfiniBand, 200 Gb/s per GPU), in GB/s.
    peak_tflops: float = 989.0
    mfu: float = 0.45
    intra_node_gbps: float = 300.0
    inter_node_gbps: float = 25.0


def step_time(cfg: Config, p, cluster: Cluster, flops_per_token: float) -> float:
    """Estimated seconds per step of a plan (layouts.Plan) on the cluster (module docstring);
    `flops_per_token`: the model's hardware FLOPs per token (training/flops.py)."""
    m, t, lay = cfg.model, cfg.training, p.layout
    tokens = t.global_batch_size * m.seq_length
    flops = flops_per_token * tokens / cluster.gpus
    compute = flops / (cluster.peak_tflops * 1e12 * cluster.mfu)
    node = cluster.gpus_per_node
    bw = cluster.intra_node_gbps, cluster.inter_node_gbps
    lay_links = p.links or links.link_bytes(lay, p.comm, node, cfg.parallel.cp_comm_type)

    def seconds(*kinds: str) -> float:  # the group kinds' bytes per step over their links
        return sum(links.seconds(lay_links[k], *bw) for k in kinds if k in lay_links)

    e = 2 if t.precision in ("bf16", "fp16") else 4
    sp = lay.sequence_parallel
    message = t.micro_batch_size * m.seq_length * m.hidden_size * e / (lay.tp if sp else 1)
    tp = seconds("tp")
    hop = links.split(2 * (lay.pp - 1) * message, links.group_ranks(lay, "pp"), node, links.P2P)
    pp = links.seconds(hop, *bw)
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
    reduce = dp * grads / (grads + params) / rounds
    exposed = rounds * _exposed(reduce, 2 / 3 * per_mb)
    window = per_mb / 3 if cfg.optimizer.overlap_param_gather else 0.0
    exposed += _exposed(dp * params / (grads + params), window)
    # ZeRO-3's parameter gathers run behind every micro-batch's compute
    exposed += _exposed(seconds("dp_gather"), compute)
    embed = seconds("embed", "world")
    # context parallelism: attention's bytes and (at dp=1) the gradients' over cp, not overlapped
    cp = seconds("cp")
    # the last stage also runs the output layer and the MTP modules (their logits and layers):
    # the pipeline moves at its pace (their share of the FLOPs as training/flops.py counts it,
    # recomputed under full; an MTP module's layer at an average layer's share of the rest)
    vocab, d = m.vocab_size or 0, m.mtp_num_layers
    head = (8 if t.recompute == "full" else 6) * (1 + d) * vocab * m.hidden_size / flops_per_token
    head += d * (1 - head) / (m.num_layers + d)
    slowest = 1 + head * (lay.pp - 1)
    return compute * slowest * (1 + p.bubble) + tp + pp + cp + ep + embed + exposed


def _exposed(seconds: float, behind: float) -> float:
    """What of a transfer of `seconds` shows next to `behind` seconds of compute it overlaps:
    what outlasts it, and at least a tenth (the last bucket of a backward, the first of a
    forward)."""
    return max(0.1 * seconds, seconds - behind)
