"""A tiny model and the real Trainer over random tokens, for the tests that drive a whole run
in gloo ranks (tests/spawn.py)."""

from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

from megalite.config import Config
from megalite.parallel.groups import build_groups
from megalite.shape import validate


def tiny_config(hidden: int = 32, vocab: int = 100) -> Config:
    """2 layers of `hidden`, 4 heads, 16 tokens per sample, 4 samples per step, W&B off."""
    cfg = Config()
    m, t = cfg.model, cfg.training
    m.num_layers, m.hidden_size, m.num_attention_heads = 2, hidden, 4
    m.seq_length, m.vocab_size = 16, vocab
    t.micro_batch_size, t.global_batch_size = 1, 4
    cfg.logging.wandb_mode = "disabled"
    return cfg


def tiny_trainer(cfg: Config, samples: int = 256):
    """The Trainer of `cfg` at this world's size, on `samples` random token rows."""
    from megalite.training.trainer import Trainer

    shape = validate(cfg, dist.get_world_size())
    groups = build_groups(shape.topology(), torch.device("cpu"))
    m = cfg.model
    tokens = np.random.default_rng(0).integers(0, m.vocab_size, (samples, m.seq_length + 1))
    return Trainer(cfg, shape, groups, SimpleNamespace(train=tokens, valid=None, tokenizer=None))
