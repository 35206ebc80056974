"""What a real step sends and allocates, against the formulas of docs/planner.md.

One spawn of two gloo ranks runs every case, each on its own groups: tensor parallelism
(ledger bytes of GPTChunk forward/backward plus the optimizer's TP sums, with and without
sequence parallelism, and the activations autograd keeps), data parallelism at ZeRO 0-3
(ledger bytes of the bucket reductions; ZeRO-3's gathers as dp_gather), and the planner's parameter, gradient and optimizer
bytes against DistributedOptimizer's buffers for tp, pp (tied embedding) and dp layouts.
Multi-head latent attention: TP's bytes with an MTP module (with and without sequence
parallelism) and cp's (ring and all-to-all), each equal to traffic.comm_bytes.
"""

import pytest
import torch

from megalite.config import Config, ModelConfig
from megalite.model.env import LayerEnv
from megalite.model.gpt import GPTChunk
from megalite.optim.distributed_optimizer import build_optimizer
from megalite.parallel import comm
from megalite.pipeline.partition import rank_chunks
from megalite.plan import activations, memory, traffic
from megalite.plan.layouts import layout
from megalite.testing import spawn
from tests.unit.test_plan_activations import saved_bytes

L, H, HEADS, S, V, B, M = 2, 16, 2, 8, 40, 2, 2  # layers, hidden, heads, seq, vocab, mbs, m


def config(tp=1, pp=1, dp=1, zero=0, sequence_parallel=False, precision="fp32", cp=1,
           cp_comm_type="p2p", **model) -> Config:  # fmt: skip
    cfg = Config()
    model = {"flavour": "gpt2", **model}
    cfg.model = ModelConfig(num_layers=L, hidden_size=H, num_attention_heads=HEADS, seq_length=S,
                            vocab_size=V, make_vocab_size_divisible_by=8, **model)  # fmt: skip
    p, t, o = cfg.parallel, cfg.training, cfg.optimizer
    p.tp, p.pp, p.dp, p.sequence_parallel, p.cp = tp, pp, dp, sequence_parallel, cp
    p.cp_comm_type = cp_comm_type
    t.micro_batch_size, t.global_batch_size, t.precision, t.kernels = (
        B,
        B * M * dp,
        precision,
        "torch",
    )
    o.zero_stage, o.bucket_size_mb = zero, 0.004  # ~1000 fp32 elements: several padded buckets
    return cfg


def build(cfg: Config):
    from megalite.parallel.groups import build_groups
    from megalite.parallel.topology import Topology

    p = cfg.parallel
    groups = build_groups(Topology(tp=p.tp, pp=p.pp, dp=p.dp, cp=p.cp), torch.device("cpu"))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.training.precision]
    chunks = [
        GPTChunk(
            cfg.model,
            LayerEnv(
                tp=groups.tp,
                sequence_parallel=p.sequence_parallel,
                dtype=dtype,
                cp=groups.cp,
                cp_comm_type=p.cp_comm_type,
            ),
            **kw,
        )
        for kw in rank_chunks(L, p.pp, 1, groups.pp.rank)
    ]
    return groups, chunks, build_optimizer(chunks, groups, cfg)


def data(k):
    g = torch.Generator().manual_seed(k)
    return torch.randint(V, (B, S), generator=g), torch.randint(V, (B, S), generator=g)


def step(groups, chunks, opt, dp_rank=0):
    """One optimizer step of M micro-batches through a whole-model chunk, as the trainer does
    (with cp, this rank's s/cp tokens of each: context_parallel.shard_batch)."""
    from megalite.parallel.context_parallel import shard_batch

    groups.ledger.reset()
    opt.zero_grad(M)
    loss = 0.0
    batch = [data(10 * dp_rank + k) for k in range(M)]
    for x, y, *shard in shard_batch(batch, groups.cp.size, groups.cp.rank):
        out = chunks[0](x, y, **({"shard": shard[0]} if shard else {}))
        (out / M).backward()
        loss += out.item() / M
    replicas = groups.cp if groups.cp.size > 1 else groups.dp  # one of them is 1 here
    comm.all_reduce(torch.tensor([loss], dtype=torch.float64), replicas)  # the trainer's mean
    opt.step(1e-3)
    return dict(groups.ledger.bytes)


def tp_case(sequence_parallel: bool):
    cfg = config(tp=2, sequence_parallel=sequence_parallel)
    shape = layout(cfg, tp=2, sequence_parallel=sequence_parallel)
    groups, chunks, opt = build(cfg)
    got = step(groups, chunks, opt)
    t, e = 2, 4
    bsh = B * S * H * e
    # per micro-batch: 8 (t-1)/t bsh per layer (with SP 10: the fused q/k/v and GeLU's up
    # gather their input again in backward), 2 (t-1)/t bsh for the embedding and for the
    # head, 2 (t-1)/t of 3 b s fp32 values for the vocab-parallel loss (max, then two sums)
    blocks = 10 if sequence_parallel else 8
    per_mb = (
        L * blocks * (t - 1) / t * bsh + 2 * 2 * (t - 1) / t * bsh + 2 * (t - 1) / t * 3 * B * S * 4
    )
    # the optimizer sums sequence-parallel gradients over TP: per layer 2 norms (weight, bias)
    # and the row-parallel biases of out and down; the final norm; the position embedding
    synced = (L * 6 * H + 2 * H + S * H) if sequence_parallel else 0
    expected = M * per_mb + 2 * (t - 1) / t * synced * e
    assert got["tp"] == expected, (sequence_parallel, got["tp"], expected)
    assert got["tp"] == traffic.comm_bytes(cfg, shape, 0, M)["tp"]
    assert got["world"] == 16  # gradient norm and inf flag: 2 float64, all-reduced over 2
    # activations autograd keeps on this TP rank for one micro-batch
    measured = saved_bytes(chunks[0], data(0)[0], data(0)[1])
    kw = rank_chunks(L, 1, 1, 0)[0]
    estimate, _ = activations.chunk_activations(cfg, shape, kw)
    return got["tp"], measured, estimate


