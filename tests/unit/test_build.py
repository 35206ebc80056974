"""build_rank builds what a rank of a run holds, as the trainer uses it (one process)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from megalite.kernels import TORCH_OPS

from megalite.errors import MegaliteError
from megalite.model.env import LayerEnv
from megalite.model.gpt import GPTChunk
from megalite.optim.distributed_optimizer import build_optimizer
from megalite.parallel.groups import single_process_groups
from megalite.pipeline.executor import run_schedule
from megalite.pipeline.partition import rank_chunks
from megalite.pipeline.schedules import get_schedule
from megalite.shape import validate
from megalite.testing import random_batch, tiny_config
from megalite.training.build import build_rank
from megalite.training.trainer import Trainer


def test_build_rank_is_the_hand_wiring():
    """One chunk, ZeRO-1 and 1F1B built by hand, as benchmarks did: the same step, bit for bit."""
    cfg = tiny_config()
    cfg.optimizer.zero_stage, cfg.training.kernels = 1, "torch"
    groups = single_process_groups()
    parts = build_rank(cfg, validate(cfg, 1), groups)
    hand = GPTChunk(cfg.model, LayerEnv(ops=TORCH_OPS, seed=cfg.training.seed))
    opt = build_optimizer([hand], groups, cfg)
    actions = get_schedule("1f1b", 1, 1, 4, 0)
    assert parts.actions == actions and parts.microbatches == 4
    for step in range(2):
        batch = random_batch(cfg, step)
        parts.opt.zero_grad(len(batch))
        ours = parts.run(batch)
        parts.opt.step(1e-3)
        opt.zero_grad(len(batch))
        theirs = run_schedule(actions, [hand], groups, batch, hidden_shape=(1, 16, 32),
                              dtype=torch.float32)  # fmt: skip
        opt.step(1e-3)
        assert ours.loss == theirs.loss
    (chunk,) = parts.chunks
    got, want = dict(chunk.named_parameters()), dict(hand.named_parameters())
    assert got.keys() == want.keys()
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_build_rank_follows_the_shape():
    """Virtual stages: a chunk each, their layers by the schedule's placement; the precision."""
    cfg = tiny_config()
    cfg.model.num_layers, cfg.parallel.vpp, cfg.training.precision = 4, 2, "bf16"
    shape = validate(cfg, 1)
    parts = build_rank(cfg, shape, single_process_groups())
    assert shape.schedule == "interleaved" and len(parts.chunks) == 2
    for chunk, kw in zip(parts.chunks, rank_chunks(4, 1, 2, 0, shape.placement)):
        assert sorted(int(i) for i in chunk.layers) == list(kw["layers"])
        assert (chunk.has_embedding, chunk.has_head) == (kw["has_embedding"], kw["has_head"])
    assert parts.dtype == torch.bfloat16 == next(parts.chunks[0].parameters()).dtype
    assert parts.actions == get_schedule("interleaved", 1, 2, 4, 0)
    assert parts.hidden_shape == shape.hidden_shape


def test_trainer_step_takes_a_batch():
    """Trainer.train_step(batch=...) on the batch train_step would read trains the same."""
    cfg = tiny_config()
    tokens = np.random.default_rng(0).integers(0, 100, (64, 17))
    data = SimpleNamespace(train=tokens, valid=None, tokenizer=None)
    a = Trainer(cfg, validate(cfg, 1), single_process_groups(), data)
    b = Trainer(cfg, validate(cfg, 1), single_process_groups(), data)
    for _ in range(2):
        want = a.train_step(log=True)
        got = b.train_step(log=True, batch=b._microbatches(data.train, b.sampler.next_batch()))
        assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]
    assert b.iteration == a.iteration == 2
    pa, pb = dict(a.chunks[0].named_parameters()), dict(b.chunks[0].named_parameters())
    assert all(torch.equal(pa[n], pb[n]) for n in pa)


def test_build_rank_takes_the_ops():
    """An overridden linear reaches every layer of every chunk build_rank makes."""
    import torch.nn.functional as F

    from megalite import kernels

    cfg = tiny_config()
    cfg.training.kernels = "torch"
    calls = []

    def counting(x, w, b=None):
        calls.append(w.shape)
        return F.linear(x, w, b)

    ops = kernels.override(TORCH_OPS, linear=counting)
    parts = build_rank(cfg, validate(cfg, 1), single_process_groups(), ops=ops)
    parts.opt.zero_grad(4)
    parts.run(random_batch(cfg))
    # attention (fused q/k/v, out), MLP (up, down) per layer and the head, per micro-batch
    assert len(calls) == 4 * (4 * cfg.model.num_layers + 1)


