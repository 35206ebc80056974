"""The planner against megalite itself (parameters, buffers, saved activations) and its
recommendations for a few fixed cases."""

import pytest
import torch

from megalite.config import Config, ModelConfig
from megalite.model.gpt import GPTChunk
from megalite.optim.distributed_optimizer import DistributedOptimizer
from megalite.parallel.comm import Group
from megalite.parallel.groups import single_process_groups
from megalite.parallel.specs import spec_of
from megalite.pipeline.partition import rank_chunks
from megalite.shape import validate
from megalite.training import layouts, memory, planner
from megalite.training.planner import Cluster, Layout


def tiny(flavour="gpt2", layers=2, **kw) -> Config:
    cfg = Config()
    cfg.model = ModelConfig(flavour=flavour, num_layers=layers, hidden_size=64,
                            num_attention_heads=4, seq_length=64, vocab_size=500,
                            make_vocab_size_divisible_by=8, **kw)  # fmt: skip
    cfg.training.micro_batch_size, cfg.training.kernels = 2, "torch"
    return cfg


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
@pytest.mark.parametrize("tp, sp", [(1, False), (2, False), (2, True), (4, True)])
def test_parameters_are_gpt_chunks(flavour, tp, sp):
    """Names, sizes and the TP gradient sum in registration order, the first and the last
    stage (the planner expands one meta-device layer to many)."""
    m = tiny(flavour, layers=4, num_query_groups=2 if flavour == "llama" else None).model
    group = Group("tp", list(range(tp)), tp - 1)  # building a chunk needs no process group
    for kw in rank_chunks(4, 2, 1, 0) + rank_chunks(4, 2, 1, 1):
        chunk = GPTChunk(m, group, sequence_parallel=sp, **kw)
        real = [(n, p.numel(), "tp" in spec_of(p).grad_sum)
                for n, p in chunk.named_parameters()]  # fmt: skip
        assert memory.chunk_params(m, tp, **kw, sp=sp) == real


def saved_bytes(chunk, x, labels) -> int:
    """Bytes of the tensors autograd keeps for backward in one forward, each storage once,
    parameters and buffers left out."""
    skip = {t.untyped_storage().data_ptr() for t in [*chunk.parameters(), *chunk.buffers()]}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunk(x, labels)
    return sum(seen.values())


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_activations_match_saved_tensors(flavour):
    """One micro-batch through a first (embedding) and a middle chunk, fp32 on CPU: the
    planner's estimate against the bytes autograd saves (the contract: within 20%)."""
    cfg = tiny(flavour)
    b, s, h = 2, 64, 64
    for kw in ({"layers": range(2), "has_embedding": True, "has_head": True},
               {"layers": range(2), "has_embedding": False, "has_head": False}):  # fmt: skip
        chunk = GPTChunk(cfg.model, **kw)
        x = torch.randint(500, (b, s)) if kw["has_embedding"] else torch.randn(b, s, h)
        measured = saved_bytes(chunk, x.requires_grad_(x.is_floating_point()),
                               torch.randint(500, (b, s)))  # fmt: skip
        estimate, _ = memory.chunk_activations(cfg, Layout(), kw)
        assert abs(estimate / measured - 1) < 0.2, (kw, estimate, measured)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_buffers_one_process(precision):
    """Parameters, gradients and optimizer state: exactly what DistributedOptimizer allocates
    (small buckets, so several are cut and padded). Sharded layouts: tests/distributed."""
    cfg = tiny("gpt2", layers=3)
    cfg.training.precision, cfg.optimizer.bucket_size_mb = precision, 0.05
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    opt = DistributedOptimizer([GPTChunk(cfg.model, dtype=dtype)], single_process_groups(), cfg)
    mem = memory.state_memory(cfg, Layout(), 0)
    buf = opt.buffer
    assert len(buf.buckets) == len(memory.buckets(cfg, Layout(), 0)) > 2
    assert mem["params"] == buf.param_buffer.numel() * buf.param_buffer.element_size()
    assert mem["grads"] == buf.grad_buffer.numel() * buf.grad_buffer.element_size()
    assert mem["optimizer"] == opt.state_bytes()


