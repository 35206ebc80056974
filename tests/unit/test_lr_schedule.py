"""megalite/lr_schedule.py by hand (tests/unit/test_megatron_schedule.py checks it against
megatron-core over whole runs): Megatron's warmup, decay and position in samples, and the flag
combinations validate() refuses."""

import math

import pytest

from megalite.config import Config
from megalite.errors import MegaliteError
from megalite.lr_schedule import LRSchedule, batch_size, train_iters
from megalite.shape import validate


def cfg(t=None, **o):
    c = Config()
    c.training.global_batch_size, c.training.train_iters = 8, 100
    for k, v in (t or {}).items():
        setattr(c.training, k, v)
    for k, v in {"lr": 1.0, "min_lr": 0.1, "lr_warmup_iters": 4, **o}.items():
        setattr(c.optimizer, k, v)
    return c


def lrs(c, steps):
    s = LRSchedule.from_config(c)
    return [s.rates(k * c.training.global_batch_size).lr for k in steps]


def test_warmup_starts_at_warmup_init_and_reaches_lr_at_its_end():
    """Megatron's first step runs at --lr-warmup-init (0): the schedule's position is the
    samples of the steps before it."""
    assert lrs(cfg(lr_decay_style="constant"), range(6)) == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    c = cfg(lr_decay_style="constant", lr_warmup_init=0.2)
    assert lrs(c, [0, 2, 4]) == pytest.approx([0.2, 0.6, 1.0])


def test_cosine_decays_to_min_lr_by_hand():
    c = cfg(lr_decay_iters=14)
    assert lrs(c, [4]) == [1.0]  # ratio 0
    assert lrs(c, [9])[0] == pytest.approx(0.1 + 0.9 * 0.5)  # ratio 1/2: cos = 0
    assert lrs(c, [6])[0] == pytest.approx(0.1 + 0.9 * 0.5 * (math.cos(math.pi * 0.2) + 1))
    assert lrs(c, [14, 50]) == [0.1, 0.1]


def test_linear_decay_defaults_to_the_whole_run():
    c = cfg({"train_iters": 24}, lr_decay_style="linear")
    assert lrs(c, [14])[0] == pytest.approx(0.1 + 0.9 * 0.5)
    assert lrs(c, [24]) == [pytest.approx(0.1)]


def test_samples_and_iterations_give_the_same_schedule():
    """--train-samples 800 at G=8 is --train-iters 100: the same rates at every step."""
    a = cfg(lr_warmup_iters=10)
    b = cfg({"train_iters": None, "train_samples": 800}, lr_warmup_iters=0, lr_warmup_samples=80)
    assert train_iters(b.training, 1) == 100
    assert lrs(a, range(101)) == lrs(b, range(101))


def test_weight_decay_increments_and_decoupled_lr():
    c = cfg(weight_decay_incr_style="linear", start_weight_decay=0.0, end_weight_decay=0.1,
            decoupled_lr=2.0, decoupled_min_lr=0.5)  # fmt: skip
    s = LRSchedule.from_config(c)
    assert s.rates(400).weight_decay == pytest.approx(0.05)  # half the run
    assert s.rates(2 * 8).embedding_lr == 1.0  # half of the warmup to 2.0
    assert s.rates(10**6).embedding_lr == 0.5 and s.rates(10**6).lr == 0.1


def test_rampup_batch_sizes():
    c = cfg({"train_iters": None, "train_samples": 100, "rampup_batch_size": [2, 2, 30],
             "global_batch_size": 8})  # fmt: skip
    # 3 increments over 30 samples: one every 10
    assert [batch_size(c.training, 1, n) for n in (0, 9, 10, 19, 20, 30, 31)] == [
        2,
        2,
        4,
        4,
        6,
        8,
        8,
    ]
    # ramp-up steps at 2, 2, 2, 2, 2, 4, 4, 4, 6, 6 (to 32 samples), then (100 - 32) // 8
    assert train_iters(c.training, 1) == 10 + 8


@pytest.mark.parametrize("t,o,message", [
    ({"train_samples": 800}, {}, "one of --train-iters and --train-samples"),
    ({"train_iters": None, "train_samples": 800}, {}, "--lr-warmup-iters does not go with"),
    ({}, {"lr_warmup_samples": 8}, "--lr-warmup-samples does not go with --train-iters"),
    ({}, {"lr_warmup_fraction": 0.1}, "one of --lr-warmup-fraction"),
    ({}, {"lr_warmup_iters": 100, "lr_decay_iters": 50}, "must be shorter than the learning-rate"),
    ({}, {"lr_decay_style": "WSD"}, "WSD needs --lr-wsd-decay-iters"),
    ({}, {"start_weight_decay": 0.1}, "need --weight-decay-incr-style linear or cosine"),
    ({}, {"weight_decay_incr_style": "cosine"}, "needs --start-weight-decay"),
    ({}, {"decoupled_min_lr": 0.1}, "--decoupled-min-lr needs --decoupled-lr"),
    ({"rampup_batch_size": [2, 2, 10]}, {}, "needs sample-based training"),
    ({"train_iters": None, "train_samples": 800, "rampup_batch_size": [3, 2, 10]},
     {"lr_warmup_iters": 0}, "below --global-batch-size 8 by a multiple"),
    ({"bf16": True, "fp16": True}, {}, "one of --bf16 and --fp16"),
    ({"grad_reduce_in_bf16": True}, {}, "--grad-reduce-in-bf16 needs --bf16"),
    ({}, {"loss_scale": 8.0}, "--loss-scale=8.0 needs a positive scale and --fp16 or --bf16"),
])  # fmt: skip
def test_validate_refuses_in_one_line(t, o, message):
    with pytest.raises(MegaliteError, match=message.replace("(", r"\(")):
        validate(cfg(t, **o), 1)


def test_bf16_and_fp16_set_the_precision():
    from megalite.config_read import parse_args

    assert parse_args(["--bf16"]).training.precision == "bf16"
    assert parse_args(["--fp16", "--hysteresis", "3"]).training.precision == "fp16"
    assert validate(parse_args(["--train-samples", "64", "--lr-warmup-fraction", "0.1"]), 1)


def test_a_short_run_of_a_preset_stays_in_warmup():
    """--train-iters 2 of a preset with 10 warmup steps (the default decay: the whole run) is not
    refused: every step is a warmup step, as before Megatron's schedule landed."""
    c = cfg({"train_iters": 2}, lr_warmup_iters=10)
    assert validate(c, 1) is not None
    assert lrs(c, [0, 1, 2]) == pytest.approx([0.0, 0.1, 0.2])
