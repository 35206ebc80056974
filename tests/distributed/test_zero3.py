"""ZeRO-3 against one process holding the whole batch (fp64: loss, gradients, parameters and
moments within 1e-10), and the parameter memory it promises, measured from the storages.

The model and the reference are test_zero.py's (hand-written TP blocks, a tied embedding over
two pipeline stages, torch.optim.AdamW + clip_grad_norm_ in one process).
"""

import pytest
import torch
from megalite.kernels import fp8, fp8_linear

from megalite import kernels
from megalite.config import Config, ModelConfig
from megalite.model.env import LayerEnv
from megalite.model.gpt import GPTChunk
from megalite.optim.distributed_optimizer import build_optimizer
from megalite.parallel import comm
from megalite.parallel.groups import build_groups
from megalite.parallel.topology import Topology
from megalite.parallel.zero3 import unit_layout
from megalite.plan import memory, traffic
from megalite.plan.layouts import layout
from megalite.testing import spawn
from tests.distributed.test_zero import (
    LR,
    Chunk,
    batch,
    blocks,
    check_against_reference,
    check_tied,
    close,
    config,
    mse,
    reference,
    single_groups,
    train,
)


def test_unit_layout_one_bucket_per_unit_in_forward_order():
    chunk = [("embedding.word.weight", 10, True), ("embedding.position.weight", 6, False),
             ("layers.3.a", 4, False), ("layers.3.b", 4, False), ("layers.4.a", 5, False),
             ("final_norm.weight", 3, False)]  # fmt: skip
    out = unit_layout([chunk, [("layers.7.a", 2, False)]], pad=8)
    names = [[n for n, _, _ in ranges] for _, _, ranges in out]
    assert names == [["embedding.word.weight"], ["embedding.position.weight", "final_norm.weight"],
                     ["layers.3.a", "layers.3.b"], ["layers.4.a"], ["layers.7.a"]]  # fmt: skip
    assert [(s, e) for s, e, _ in out] == [(0, 16), (16, 32), (32, 40), (40, 48), (48, 56)]


def _layouts(rank, world):
    # dp=4 with two chunks on each rank (as with virtual stages), default and keep-params
    groups = build_groups(Topology(dp=4), torch.device("cpu"))

    def two_chunks():
        b = blocks(3, groups.tp, torch.float64)
        return [Chunk({0: b[0]}), Chunk({1: b[1], 2: b[2]})]

    for keep in (False, True):
        check_against_reference(groups, two_chunks, 3, m=2, gbs=16, stages=(3,), keep=keep)
    # tp=2 x dp=2: sharded, replicated and TP-summed parameters
    groups = build_groups(Topology(tp=2, dp=2), torch.device("cpu"))
    check_against_reference(
        groups, lambda: [Chunk(dict(enumerate(blocks(2, groups.tp, torch.float64))))], 2, m=2,
        gbs=8, stages=(3,),
    )  # fmt: skip
    # pp=2 x dp=2 with the word embedding tied between the first and the last stage
    groups = build_groups(Topology(pp=2, dp=2), torch.device("cpu"))
    check_tied(groups, stages=(3,))


@pytest.mark.distributed
def test_zero3_matches_one_process_dp4_tp2_pp2():
    spawn(_layouts, 4, timeout=240)


def _live_param_bytes(chunks, opt) -> int:
    """Bytes of every storage holding parameters on this rank, counted from the storages
    themselves: the shards the optimizer updates and each distinct parameter storage (a
    gathered unit's full tensor; zero bytes once freed)."""
    storages = {}
    for c in chunks:
        for p in c.parameters():
            s = p.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    shards = sum(opt.buffer.param_shard(b).untyped_storage().nbytes() for b in opt.buffer.buckets)
    return shards + sum(n for ptr, n in storages.items() if ptr)


