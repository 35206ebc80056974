"""The step never waits on the device: at most one host read per non-logging training step (the
optimizer's status: gradient norm, skip decision, preemption), at tp2 pp2 dp2 with ZeRO-1,
interleaved (vpp 2) and bf16; and the counter sees a read planted in the step."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megalite.config import Config
from megalite.parallel.groups import build_groups
from megalite.shape import validate
from tests.host_syncs import HostSyncCounter
from tests.spawn import spawn

pytestmark = pytest.mark.distributed
STEPS = 3


def _trainer(world):
    from megalite.training.trainer import Trainer

    cfg = Config()
    m, t, p = cfg.model, cfg.training, cfg.parallel
    m.flavour, m.num_layers, m.hidden_size, m.num_attention_heads = "llama", 4, 32, 4
    m.seq_length, m.vocab_size = 16, 100
    t.micro_batch_size, t.global_batch_size, t.precision = 1, 8, "bf16"
    p.tp, p.pp, p.vpp = 2, 2, 2
    cfg.optimizer.zero_stage = 1
    cfg.logging.wandb_mode = "disabled"
    shape = validate(cfg, world)
    groups = build_groups(shape.topology(), torch.device("cpu"))
    tokens = np.random.default_rng(0).integers(0, 100, (64, 17))
    data = SimpleNamespace(train=tokens, valid=None, tokenizer=None)
    return Trainer(cfg, shape, groups, data=data)


def _steps(trainer) -> HostSyncCounter:
    counter = HostSyncCounter()
    with counter.counting():
        for _ in range(STEPS):
            trainer.train_step(log=False)
    metrics = trainer.train_step(log=True)  # a logging step reads the rest
    assert metrics["loss"] > 0 and 0 <= metrics["idle_share"] < 1
    return counter


def _count(rank, world):
    trainer = _trainer(world)
    trainer.train_step(log=True)  # the first step (and a logging one) outside the count
    clean = _steps(trainer)
    step = trainer.opt.step  # now plant a stray read of a device value in the step
    trainer.opt.step = lambda lr, flags=(): (torch.ones(1).tolist(), step(lr, flags))[1]
    planted = _steps(trainer)
    return clean.count, [w for w, _ in clean.where], planted.count


def test_one_host_read_per_step():
    for clean, where, planted in spawn(_count, 8, timeout=300):
        assert clean <= STEPS, where  # one per step: the status read
        assert planted == clean + STEPS  # the counter sees the planted read