def test_interleaving_penalty():
    """Rank 0 keeps pp*vpp + pp - 1 chunks in flight: L (1 + (pp-1)/(pp vpp)) layers' worth
    (Korthikanti et al. 2022, section 4.2.3)."""
    cfg = tiny("gpt2", layers=8)
    cfg.training.global_batch_size = 16  # 8 micro-batches of 2
    lay = Layout(pp=2, vpp=2)
    per_chunk, _ = memory.chunk_activations(cfg, lay, rank_chunks(8, 2, 2, 0)[1])  # no embedding
    first, _ = memory.chunk_activations(cfg, lay, rank_chunks(8, 2, 2, 0)[0])
    # rank 0 runs F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 ...: after F3.0 five chunk activations
    # are alive (micro-batches 0-3 of chunk 0, 1 of chunk 1): 10 of the 8 layers' worth
    assert planner.peak_activations(cfg, lay, 0, 8) == 4 * first + per_chunk
    one_f_one_b = planner.peak_activations(cfg, Layout(pp=2), 0, 8)
    assert (
        one_f_one_b
        == 2 * memory.chunk_activations(cfg, Layout(pp=2), rank_chunks(8, 2, 1, 0)[0])[0]
    )


def big(flavour, layers, hidden, heads, seq, vocab, mbs, gbs, precision="bf16", recompute="none"):
    cfg = Config()
    cfg.model = ModelConfig(flavour=flavour, num_layers=layers, hidden_size=hidden,
                            num_attention_heads=heads, seq_length=seq, vocab_size=vocab)  # fmt: skip
    t = cfg.training
    t.micro_batch_size, t.global_batch_size, t.precision, t.recompute = (
        mbs,
        gbs,
        precision,
        recompute,
    )
    return cfg


def test_fits_one_gpu_gives_pure_dp():
    cfg = big("gpt2", 12, 768, 12, 1024, 50257, mbs=4, gbs=256)  # GPT-2 124M
    plans = layouts.search(cfg, Cluster(gpus=8, gpu_memory_gib=80))
    best = plans[0].layout
    assert (best.tp, best.pp, best.dp) == (1, 1, 8) and best.zero < 2
    # ZeRO-2 fits with the least memory but reduce-scatters every micro-batch: it ranks below
    zero2 = next(p for p in plans if p.layout == Layout(dp=8, zero=2))
    assert zero2.comm["dp"] > 4 * plans[0].comm["dp"] and zero2.step_time > plans[0].step_time


def test_too_big_for_a_node_gives_pp_across_nodes():
    cfg = big("gpt2", 96, 12288, 96, 2048, 51200, mbs=1, gbs=64, recompute="full")  # GPT-3
    cluster = Cluster(gpus=64, gpu_memory_gib=80, gpus_per_node=8)
    plans = layouts.search(cfg, cluster)
    best = plans[0].layout
    assert best.tp <= 8 and best.pp >= 2 and best.tp * best.pp > 8  # TP in a node, PP across
    # nothing fits inside one node: no plan with tp * pp <= 8
    assert all(p.layout.tp * p.layout.pp > 8 for p in plans)


def test_optimizer_state_dominates_gives_zero():
    # ~3B parameters: bf16 weights 6 GB + fp32 gradients 12 GB fit a 40 GB GPU, the 36 GB of
    # fp32 Adam state and masters do not; sharded over 8 ranks they do
    cfg = big("llama", 26, 3200, 32, 1024, 32000, mbs=1, gbs=64)
    best = layouts.search(cfg, Cluster(gpus=8, gpu_memory_gib=40))[0]
    assert (best.layout.tp, best.layout.pp, best.layout.zero) == (1, 1, 1)
    zero0 = planner.plan(cfg, Layout(dp=8), Cluster(gpus=8, gpu_memory_gib=40))
    assert (
        not zero0.fits
        and zero0.memory["optimizer"] > zero0.memory["params"] + zero0.memory["grads"]
    )


def test_print_plan_needs_no_process_group(capsys):
    cfg = big("gpt2", 12, 768, 12, 1024, 50257, mbs=4, gbs=256)
    cfg.parallel.dp = 8
    layouts.print_plan(cfg, validate(cfg, 8), Cluster(gpus=8, gpu_memory_gib=80))
    out = capsys.readouterr().out
    assert "layout tp=1 pp=1 dp=8 zero=0" in out and "fastest first" in out
    assert "estimated step time" in out


