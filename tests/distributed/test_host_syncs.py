"""The step never waits on the device: at most one host read per non-logging training step (the
optimizer's status: gradient norm, skip decision, preemption), at tp2 pp2 dp2 with ZeRO-1,
interleaved (vpp 2) and bf16, at tp2 dp2 with ZeRO-3 (layers gathered and freed by hooks), and
at tp2 cp2 with packed documents (ring attention, document ids, the loss normalised by a count
that is never read); and the counter sees a read planted in the step."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megalite.config import Config
from megalite.parallel.groups import build_groups
from megalite.shape import validate
from megalite.testing import HostSyncCounter, spawn

pytestmark = pytest.mark.distributed
STEPS = 3


def _trainer(world, zero=1, pp=2, vpp=2, cp=1):
    from megalite.training.trainer import Trainer

    cfg = Config()
    m, t, p = cfg.model, cfg.training, cfg.parallel
    m.flavour, m.num_layers, m.hidden_size, m.num_attention_heads = "llama", 4, 32, 4
    m.seq_length, m.vocab_size = 16, 100
    t.micro_batch_size, t.global_batch_size, t.precision = 1, 8, "bf16"
    p.tp, p.pp, p.vpp, p.cp = 2, pp, vpp, cp
    tokenizer = None
    if cp > 1:  # and packed documents: EOD is token 2 (the tokenizer's end of document)
        d = cfg.data
        d.reset_position_ids = d.reset_attention_mask = d.eod_mask_loss = True
        tokenizer = SimpleNamespace(vocab_size=100, eos_id=2, model_path=None)
    cfg.optimizer.zero_stage = zero
    cfg.logging.wandb_mode = "disabled"
    shape = validate(cfg, world)
    groups = build_groups(shape.topology(), torch.device("cpu"))
    tokens = np.random.default_rng(0).integers(0, 100, (64, 17))
    data = SimpleNamespace(train=tokens, valid=None, tokenizer=tokenizer)
    return Trainer(cfg, shape, groups, data=data)


def _steps(trainer) -> HostSyncCounter:
    counter = HostSyncCounter()
    with counter.counting():
        for _ in range(STEPS):
            trainer.train_step(log=False)
    metrics = trainer.train_step(log=True)  # a logging step reads the rest
    assert metrics["loss"] > 0 and 0 <= metrics["idle_share"] < 1
    return counter


def _count(rank, world, zero=1, pp=2, vpp=2, cp=1):
    trainer = _trainer(world, zero, pp, vpp, cp)
    trainer.train_step(log=True)  # the first step (and a logging one) outside the count
    clean = _steps(trainer)
    step = trainer.opt.step  # now plant a stray read of a device value in the step
    trainer.opt.step = lambda *args, **kw: (torch.ones(1).tolist(), step(*args, **kw))[1]
    planted = _steps(trainer)
    return clean.count, [w for w, _ in clean.where], planted.count


@pytest.mark.parametrize(
    "world,layout",
    [(8, (1, 2, 2)), (4, (3, 1, 1)), (4, (1, 1, 1, 2))],
    ids=["zero1-pp2", "zero3-dp2", "cp2-documents"],
)
def test_one_host_read_per_step(world, layout):
    for clean, where, planted in spawn(_count, world, *layout, timeout=300):
        assert clean <= STEPS, where  # one per step: the status read
        assert planted == clean + STEPS  # the counter sees the planted read
