import math

import pytest

from megalite.config import OptimizerConfig
from megalite.optim.lr_schedule import lr_at


def cfg(**kw):
    return OptimizerConfig(**{"lr": 1.0, "min_lr": 0.1, "lr_warmup_iters": 4, **kw})


def test_warmup_is_linear_and_reaches_lr_on_its_last_step():
    o = cfg(lr_decay_style="constant")
    assert [lr_at(s, o, 100) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_decays_to_min_lr_by_hand():
    o = cfg(lr_decay_iters=14)
    assert lr_at(4, o, 100) == pytest.approx(1.0)  # ratio 0
    assert lr_at(9, o, 100) == pytest.approx(0.1 + 0.9 * 0.5)  # ratio 1/2: cos = 0
    assert lr_at(6, o, 100) == pytest.approx(0.1 + 0.9 * 0.5 * (math.cos(math.pi * 0.2) + 1))
    assert lr_at(14, o, 100) == lr_at(50, o, 100) == 0.1


def test_linear_decay_and_default_decay_iters():
    o = cfg(lr_decay_style="linear")  # decays over train_iters = 24
    assert lr_at(14, o, 24) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_at(19, o, 24) == pytest.approx(0.1 + 0.9 * 0.25)
    assert lr_at(24, o, 24) == 0.1


def test_no_warmup_starts_at_peak():
    o = cfg(lr_warmup_iters=0)
    assert lr_at(0, o, 10) == 1.0
    assert lr_at(5, o, 10) == pytest.approx(0.55)