def _measure(groups, stage: int, rank: int, n_layers=6, m=2):
    """One step at `stage`: (peak live parameter bytes, whether the weights autograd saved had
    no storage between forward and backward, padded model bytes, one gathered layer's bytes,
    the optimizer's memory_bytes, which ZeRO-3 units are gathered after the step)."""
    chunks = [Chunk(dict(enumerate(blocks(n_layers, groups.tp, torch.float64))))]
    opt = build_optimizer(chunks, groups, config(stage, mbs=2, gbs=8))
    # one layer gathered: its parameters, padded to a multiple of dp * 64 elements
    layer = max(b.numel for b in opt.buffer.buckets) * 8
    assert layer < 2 * sum(p.numel() for p in chunks[0].layers["0"].parameters()) * 8
    params = list(chunks[0].parameters())
    peak, saved = 0, []

    def pack(t):
        nonlocal peak
        peak = max(peak, _live_param_bytes(chunks, opt))
        if any(t is p for p in params):
            saved.append(t)
        return t

    def unpack(t):
        nonlocal peak
        peak = max(peak, _live_param_bytes(chunks, opt))
        return t

    x, y = batch(0, 8)
    xs, ys = x.chunk(2)[rank].chunk(m), y.chunk(2)[rank].chunk(m)
    opt.zero_grad(m)
    freed = True
    for xk, yk in zip(xs, ys):
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            loss = mse(chunks[0](xk), yk) / m
        # between forward and backward: every weight autograd saved holds no storage
        freed = freed and all(t.untyped_storage().nbytes() == 0 for t in saved)
        loss.backward()
        saved.clear()
    opt.step(LR)
    held = [u.gathered for u in getattr(opt.buffer, "units", [])]  # (ZeRO-3: after the step)
    return peak, freed, opt.buffer.numel * 8, layer, opt.memory_bytes(), held


def _memory(rank, world):
    """dp=2, six equal layers: the parameter storage alive at any moment of a step (at each
    tensor autograd saves or reads back) stays within the shards plus two gathered layers, and
    the weights autograd saved are really freed between forward and backward."""
    groups = build_groups(Topology(dp=2), torch.device("cpu"))
    peak, freed, padded, layer, mem, held = _measure(groups, 3, rank)
    assert freed and mem["param_bytes"] == padded // 2
    assert held == [True] + [False] * 5  # the step gathers the first layer for the next forward
    assert padded // 2 + layer <= peak <= padded // 2 + 2 * layer, (peak, padded, layer)
    assert mem["param_gathered_peak_bytes"] <= 2 * layer
    peak2, freed2, padded2, _, _, _ = _measure(groups, 2, rank)
    assert not freed2 and peak2 >= padded2 > padded // 2 + 2 * layer  # stage 2 keeps it all
    return peak, padded, layer


def _dp2(rank, world):
    groups = build_groups(Topology(dp=2), torch.device("cpu"))
    check_against_reference(
        groups, lambda: [Chunk(dict(enumerate(blocks(3, groups.tp, torch.float64))))], 3, m=2,
        gbs=8, stages=(3,),
    )  # fmt: skip
    # bf16 parameters: fp32 masters, moments and shard gradients, as at stages 1 and 2
    batches = [batch(s, 8) for s in range(3)]
    ref = Chunk(dict(enumerate(blocks(2, single_groups().tp, torch.float64))))
    reference(ref, batches, mse)
    ref_params = dict(ref.named_parameters())
    chunks = [Chunk(dict(enumerate(blocks(2, groups.tp, torch.bfloat16))))]
    opt = build_optimizer(chunks, groups, config(3, "bf16"))
    _, _, stats = train(chunks, opt, groups, batches, 2)
    assert not any(s["skipped"] for s in stats)
    assert opt.state_bytes() == 12 * opt.buffer.numel // 2
    assert all(b.shard_grad.dtype == torch.float32 for b in opt.buffer.buckets)
    state = opt.state_tensors()
    with opt.gathered_params():
        for n, p in chunks[0].named_parameters():
            close(state[n]["master"].double(), ref_params[n].detach(), f"bf16 master {n}", 3e-2)
            close(p.double(), state[n]["master"].double(), f"bf16 param {n}", 1e-2)
    # fp16: an overflow on rank 1 alone skips the step on both; hysteresis 2, then halving
    chunks = [Chunk(dict(enumerate(blocks(2, groups.tp, torch.float16))))]
    cfg = config(3, "fp16")
    cfg.optimizer.initial_loss_scale = 2.0**8
    opt = build_optimizer(chunks, groups, cfg)
    with opt.gathered_params():
        before = [p.detach().clone() for p in chunks[0].parameters()]
    inf = lambda s, loss: loss * float("inf") if s < 2 and rank == 1 else loss  # noqa: E731
    _, _, stats = train(chunks, opt, groups, batches, 2, inject=inf)
    assert [s["skipped"] for s in stats] == [True, True, False]
    assert [s["loss_scale"] for s in stats] == [2.0**8, 2.0**7, 2.0**7]
    assert opt.step_count == 1 and all(m.dtype == torch.float32 for m in opt.masters)
    with opt.gathered_params():
        assert all(not torch.equal(p, b) for p, b in zip(chunks[0].parameters(), before))
    return _memory(rank, world)


@pytest.mark.distributed
def test_zero3_dp2_matches_one_process_and_holds_two_layers():
    results = spawn(_dp2, 2, timeout=180)
    peak, padded, layer = results[0]
    assert peak <= padded // 2 + 2 * layer


