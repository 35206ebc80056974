"""megalite's schedule, loss scaler and batch ramp-up against megatron-core 0.16.1's own classes,
side by side over a whole run, every step compared exactly: OptimizerParamScheduler (learning
rate of both parameter groups and weight decay), DynamicGradScaler / ConstantGradScaler and
RampupBatchsizeNumMicroBatchesCalculator. The Megatron objects are built as Megatron-LM's
training.py builds them from its flags (get_optimizer_param_scheduler, update_train_iters,
train_step's `increment`); megatron-core's classes run unchanged (the scaler on CPU: its module's
`torch.tensor` gets no device)."""

import importlib.util
import random
import subprocess
import types
from pathlib import Path

import pytest
import torch

from megalite import lr_schedule
from megalite.config import Config
from megalite.optim.loss_scaler import ConstantLossScaler, LossScaler, scaler_for

mc_sched = pytest.importorskip("megatron.core.optimizer_param_scheduler")
mc_calc = pytest.importorskip("megatron.core.num_microbatches_calculator")
mc_scaler = pytest.importorskip("megatron.core.optimizer.grad_scaler")


def config(t: dict, o: dict) -> Config:
    cfg = Config()
    for k, v in t.items():
        setattr(cfg.training, k, v)
    for k, v in o.items():
        setattr(cfg.optimizer, k, v)
    assert lr_schedule.problem(cfg, data=1) is None
    return cfg


class Args:
    """Megatron-LM's args after validate_args, from megalite's config (None where unset)."""

    def __init__(self, cfg: Config):
        t, o = cfg.training, cfg.optimizer
        self.__dict__.update(
            train_iters=t.train_iters, train_samples=t.train_samples,
            global_batch_size=t.global_batch_size, rampup_batch_size=t.rampup_batch_size,
            micro_batch_size=t.micro_batch_size, lr=o.lr, min_lr=o.min_lr,
            lr_warmup_init=o.lr_warmup_init, lr_warmup_iters=o.lr_warmup_iters,
            lr_warmup_samples=o.lr_warmup_samples, lr_warmup_fraction=o.lr_warmup_fraction,
            lr_decay_iters=o.lr_decay_iters, lr_decay_samples=o.lr_decay_samples,
            lr_decay_style=o.lr_decay_style, lr_wsd_decay_style=o.lr_wsd_decay_style,
            lr_wsd_decay_iters=o.lr_wsd_decay_iters, lr_wsd_decay_samples=o.lr_wsd_decay_samples,
            weight_decay_incr_style=o.weight_decay_incr_style,
            # validate_args: constant style takes --weight-decay for both ends
            start_weight_decay=o.weight_decay if o.weight_decay_incr_style == "constant"
            else o.start_weight_decay,
            end_weight_decay=o.weight_decay if o.weight_decay_incr_style == "constant"
            else o.end_weight_decay,
        )  # fmt: skip


def megatron_train_iters(args, calculator) -> int:
    """Megatron-LM's update_train_iters (before its step-schedule rewrite), over core's
    calculator."""
    if args.train_iters:
        return args.train_iters
    if args.rampup_batch_size is None:
        return args.train_samples // args.global_batch_size
    iterations = consumed = 0
    while consumed <= int(args.rampup_batch_size[2]) and consumed <= args.train_samples:
        calculator.update(consumed, consistency_check=False)
        consumed += calculator.get_current_global_batch_size()
        iterations += 1
    calculator.update(0, consistency_check=False)
    if args.train_samples > consumed:
        iterations += (args.train_samples - consumed) // args.global_batch_size
    return iterations


def megatron_scheduler(args, groups):
    """Megatron-LM's get_optimizer_param_scheduler over an optimizer of `groups`."""
    if args.train_iters:
        decay_iters = args.lr_decay_iters or args.train_iters
        decay = decay_iters * args.global_batch_size
        wd_incr = args.train_iters * args.global_batch_size
        wsd = None
        if args.lr_wsd_decay_iters is not None:
            wsd = args.lr_wsd_decay_iters * args.global_batch_size
        warmup = (args.lr_warmup_fraction * decay if args.lr_warmup_fraction is not None
                  else args.lr_warmup_iters * args.global_batch_size)  # fmt: skip
    else:
        decay = args.lr_decay_samples or args.train_samples
        wd_incr, wsd = args.train_samples, args.lr_wsd_decay_samples
        warmup = (args.lr_warmup_fraction * decay if args.lr_warmup_fraction is not None
                  else args.lr_warmup_samples)  # fmt: skip
    return mc_sched.OptimizerParamScheduler(
        types.SimpleNamespace(param_groups=groups), init_lr=args.lr_warmup_init,
        max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=warmup, lr_decay_steps=decay,
        lr_decay_style=args.lr_decay_style, start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay, wd_incr_steps=wd_incr,
        wd_incr_style=args.weight_decay_incr_style, wsd_decay_steps=wsd,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
    )  # fmt: skip