def test_run_refuses_a_batch_the_schedule_was_not_built_for():
    """The run shape fixes the micro-batch count; a batch of another count is one clear error."""
    cfg = tiny_config()
    parts = build_rank(cfg, validate(cfg, 1), single_process_groups())
    batch = random_batch(cfg)
    parts.opt.zero_grad(len(batch) - 1)
    with pytest.raises(
        MegaliteError, match="given 3 micro-batches but its schedule was built for 4"
    ):
        parts.run(batch[:-1])


def test_the_reference_step_is_megalites_one_process_step():
    """megalite.testing.reference_steps (plain torch, ~40 lines) trains as the trainer does at
    one process: the same losses and parameters, to float rounding (flat buffers sum and
    update in another order)."""
    from megalite.testing import reference_steps, tiny_trainer

    cfg = tiny_config()
    cfg.training.kernels, cfg.training.train_iters, cfg.optimizer.lr = "torch", 3, 3e-3
    tr = tiny_trainer(cfg, world=1)
    want, params = reference_steps(cfg, tr.data.train, 3)
    got = [tr.train_step(log=True)["loss"] for _ in range(3)]
    assert got == pytest.approx(want, rel=1e-5)
    ours = dict(tr.chunks[0].named_parameters())
    assert ours.keys() == params.keys()
    for n, p in params.items():
        # a key bias shifts every key alike, which softmax ignores: its gradient is rounding
        # noise (which Adam scales up to lr-sized steps), and the noise differs by CPU
        atol = 1e-5 if n.endswith("k.bias") else 1e-6
        torch.testing.assert_close(ours[n], p, rtol=1e-4, atol=atol, msg=n)


@pytest.mark.parametrize("plan", ["rampup", "steps"])
def test_rampup_decoupled_lr_and_weight_decay_train_as_the_reference(plan):
    """A batch ramp-up (2, 2, 4, then 6 samples a step; or a step schedule of 2 then 4 from
    sample 4 then 6 from sample 8), warmup by fraction, WSD, a weight-decay increment and
    --decoupled-lr: the trainer's steps (their micro-batch counts changing) give the losses and
    parameters of reference_steps, which writes Megatron's meaning out."""
    from megalite.testing import reference_steps, tiny_trainer

    cfg = tiny_config()
    t, o = cfg.training, cfg.optimizer
    t.kernels, t.global_batch_size, t.micro_batch_size = "torch", 6, 2
    t.train_samples = 40
    if plan == "rampup":
        t.rampup_batch_size = [2, 2, 8]
    else:  # thresholds in tokens: 16 a sample
        t.step_batch_size_schedule = "0:2 64:4 128:6"
    o.lr, o.min_lr, o.lr_warmup_fraction, o.lr_decay_style = 3e-3, 1e-4, 0.2, "WSD"
    o.lr_wsd_decay_samples, o.decoupled_lr, o.decoupled_min_lr = 20, 1e-2, 0.0
    o.weight_decay_incr_style, o.start_weight_decay, o.end_weight_decay = "linear", 0.0, 0.5
    tr = tiny_trainer(cfg, world=1)
    steps = tr.train_iters
    # ramp-up: 2, 2, 4, 6 (to 14 samples), then (40 - 14) // 6 of 6; steps: 2, 2, 4, then six
    # of 6 past the 40th sample, the last batch whole (Megatron's counts)
    assert steps == (8 if plan == "rampup" else 9)
    want, params = reference_steps(cfg, tr.data.train, steps)
    got = [tr.train_step(log=True)["loss"] for _ in range(steps)]
    assert (
        tr.sampler.consumed_samples == tr.opt.schedule_samples == (38 if plan == "rampup" else 44)
    )
    assert got == pytest.approx(want, rel=1e-5)
    ours = dict(tr.chunks[0].named_parameters())
    for n, p in params.items():
        atol = 1e-5 if n.endswith("k.bias") else 1e-6
        torch.testing.assert_close(ours[n], p, rtol=1e-4, atol=atol, msg=n)


