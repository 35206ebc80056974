"""plan/traffic.py: ZeRO-3's gathers under each reshard policy, context parallelism's bytes
(the totals a gloo run's ledger recorded). The other kinds against real runs:
tests/distributed/test_ledger.py."""

import pytest

from megalite.parallel.zero3 import unit_of
from megalite.plan import layouts, memory, report, traffic
from megalite.plan.layouts import layout
from tests.unit.plan_configs import big


def test_zero3_plan_shards_parameters_and_shows_both_policies():
    # llama 3B over 8 ranks: the shards, a layer or two gathered, and the traffic of each policy
    cfg = big("llama", 26, 3200, 32, 1024, 32000, mbs=1, gbs=64)
    z2, z3 = (layouts.plan(cfg, layout(cfg, dp=8, zero=z)) for z in (2, 3))
    # bf16 shards, 1/dp each (the buckets are padded differently: units vs 25 MB buckets)
    assert z3.memory["params"] * 8 == pytest.approx(z2.memory["params"], rel=1e-4)
    units = memory.zero3_units(cfg, layout(cfg, dp=8, zero=3), 0)
    layer = max(units["forward"][1])  # the largest unit (padded elements)
    assert 2 * layer * 2 <= z3.memory["gathered_params"] == units["forward"][0] < 4 * layer * 2
    assert units["forward"][0] < units["backward"][0] == units["step"][0]  # one chunk at pp=1
    # each bucket's gather bytes (bf16, 7/8 of them over 8 ranks, as the ledger truncates) by unit
    unit = {}
    for s, e, ranges in memory.buckets(cfg, layout(cfg, dp=8, zero=3), 0):
        key = unit_of(ranges[0][0])
        unit[key] = unit.get(key, 0) + int(7 / 8 * (e - s) * 2)
    outer, first, *rest = unit.values()  # forward order: the outer unit, layers.0, ...
    m = z3.microbatches
    # per step: the outer unit once (kept from forward to backward and between micro-batches),
    # the first layer in each backward and after the step, every other layer twice a micro-batch
    assert z3.comm["dp_gather"] == outer + (m + 1) * first + 2 * m * sum(rest)
    cfg.optimizer.zero3_keep_params = True
    keep = layouts.plan(cfg, layout(cfg, dp=8, zero=3))
    assert keep.comm["dp_gather"] == outer + first + m * sum(rest)
    assert keep.memory["gathered_params"] == units["backward"][0]
    piped = layouts.plan(cfg, layout(cfg, dp=4, pp=2, zero=3))  # pp: gathered once per step
    assert piped.memory["gathered_params"] == memory.zero3_units(cfg, piped.layout, 0)["step"][0]
    text = report.format_plan(z3)
    assert "reshard=forward (this run)" in text and "reshard=step" in text
    for plan in (z3, keep):  # the notes' gather bytes of each policy are the plan's
        assert f"{plan.comm['dp_gather'] / 1e6:.2f} MB of parameter gathers" in text
    assert "reduce-scatter every micro-batch (this run)" in text and "gathered params" in text


def test_context_parallel_plan():
    """cp divides activations (every layer's tokens are s/cp) and adds the ring's bytes; at
    tp=2 cp=2 the total is what the ledger recorded in a 4-process run of this model (gloo)."""
    cfg = big("gpt2", 4, 32, 4, 32, 512, mbs=1, gbs=8, precision="fp32")
    one = layouts.plan(cfg, layout(cfg))
    for cp in (2, 4):
        p = layouts.plan(cfg, layout(cfg, cp=cp))
        short = big("gpt2", 4, 32, 4, 32 // cp, 512, mbs=1, gbs=8, precision="fp32")
        assert p.memory["activations"] == layouts.plan(short, layout(cfg)).memory["activations"]
        assert p.memory["activations"] < one.memory["activations"] * (0.6 if cp == 2 else 0.35)
        # replicated, as over dp (the buffer padded to a multiple of the replicas)
        assert one.memory["params"] <= p.memory["params"] <= one.memory["params"] * 1.01
    p = layouts.plan(cfg, layout(cfg, tp=2, cp=2))
    # per layer and micro-batch: one hop of K and V (2 x 2 heads x 16 tokens x 8 dims, fp32)
    # forward, backward one of K, V and two of dK, dV (the second one home)
    kv = 2 * 16 * 8 * 4
    ring = 4 * 8 * (2 * kv + 4 * kv + 2 * kv)
    grads = 35072 * 4  # all-reduced over the 2 replicas (cp): 2(n-1)/n of the bytes
    assert p.comm["cp"] == ring + grads + 8 == 402440  # 8: the logged loss's mean
    # a2a: q, k+v and out (4 heads x 16 tokens x 8 dims, fp32; k+v twice that) forward and back
    cfg.parallel.cp_comm_type = "a2a"
    assert traffic.cp_layer_bytes(cfg, layout(cfg, cp=2)) == (4 * 2048, 4 * 2048)
    # a2a+p2p at cp 4 = 2 x 2: the exchanges over the pair (4 heads x 8 tokens x 8 dims), then
    # the ring over 2 (2 heads x 16 tokens): one K/V hop forward; one and two dK/dV backward
    cfg.parallel.cp_comm_type, cfg.parallel.hierarchical_context_parallel_sizes = "a2a+p2p", [2, 2]
    q = kv = 4 * 8 * 8 * 4
    hops = 2 * kv
    assert traffic.cp_layer_bytes(cfg, layout(cfg, cp=4)) == (
        4 * q + hops, 4 * q + hops + 2 * hops,
    )  # fmt: skip
    cfg.parallel.cp_comm_type, cfg.parallel.hierarchical_context_parallel_sizes = "a2a", None
    with_dp = layouts.plan(cfg, layout(cfg, cp=2, dp=2))
    assert with_dp.comm["cp+dp"] > 0 and "dp" not in with_dp.comm  # the replicas: dp x cp


def test_each_kinds_steps_carry_its_message():
    """The latency term's steps (ranking: links.seconds): a kind's bus bytes over what one step
    of its collectives carries; cp's from its attention only, not the gradients it also holds
    at dp = 1."""
    cfg = big("llama", 2, 64, 4, 32, 128, mbs=1, gbs=4, precision="fp32")
    shape = layout(cfg, tp=2, cp=2, sequence_parallel=True)
    p = layouts.plan(cfg, shape)
    chunk = traffic.step_bytes(cfg, shape)
    assert chunk["tp"] == 1 * 16 * 64 * 4 / 2  # (b, s/cp, h) fp32, S/tp a ring step
    fwd, bwd = traffic.cp_layer_bytes(cfg, shape)
    assert chunk["cp"] == fwd  # one K/V hop forward at cp 2
    steps = traffic.latency_steps(cfg, shape, p.comm, p.microbatches)
    assert steps["tp"] == p.comm["tp"] / chunk["tp"]
    assert p.comm["cp"] > 2 * (fwd + bwd)  # the gradients' reduction over cp too
    assert steps["cp"] == 2 * p.microbatches * (fwd + bwd) / fwd  # 2 layers' attention only