MLA = dict(
    flavour="deepseek_v3",
    q_lora_rank=12,
    kv_lora_rank=10,
    qk_nope_head_dim=6,
    qk_rope_head_dim=4,
    v_head_dim=8,
)  # k 10 dims per head, v 8: padded to 10 for cp


def latent_case(cfg: Config):
    """MLA (and an MTP module at tp2): the bytes a step's ledger records per group kind, TP's
    (the MTP module's layer, embedding, logits and loss on the head too) and cp's (each head's
    K and V at the padded dims), equal to the planner's."""
    groups, chunks, opt = build(cfg)
    got = step(groups, chunks, opt)
    p = cfg.parallel
    lay = layout(cfg, tp=p.tp, cp=p.cp, sequence_parallel=p.sequence_parallel)
    want = traffic.comm_bytes(cfg, lay, 0, M)
    kinds = {"tp", "cp"} & set(want)
    assert kinds and {k: got[k] for k in kinds} == {k: want[k] for k in kinds}, (lay, got, want)
    return {k: got[k] for k in kinds}


def dp_case(zero: int, rank: int):
    cfg = config(dp=2, zero=zero)
    groups, chunks, opt = build(cfg)
    got = step(groups, chunks, opt, dp_rank=rank)
    d, sizes = 2, [b.numel for b in opt.buffer.buckets]
    assert all(n % (d * 64) == 0 for n in sizes) and len(sizes) > 2
    loss_mean = 2 * (d - 1) / d * 8
    if zero == 0:  # all-reduce 2(d-1)/d of each fp32 gradient bucket
        expected = sum(2 * (d - 1) / d * n * 4 for n in sizes)
    elif zero == 3:  # a reduce-scatter per micro-batch; each layer gathered before its forward
        expected = sum(M * (d - 1) / d * n * 4 for n in sizes)  # and again before its backward,
        # the outer unit once a step (kept), the first layer in each backward and after the step
        outer, first, *rest = opt.buffer.units
        times = {id(outer): 1, id(first): M + 1}
        gathers = sum(times.get(id(u), 2 * M) * (d - 1) / d * b.numel * 4
                      for u in opt.buffer.units for b in u.buckets)  # fmt: skip
        assert got["dp_gather"] == gathers, (got, gathers)
        assert (
            got["dp_gather"]
            == traffic.comm_bytes(cfg, layout(cfg, dp=2, zero=3), 0, M)["dp_gather"]
        )
    else:  # reduce-scatter (once per micro-batch at ZeRO 2) + all-gather of the parameters
        passes = M if zero == 2 else 1
        expected = sum((passes + 1) * (d - 1) / d * n * 4 for n in sizes)
    assert got["dp"] == expected + loss_mean, (zero, got["dp"], expected)
    assert got["dp"] == traffic.comm_bytes(cfg, layout(cfg, dp=2, zero=zero), 0, M)["dp"]
    return got["dp"]


def memory_case(cfg: Config):
    groups, chunks, opt = build(cfg)
    p = cfg.parallel
    lay = layout(cfg, p.tp, p.pp, p.dp, zero=cfg.optimizer.zero_stage,
                 sequence_parallel=p.sequence_parallel)  # fmt: skip
    mem = memory.state_memory(cfg, lay, groups.pp.rank)
    buf = opt.buffer
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    grads = nbytes(buf.grad_buffer) if buf.grad_buffer is not None else sum(
        nbytes(b.shard_grad) for b in buf.buckets
    )  # fmt: skip
    params = (sum(nbytes(buf.param_shard(b)) for b in buf.buckets) if cfg.optimizer.zero_stage == 3
              else nbytes(buf.param_buffer))  # fmt: skip
    real = {"params": params, "grads": grads, "optimizer": opt.state_bytes()}
    assert {k: mem[k] for k in real} == real, (lay, cfg.training.precision, mem, real)
    return real


def run(rank, world):
    out = {"tp": [tp_case(sequence_parallel) for sequence_parallel in (False, True)]}
    out["dp"] = [dp_case(z, rank) for z in (0, 1, 2, 3)]
    out["mla"] = [
        latent_case(config(tp=2, sequence_parallel=sequence_parallel, mtp_num_layers=1, **MLA))
        for sequence_parallel in (False, True)
    ]
    out["mla"] += [latent_case(config(cp=2, **MLA, cp_comm_type=c)) for c in ("p2p", "a2a")]
    out["memory"] = [
        memory_case(config(tp=2, sequence_parallel=True)),
        memory_case(config(pp=2)),  # tied embedding halves in buckets of their own
        *[memory_case(config(dp=2, zero=z, precision=pr)) for z in (0, 1, 2, 3) for pr in ("fp32", "bf16")],
        memory_case(config(pp=2, dp=1, zero=3)),  # stage 3 at dp=1: tied halves, units per stage
    ]  # fmt: skip
    return out


@pytest.mark.distributed
def test_ledger_and_memory_match_formulas():
    results = spawn(run, 2)
    for _, measured, estimate in results[0]["tp"]:
        assert abs(estimate / measured - 1) < 0.2, (measured, estimate)
    assert results[0]["dp"] == results[1]["dp"]