def test_dry_run_plans_the_layout_given_from_a_laptop():
    """Outside torchrun (a world of one) --dry-run plans --tp/--pp/--dp as given."""
    import subprocess
    import sys
    from pathlib import Path

    argv = ["--dry-run", "--tp", "8", "--pp", "4", "--dp", "2", "--num-layers", "8",
            "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "128",
            "--vocab-size", "1000", "--precision", "bf16", "--mbs", "1", "--gbs", "64"]  # fmt: skip
    r = subprocess.run([sys.executable, "pretrain_gpt.py", *argv], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[2], timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("layout tp=8 pp=4 dp=2") and "64 GPUs" in r.stdout


def test_zero3_plan_shards_parameters_and_shows_both_policies():
    # llama 3B over 8 ranks: the shards, a layer or two gathered, and the traffic of each policy
    cfg = big("llama", 26, 3200, 32, 1024, 32000, mbs=1, gbs=64)
    z2, z3 = (planner.plan(cfg, Layout(dp=8, zero=z)) for z in (2, 3))
    # bf16 shards, 1/dp each (the buckets are padded differently: units vs 25 MB buckets)
    assert z3.memory["params"] * 8 == pytest.approx(z2.memory["params"], rel=1e-4)
    units = planner.zero3_units(cfg, Layout(dp=8, zero=3), 0)
    layer = max(units["forward"][1])  # the largest unit (padded elements)
    assert 2 * layer * 2 <= z3.memory["gathered_params"] == units["forward"][0] < 4 * layer * 2
    assert units["forward"][0] < units["backward"][0] == units["step"][0]  # one chunk at pp=1
    one = planner.comm_bytes(cfg, Layout(dp=8, zero=3), 0, 1)["dp_gather"]  # one micro-batch
    assert z3.comm["dp_gather"] == z3.microbatches * one  # each unit twice per micro-batch
    cfg.optimizer.zero3_keep_params = True
    keep = planner.plan(cfg, Layout(dp=8, zero=3))
    assert 2 * keep.comm["dp_gather"] == z3.comm["dp_gather"]
    assert keep.memory["gathered_params"] == units["backward"][0]
    piped = planner.plan(cfg, Layout(dp=4, pp=2, zero=3))  # pp: gathered once per step
    assert piped.memory["gathered_params"] == planner.zero3_units(cfg, piped.layout, 0)["step"][0]
    text = layouts.format_plan(z3)
    assert "reshard=forward (this run)" in text and "reshard=step" in text
    assert "reduce-scatter every micro-batch (this run)" in text and "gathered params" in text


def test_context_parallel_plan():
    """cp divides activations (every layer's tokens are s/cp) and adds the ring's bytes; at
    tp=2 cp=2 the total is what the ledger recorded in a 4-process run of this model (gloo)."""
    cfg = big("gpt2", 4, 32, 4, 32, 512, mbs=1, gbs=8, precision="fp32")
    one = planner.plan(cfg, Layout())
    for cp in (2, 4):
        p = planner.plan(cfg, Layout(cp=cp))
        short = big("gpt2", 4, 32, 4, 32 // cp, 512, mbs=1, gbs=8, precision="fp32")
        assert p.memory["activations"] == planner.plan(short, Layout()).memory["activations"]
        assert p.memory["activations"] < one.memory["activations"] * (0.6 if cp == 2 else 0.35)
        # replicated, as over dp (the buffer padded to a multiple of the replicas)
        assert one.memory["params"] <= p.memory["params"] <= one.memory["params"] * 1.01
    p = planner.plan(cfg, Layout(tp=2, cp=2))
    # per layer and micro-batch: one hop of K and V (2 x 2 heads x 16 tokens x 8 dims, fp32)
    # forward, backward one of K, V and two of dK, dV (the second one home)
    kv = 2 * 16 * 8 * 4
    ring = 4 * 8 * (2 * kv + 4 * kv + 2 * kv)
    grads = 35072 * 4  # all-reduced over the 2 replicas (cp): 2(n-1)/n of the bytes
    assert p.comm["cp"] == ring + grads + 8 == 402440  # 8: the logged loss's mean
    # a2a: q, k+v and out (4 heads x 16 tokens x 8 dims, fp32; k+v twice that) forward and back
    cfg.parallel.cp_comm_type = "a2a"
    assert planner.cp_layer_bytes(cfg, Layout(cp=2)) == (4 * 2048, 4 * 2048)
    with_dp = planner.plan(cfg, Layout(cp=2, dp=2))
    assert with_dp.comm["cp+dp"] > 0 and "dp" not in with_dp.comm  # the replicas: dp x cp