def _fp8_run(groups, recipe, gather, dtype, steps):
    """A two-layer llama GPTChunk at dp2 ZeRO-3 with FP8 linears: the losses, this rank's
    parameter shards after `steps` steps, and the dp_gather bytes of gathering one layer."""
    cfg = Config()
    cfg.model = ModelConfig(flavour="llama", num_layers=2, hidden_size=32, num_attention_heads=2,
                            seq_length=16, vocab_size=64, ffn_hidden_size=64)  # fmt: skip
    cfg.optimizer.zero_stage, cfg.optimizer.lr, cfg.optimizer.clip_grad = 3, 1e-2, 0.5
    t = cfg.training
    t.fp8_param_gather, t.fp8_format, t.fp8_recipe, t.fp8_amax_history_len = (
        gather,
        "hybrid",
        recipe,
        4,
    )
    t.micro_batch_size, t.global_batch_size = 2, 4
    maker = fp8_linear.Fp8Maker(fp8.make_recipe(recipe, "hybrid", history_len=4))
    ops = kernels.override(kernels.TORCH_OPS, fp8_linear=maker)
    chunks = [GPTChunk(cfg.model, LayerEnv(tp=groups.tp, seed=5, dtype=dtype, ops=ops))]
    opt = build_optimizer(chunks, groups, cfg)
    losses, gathered = [], []
    for s in range(steps):
        before = groups.ledger.bytes["dp_gather"]
        gen = torch.Generator().manual_seed(s)
        ids = torch.randint(0, 64, (2, 2, 17), generator=gen)[groups.dp.rank]
        opt.zero_grad(1)
        loss = chunks[0](ids[:, :-1], ids[:, 1:])
        loss.backward()
        losses.append(loss.detach())
        opt.step(1e-2)
        gathered.append(groups.ledger.bytes["dp_gather"] - before)
        fp8_linear.end_step(fp8_linear.fp8_linears(chunks[0].modules()),
                     lambda t: comm.all_reduce(t, groups.dp, op=torch.distributed.ReduceOp.MAX))  # fmt: skip
    buf = opt.buffer
    unit = buf.units[1]  # layers.0
    before = groups.ledger.bytes["dp_gather"]
    with torch.no_grad():
        buf._free(unit)  # (the first layer is kept gathered for the next step's forward)
        buf._gather(unit)
        buf._free(unit)
    moved = groups.ledger.bytes["dp_gather"] - before
    fp8_numel = sum(b.numel for b in unit.buckets if b in buf._fp8)
    if steps:  # the planner: the same buckets, gather bytes per step and gathered peak
        lay = layout(cfg, dp=2, zero=3)
        assert [e - s for s, e, _ in memory.buckets(cfg, lay, 0)] == [b.numel for b in buf.buckets]
        assert gathered[0] == traffic.comm_bytes(cfg, lay, 0, 1)["dp_gather"], gathered
        peak = opt.memory_bytes()["param_gathered_peak_bytes"]
        assert peak == memory.zero3_units(cfg, lay, 0)["forward"][0], peak
    return losses, [buf.param_shard(b).clone() for b in buf.buckets], moved, fp8_numel


def _fp8_gather(rank, world):
    groups = build_groups(Topology(dp=2), torch.device("cpu"))
    for recipe in ("tensorwise", "delayed"):  # delayed: step 2 scales by its history
        off = _fp8_run(groups, recipe, False, torch.float32, 2)
        on = _fp8_run(groups, recipe, True, torch.float32, 2)
        assert all(torch.equal(a, b) for a, b in zip(off[0], on[0])), (recipe, off[0], on[0])
        assert all(torch.equal(a, b) for a, b in zip(off[1], on[1])), recipe
    for dtype, e in ((torch.float32, 4), (torch.bfloat16, 2)):  # FP8: a quarter, a half
        off, on = (_fp8_run(groups, "tensorwise", g, dtype, 0) for g in (False, True))
        n_weights = 4  # layers.0: q/k/v fused, out, gate/up fused, down: one amax each
        amax = 2 * (2 - 1) / 2 * 4 * n_weights
        assert on[3] > 0 and off[3] == 0
        assert on[2] - amax == off[2] - (2 - 1) / 2 * on[3] * (e - 1), (dtype, on[2], off[2])
    return True


@pytest.mark.distributed
def test_fp8_param_gather_equals_the_fp8_run_at_a_quarter_of_the_bytes():
    """--fp8-param-gather at dp2 ZeRO-3: the same losses and parameters, bit for bit, as the
    same FP8 run gathering in fp32 (tensorwise and delayed scaling, clipping on), and the FP8
    weights' gather bytes a quarter of fp32's, half of bf16's."""
    assert all(spawn(_fp8_gather, 2, timeout=180))