def test_rampup_schedule_resumes_exactly(tmp_path):
    """Saved in the middle of a batch ramp-up and warmup, a resumed run continues with the
    losses of the run that did not stop (the schedule's position comes with the optimizer)."""
    from megalite.testing import tiny_trainer

    def run(steps, save=None):
        cfg = tiny_config()
        t, o = cfg.training, cfg.optimizer
        t.kernels, t.global_batch_size, t.micro_batch_size = "torch", 6, 2
        t.train_samples, t.rampup_batch_size = 40, [2, 2, 8]
        o.lr, o.lr_warmup_samples = 3e-3, 12
        cfg.checkpoint.save = save
        tr = tiny_trainer(cfg, world=1)
        tr.resume()
        losses = [tr.train_step(log=True)["loss"] for _ in range(steps)]
        return tr, losses

    _, whole = run(6)
    first, _ = run(3, str(tmp_path / "ckpt"))
    first.save()
    second, rest = run(3, str(tmp_path / "ckpt"))
    assert second.iteration == 6 and second.opt.schedule_samples == 2 + 2 + 4 + 3 * 6
    assert rest == pytest.approx(whole[3:], rel=1e-6)


def test_fp16_starts_at_megatrons_scale_and_skipped_steps_hold_the_schedule():
    """--fp16 starts the loss scale at Megatron's 2^32: the first steps overflow and are
    skipped while the scaler backs off (not counted against --max-skipped-steps 5), and, as in
    Megatron, a skipped step does not advance the learning-rate schedule."""
    from megalite.testing import tiny_trainer

    cfg = tiny_config()
    cfg.training.kernels, cfg.training.fp16, cfg.training.train_iters = "torch", True, 30
    cfg.optimizer.lr_warmup_iters = 10
    tr = tiny_trainer(cfg, world=1)
    rows = [tr.train_step(log=True) for _ in range(30)]
    skipped = sum(r["skipped"] for r in rows)
    assert 5 < skipped < 30 and rows[0]["loss_scale"] == 2.0**32  # (hysteresis 2: kept once)
    assert tr.opt.schedule_samples == (30 - skipped) * 4
    first = next(k for k, r in enumerate(rows) if not r["skipped"])
    assert {r["lr"] for r in rows[: first + 1]} == {0.0}  # warmup's first step, held
    assert rows[first + 1]["lr"] == cfg.optimizer.lr / 10


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_grad_reduce_in_bf16_keeps_bf16_gradients(zero):
    """--bf16 --grad-reduce-in-bf16: the gradient buffers are bf16 (Megatron's bf16 main_grad)
    at every ZeRO stage, and training follows the fp32-accumulating run closely but not
    bit for bit (the micro-batch sums round to bf16)."""
    from megalite.testing import tiny_trainer

    def losses(low):
        cfg = tiny_config()
        cfg.training.kernels, cfg.training.bf16, cfg.training.train_iters = "torch", True, 4
        cfg.training.grad_reduce_in_bf16, cfg.optimizer.zero_stage = low, zero
        cfg.optimizer.lr = 3e-3
        tr = tiny_trainer(cfg, world=1)
        dtypes = {b.shard_grad.dtype for b in tr.opt.buffer.buckets}
        assert dtypes == {torch.bfloat16 if low else torch.float32}
        return [tr.train_step(log=True)["loss"] for _ in range(4)]

    low, high = losses(True), losses(False)
    assert low == pytest.approx(high, rel=2e-2) and low != high


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_decoupled_lr_reaches_exactly_the_embedding_and_output(optimizer):
    """--decoupled-lr 0 (and its minimum 0) holds the word embedding and the untied output
    layer still while every other parameter trains, under AdamW and under Muon's AdamW part."""
    from megalite.testing import tiny_trainer

    cfg = tiny_config()
    cfg.model.untie_embeddings_and_output_weights = True
    cfg.training.kernels, cfg.training.train_iters = "torch", 2
    o = cfg.optimizer
    o.optimizer, o.lr, o.decoupled_lr, o.decoupled_min_lr = optimizer, 3e-3, 0.0, 0.0
    tr = tiny_trainer(cfg, world=1)
    before = {n: p.detach().clone() for n, p in tr.chunks[0].named_parameters()}
    for _ in range(2):
        tr.train_step(log=False)
    moved = {n for n, p in tr.chunks[0].named_parameters() if not torch.equal(p, before[n])}
    held = {"embedding.word.weight", "output.weight"}
    assert held <= set(before) and moved == set(before) - held