def calculator(args, dp: int = 1):
    if args.rampup_batch_size is None:
        return mc_calc.ConstantNumMicroBatchesCalculator(
            args.global_batch_size, args.micro_batch_size, dp, False, 0
        )
    start, incr, samples = args.rampup_batch_size
    return mc_calc.RampupBatchsizeNumMicroBatchesCalculator(
        args.global_batch_size, args.micro_batch_size, dp, False, 0, start, incr, samples
    )


CASES = {
    "iters-cosine": ({"train_iters": 40, "global_batch_size": 8},
                     {"lr": 3e-4, "min_lr": 3e-5, "lr_warmup_iters": 6}),
    "iters-linear-fraction-decay-ends-early": (
        {"train_iters": 40, "global_batch_size": 12},
        {"lr": 1e-3, "min_lr": 1e-5, "lr_decay_style": "linear", "lr_warmup_fraction": 0.13,
         "lr_decay_iters": 25}),
    "iters-constant-warmup-init": ({"train_iters": 20, "global_batch_size": 4},
                                   {"lr": 2e-4, "lr_decay_style": "constant",
                                    "lr_warmup_iters": 5, "lr_warmup_init": 1e-5}),
    "iters-inverse-square-root": ({"train_iters": 50, "global_batch_size": 6},
                                  {"lr": 1e-3, "min_lr": 1e-4, "lr_warmup_iters": 7,
                                   "lr_decay_style": "inverse-square-root"}),
    "iters-wsd-exponential": ({"train_iters": 60, "global_batch_size": 8},
                              {"lr": 1e-3, "min_lr": 1e-5, "lr_warmup_iters": 5,
                               "lr_decay_style": "WSD", "lr_wsd_decay_iters": 17}),
    "samples-cosine": ({"train_samples": 1000, "global_batch_size": 16},
                       {"lr": 6e-4, "min_lr": 6e-5, "lr_warmup_samples": 100,
                        "lr_decay_samples": 800}),
    "samples-fraction": ({"train_samples": 999, "global_batch_size": 8},
                         {"lr": 6e-4, "min_lr": 0.0, "lr_warmup_fraction": 0.07}),
    "samples-wsd-linear": ({"train_samples": 800, "global_batch_size": 8},
                           {"lr": 1e-3, "min_lr": 1e-4, "lr_warmup_samples": 40,
                            "lr_decay_style": "WSD", "lr_wsd_decay_style": "linear",
                            "lr_wsd_decay_samples": 300}),
    "samples-wsd-cosine": ({"train_samples": 800, "global_batch_size": 8},
                           {"lr": 1e-3, "lr_decay_style": "WSD", "lr_wsd_decay_style": "cosine",
                            "lr_wsd_decay_samples": 333, "lr_warmup_fraction": 0.05}),
    "samples-wsd-minus-sqrt": ({"train_samples": 640, "global_batch_size": 8},
                               {"lr": 1e-3, "min_lr": 2e-5, "lr_decay_style": "WSD",
                                "lr_wsd_decay_style": "minus_sqrt", "lr_wsd_decay_samples": 200}),
    "samples-inverse-square-root": ({"train_samples": 700, "global_batch_size": 10},
                                    {"lr": 1e-3, "min_lr": 1e-4, "lr_warmup_samples": 55,
                                     "lr_decay_style": "inverse-square-root"}),
    "iters-wd-linear-decoupled": (
        {"train_iters": 30, "global_batch_size": 8},
        {"lr": 3e-4, "min_lr": 3e-5, "lr_warmup_iters": 3, "weight_decay_incr_style": "linear",
         "start_weight_decay": 0.01, "end_weight_decay": 0.1, "decoupled_lr": 5e-4,
         "decoupled_min_lr": 1e-5}),
    "samples-wd-cosine-decoupled-no-min": (
        {"train_samples": 480, "global_batch_size": 8},
        {"lr": 3e-4, "min_lr": 3e-5, "lr_warmup_samples": 40, "weight_decay_incr_style": "cosine",
         "start_weight_decay": 0.0, "end_weight_decay": 0.2, "decoupled_lr": 1e-4,
         "lr_decay_style": "linear"}),
    "samples-rampup": ({"train_samples": 2000, "global_batch_size": 32, "micro_batch_size": 2,
                        "rampup_batch_size": [8, 8, 500]},
                       {"lr": 3e-4, "min_lr": 3e-5, "lr_warmup_samples": 300,
                        "weight_decay_incr_style": "linear", "start_weight_decay": 0.0,
                        "end_weight_decay": 0.1}),
    "samples-rampup-fraction-wsd": (
        {"train_samples": 1500, "global_batch_size": 24, "micro_batch_size": 1,
         "rampup_batch_size": [4, 4, 777]},
        {"lr": 1e-3, "min_lr": 1e-4, "lr_warmup_fraction": 0.1, "lr_decay_style": "WSD",
         "lr_wsd_decay_samples": 400, "decoupled_lr": 2e-3}),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_schedule_matches_megatron_core_step_for_step(case):
    """Every step of the run (plus the steps a skip pattern shifts): megalite's rates at its
    position equal megatron-core's lr of the default and the decoupled (embedding/output)
    group and its weight decay, as Megatron's train_step advances it by the step's global
    batch on successful steps only; the batch sizes and the run's length agree too."""
    cfg = config(*CASES[case])
    args = Args(cfg)
    groups = [{}, {"max_lr": cfg.optimizer.decoupled_lr, "min_lr": cfg.optimizer.decoupled_min_lr}]
    if cfg.optimizer.decoupled_lr is None:
        groups = groups[:1]
    elif cfg.optimizer.decoupled_min_lr is None:
        del groups[1]["min_lr"]
    calc = calculator(args)
    iters = megatron_train_iters(args, calc)
    assert lr_schedule.train_iters(cfg.training, 1) == iters
    ref = megatron_scheduler(args, groups)
    mine = lr_schedule.LRSchedule.from_config(cfg)
    skips = random.Random(case).sample(range(iters), k=3)  # steps whose update is skipped
    consumed = position = 0
    for step in range(iters):
        calc.update(consumed, consistency_check=True)
        g = calc.get_current_global_batch_size()
        assert lr_schedule.batch_size(cfg.training, 1, consumed) == g, step
        rates = mine.rates(position)
        assert rates.lr == groups[0]["lr"], step
        assert rates.weight_decay == groups[0]["weight_decay"], step
        assert rates.embedding_lr == groups[-1]["lr"], step
        if step not in skips:  # train_step: the scheduler moves on successful steps only
            ref.step(increment=calc.get() * args.micro_batch_size * 1)
            position += g
        consumed += g
    assert mine.rates(position).lr == groups[0]["lr"]


def test_rampup_microbatch_counts_match_megatron_core_at_dp():
    """Ramp-up over dp=4: each step's global batch and micro-batch count as core's calculator
    with its consistency check on, and megalite's validate() refuses a ramp-up whose size
    does not split over micro-batch size x dp."""
    cfg = config({"train_samples": 5000, "global_batch_size": 64, "micro_batch_size": 2,
                  "rampup_batch_size": [16, 8, 1000]}, {})  # fmt: skip
    calc = calculator(Args(cfg), dp=4)
    consumed = 0
    while consumed < 5000:
        calc.update(consumed, consistency_check=True)
        g = lr_schedule.batch_size(cfg.training, 1, consumed)
        assert g == calc.get_current_global_batch_size()
        assert g // (2 * 4) == calc.get()
        consumed += g
    cfg.training.rampup_batch_size = [12, 4, 1000]  # 12 does not split over 2 x 4
    assert "not divisible by micro-batch size 2 x data-parallel size 4" in lr_schedule.problem(
        cfg, data=4
    )


@pytest.fixture
def cpu_scaler(monkeypatch):
    """megatron-core's grad_scaler module, its tensors made without device='cuda'."""

    def tensor(data, dtype=None, device=None):
        return torch.tensor(data, dtype=dtype)

    shim = types.SimpleNamespace(tensor=tensor, max=torch.max, float=torch.float)
    monkeypatch.setattr(mc_scaler, "torch", shim)
    return mc_scaler


@pytest.mark.parametrize("initial,window,hysteresis,min_scale", [
    (2.0**32, 1000, 2, 1.0), (2.0**16, 7, 1, 4.0), (1000.0, 5, 3, 0.25),
])  # fmt: skip
def test_dynamic_loss_scaler_matches_megatron_core(cpu_scaler, initial, window, hysteresis,
                                                   min_scale):  # fmt: skip
    """Built from the flags as megatron-core's optimizer builds it (growth 2, backoff 0.5):
    the same scale, growth and hysteresis counters after every step of an overflow pattern
    (bursts, lone spikes, long clean runs that grow the scale)."""
    cfg = Config()
    cfg.training.fp16 = True
    o = cfg.optimizer
    o.initial_loss_scale, o.loss_scale_window, o.hysteresis = initial, window, hysteresis
    o.min_loss_scale = min_scale
    mine = scaler_for(cfg.training.precision, o)
    assert isinstance(mine, LossScaler)
    ref = cpu_scaler.DynamicGradScaler(initial_scale=initial, min_scale=min_scale,
                                       growth_factor=2.0, backoff_factor=0.5,
                                       growth_interval=window, hysteresis=hysteresis)  # fmt: skip
    rng = random.Random(window)
    pattern = [rng.random() < 0.3 for _ in range(300)] + [True] * 40 + [False] * (2 * window + 3)
    pattern += [rng.random() < 0.05 for _ in range(300)]
    for k, found_inf in enumerate(pattern):
        mine.update(found_inf)
        ref.update(found_inf)
        assert mine.scale == ref.scale.item(), k
        assert (mine.good_steps, mine.hysteresis_left) == (
            ref._growth_tracker, ref._hysteresis_tracker), k  # fmt: skip


def test_static_loss_scale_is_megatron_cores_constant_scaler(cpu_scaler):
    """--loss-scale S (fp16 or bf16): never adjusted, as ConstantGradScaler; without it bf16
    has no scaler and fp16 the dynamic one with Megatron's initial 2^32."""
    cfg = Config()
    cfg.training.bf16 = True
    assert scaler_for(cfg.training.precision, cfg.optimizer) is None
    cfg.optimizer.loss_scale = 1024.0
    mine = scaler_for(cfg.training.precision, cfg.optimizer)
    ref = cpu_scaler.ConstantGradScaler(1024.0)
    assert isinstance(mine, ConstantLossScaler)
    for found_inf in [True, True, True, False] * 5:
        mine.update(found_inf)
        ref.update(found_inf)
        assert mine.scale == ref.scale.item() == 1024.0
    fp16 = Config()
    fp16.training.fp16 = True
    assert scaler_for("fp16", fp16.optimizer).scale == 2.0**32


MIRROR = Path("/work/.mirror/NVIDIA+Megatron-LM/repo")


@pytest.fixture(scope="module")
def megatron_lm(tmp_path_factory):
    """Megatron-LM's own num_microbatches_calculator.py (main, with the step schedule that
    megatron-core 0.16.1 lacks), read from the fetched Megatron-LM repository."""
    try:
        text = subprocess.run(["git", "-C", str(MIRROR), "show",
                               "HEAD:megatron/core/num_microbatches_calculator.py"],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("Megatron-LM's source is not fetched here (the step schedule's oracle)")
    path = tmp_path_factory.mktemp("megatron_lm") / "megatron_lm_calculators.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("megatron_lm_calculators", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("schedule,train_samples", [
    ("0:8 2.4K:16", 400),  # examples/gpt3's, scaled (seq 64: 2400 tokens are sample 37)
    ("0:4, 1K:8 3.3K:12 5K:24", 700),
    ("0:24", 100),
])  # fmt: skip
def test_step_batch_size_schedule_matches_megatron_lm(megatron_lm, schedule, train_samples):
    """--step-batch-size-schedule (thresholds in tokens, as Megatron-LM's training passes the
    sequence length): each step's global batch and micro-batch count as Megatron-LM's
    StepBatchsizeNumMicroBatchesCalculator, the run's length as its update_train_iters, and the
    lr schedule then still megatron-core's."""
    mlm = megatron_lm
    last = int(schedule.split(":")[-1])
    cfg = config({"train_samples": train_samples, "global_batch_size": last,
                  "micro_batch_size": 2, "step_batch_size_schedule": schedule},
                 {"lr_warmup_fraction": 0.1, "lr_decay_style": "linear"})  # fmt: skip
    cfg.model.seq_length = 64
    assert lr_schedule.problem(cfg, data=2) is None
    calc = mlm.StepBatchsizeNumMicroBatchesCalculator(2, 2, False, 0, schedule, seq_length=64)
    iterations = consumed = 0  # update_train_iters with a step schedule
    while consumed < train_samples:
        calc.update(consumed, consistency_check=False)
        consumed += calc.get_current_global_batch_size()
        iterations += 1
    assert lr_schedule.train_iters(cfg.training, 64) == iterations
    args = Args(cfg)
    groups = [{}]
    ref, mine = megatron_scheduler(args, groups), lr_schedule.LRSchedule.from_config(cfg)
    consumed = 0
    for step in range(iterations):
        calc.update(consumed, consistency_check=True)
        g = lr_schedule.batch_size(cfg.training, 64, consumed)
        assert g == calc.get_current_global_batch_size() and g // 4 == calc.get(), step
        assert mine.rates(consumed).lr == groups[0]["lr"], step
        ref.step(increment=calc.get() * 2 * 2)
        consumed += g
    cfg.training.global_batch_size = 8
    if last != 8:
        assert "must be --global-batch-size (8)" in lr_schedule.problem(cfg, data=2)
