"""The run's progress as Megatron counts it, in samples: pure arithmetic (no torch), checked by
`shape.validate()` before any process group exists and read by the trainer and the optimizer.

- **Iterations.** `--train-iters N`, or `--train-samples S`: S // G iterations, or with a
  growing batch as many as Megatron's `update_train_iters` counts.
- **A growing batch** (`batch_plan`): `--rampup-batch-size START INCR SAMPLES` starts the global
  batch at START and grows it by INCR every SAMPLES / ((G - START) / INCR) consumed samples
  until it is G, as megatron-core's RampupBatchsizeNumMicroBatchesCalculator;
  `--step-batch-size-schedule "THRESHOLD:SIZE ..."` sets it by consumed tokens, as Megatron-LM
  main's StepBatchsizeNumMicroBatchesCalculator. Every size must split into whole micro-batches
  over the data-parallel ranks; the trainer runs each step's own micro-batch count.
- **Learning rate and weight decay** (`LRSchedule`): megatron-core's OptimizerParamScheduler.
  Its position counts the samples of the *successful* steps (a skipped step does not advance
  it); iteration-based flags are converted to samples (iters x G), so both kinds of run share
  one formula. Warmup climbs from --lr-warmup-init at position 0 to --lr at the warmup's end,
  then constant, linear, cosine, inverse-square-root or WSD (constant, then an annealing phase
  of --lr-wsd-decay-* in the --lr-wsd-decay-style) reaching --min-lr at the decay's end.
  --decoupled-lr / --decoupled-min-lr give the embedding and output layer their own peak and
  floor. Weight decay stays --weight-decay, or runs from --start-weight-decay to
  --end-weight-decay over the run (--weight-decay-incr-style linear or cosine).
"""

import math
from dataclasses import dataclass

from megalite.config import Config, TrainingConfig

DEFAULT_TRAIN_ITERS = 20  # when neither --train-iters nor --train-samples is given


@dataclass(frozen=True)
class RampUp:
    """--rampup-batch-size START INCR SAMPLES towards the global batch size `final`."""

    start: int
    increment: int
    samples: int
    final: int

    def batch_size(self, consumed: int) -> int:
        """The global batch size of the step that starts after `consumed` samples."""
        if consumed > self.samples:
            return self.final
        per_increment = self.samples / ((self.final - self.start) // self.increment)
        return self.start + int(consumed / per_increment) * self.increment

    def sizes(self) -> list[int]:
        """Every batch size the ramp-up passes through, START to the final size."""
        return list(range(self.start, self.final + 1, self.increment))


@dataclass(frozen=True)
class StepSizes:
    """--step-batch-size-schedule "THRESHOLD:SIZE ...": the global batch is SIZE from THRESHOLD
    tokens on (Megatron-LM's StepBatchsizeNumMicroBatchesCalculator; its training passes the
    sequence length, so thresholds count tokens: K, M, B, T suffixes), as (first sample, size)."""

    steps: tuple

    def batch_size(self, consumed: int) -> int:
        size = self.steps[0][1]
        for threshold, s in self.steps:
            if consumed < threshold:
                break
            size = s
        return size

    def sizes(self) -> list[int]:
        return sorted({s for _, s in self.steps})


def _count(text: str) -> int:
    """A threshold or size of a step schedule: 2.4K, 250B, 16 (Megatron's parse)."""
    text = text.strip().upper()
    scale = {"T": 10**12, "B": 10**9, "M": 10**6, "K": 10**3}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def step_sizes(text: str, seq_length: int) -> StepSizes:
    """The parsed schedule, or ValueError naming what is wrong with it."""
    steps = []
    for entry in text.strip().replace(",", " ").split():
        if ":" not in entry:
            raise ValueError(f'entry "{entry}" is not THRESHOLD:BATCH_SIZE')
        threshold, size = entry.split(":", 1)
        steps.append((_count(threshold) // seq_length, _count(size)))
    steps.sort(key=lambda x: x[0])
    if not steps or steps[0][0] != 0:
        raise ValueError("its first threshold must be 0")
    if any(a[0] >= b[0] for a, b in zip(steps, steps[1:])):
        raise ValueError(f"its thresholds (in samples of {seq_length} tokens) must increase")
    if any(size < 1 for _, size in steps):
        raise ValueError("its batch sizes must be positive")
    return StepSizes(tuple(steps))


def batch_plan(t: TrainingConfig, seq_length: int) -> RampUp | StepSizes | None:
    """How the global batch grows (--rampup-batch-size, --step-batch-size-schedule), or None."""
    if t.step_batch_size_schedule is not None:
        return step_sizes(t.step_batch_size_schedule, seq_length)
    r = t.rampup_batch_size
    return None if r is None else RampUp(r[0], r[1], r[2], t.global_batch_size)


def batch_size(t: TrainingConfig, seq_length: int, consumed: int) -> int:
    """The global batch size of the step after `consumed` samples (constant without a plan)."""
    plan = batch_plan(t, seq_length)
    return t.global_batch_size if plan is None else plan.batch_size(consumed)


def batch_sizes(t: TrainingConfig, seq_length: int) -> list[int]:
    """Every global batch size the run steps with."""
    plan = batch_plan(t, seq_length)
    return [t.global_batch_size] if plan is None else plan.sizes()


def train_iters(t: TrainingConfig, seq_length: int) -> int:
    """The run's optimizer steps: --train-iters, else counted from --train-samples (Megatron's
    update_train_iters: a ramp-up's partial last batch dropped, a step schedule's kept)."""
    if t.train_samples is None:
        return DEFAULT_TRAIN_ITERS if t.train_iters is None else t.train_iters
    plan = batch_plan(t, seq_length)
    if plan is None:
        return t.train_samples // t.global_batch_size
    iterations = consumed = 0
    if isinstance(plan, StepSizes):
        while consumed < t.train_samples:
            consumed += plan.batch_size(consumed)
            iterations += 1
        return iterations
    while consumed <= plan.samples and consumed <= t.train_samples:  # the ramp-up's steps
        consumed += plan.batch_size(consumed)
        iterations += 1
    if t.train_samples > consumed:  # then whole batches of the final size
        iterations += (t.train_samples - consumed) // t.global_batch_size
    return iterations


@dataclass(frozen=True)
class Rates:
    """What one optimizer step uses: the learning rate, the weight decay (of the parameters it
    applies to), and the learning rate of the embedding and output layer."""

    lr: float
    weight_decay: float
    embedding_lr: float


@dataclass(frozen=True)
class LRSchedule:
    """megatron-core's OptimizerParamScheduler as a function of its position (samples of the
    successful steps so far); every length is in samples."""

    lr: float
    min_lr: float
    init_lr: float
    warmup: float  # a fraction of the decay may make it fractional, as in Megatron
    decay: int
    style: str
    wsd_decay: int | None
    wsd_style: str
    start_wd: float
    end_wd: float
    wd_incr: int
    wd_style: str
    decoupled_lr: float | None = None
    decoupled_min_lr: float | None = None

    @classmethod
    def from_config(cls, cfg: Config) -> "LRSchedule":
        o, t = cfg.optimizer, cfg.training
        g, iters = t.global_batch_size, train_iters(t, cfg.model.seq_length)
        if t.train_samples is None:  # iteration-based: Megatron's lengths times G
            decay = (iters if o.lr_decay_iters is None else o.lr_decay_iters) * g
            wd_incr = iters * g
            wsd = None if o.lr_wsd_decay_iters is None else o.lr_wsd_decay_iters * g
            warmup = o.lr_warmup_iters * g
        else:
            decay = t.train_samples if o.lr_decay_samples is None else o.lr_decay_samples
            wd_incr = t.train_samples
            wsd, warmup = o.lr_wsd_decay_samples, o.lr_warmup_samples
        if o.lr_warmup_fraction is not None:
            warmup = o.lr_warmup_fraction * decay
        constant = o.weight_decay_incr_style == "constant"
        return cls(
            lr=o.lr, min_lr=o.min_lr, init_lr=o.lr_warmup_init, warmup=warmup, decay=decay,
            style=o.lr_decay_style, wsd_decay=wsd, wsd_style=o.lr_wsd_decay_style,
            start_wd=o.weight_decay if constant else o.start_weight_decay,
            end_wd=o.weight_decay if constant else o.end_weight_decay,
            wd_incr=wd_incr, wd_style=o.weight_decay_incr_style,
            decoupled_lr=o.decoupled_lr, decoupled_min_lr=o.decoupled_min_lr,
        )  # fmt: skip

    def rates(self, position: int) -> Rates:
        lr = self.lr_at(position, self.lr, self.min_lr)
        if self.decoupled_lr is None:
            embedding = lr
        else:
            floor = self.min_lr if self.decoupled_min_lr is None else self.decoupled_min_lr
            embedding = self.lr_at(position, self.decoupled_lr, floor)
        return Rates(lr, self.wd_at(position), embedding)

    def lr_at(self, n: int, max_lr: float, min_lr: float) -> float:
        if self.warmup > 0 and n <= self.warmup:  # linear from init_lr, max_lr at its end
            return self.init_lr + (max_lr - self.init_lr) * float(n) / float(self.warmup)
        if self.style == "constant":
            return max_lr
        if n > self.decay:
            return min_lr
        if self.style == "inverse-square-root":
            return max(min_lr, max_lr * max(self.warmup, 1) ** 0.5 / max(n, 1) ** 0.5)
        ratio = float(n - self.warmup) / float(self.decay - self.warmup)
        if self.style == "linear":
            coeff = 1.0 - ratio
        elif self.style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD: constant until the annealing phase, the last wsd_decay samples
            coeff = 1.0 if n <= self.decay - self.wsd_decay else _anneal(
                self.wsd_style, float(n - (self.decay - self.wsd_decay)) / float(self.wsd_decay)
            )  # fmt: skip
        return min_lr + coeff * (max_lr - min_lr)

    def wd_at(self, n: int) -> float:
        if n > self.wd_incr or self.wd_style == "constant":
            return self.end_wd
        ratio = float(n) / float(self.wd_incr)
        if self.wd_style == "linear":
            coeff = ratio
        else:  # cosine
            coeff = 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)


def _anneal(style: str, r: float) -> float:
    """WSD's annealing coefficient at the fraction r of its phase."""
    if style == "linear":
        return 1.0 - r
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * r) + 1.0)
    if style == "exponential":
        return 2.0 * math.pow(0.5, r) - 1.0
    return 1.0 - math.sqrt(r)  # minus_sqrt


def problem(cfg: Config, data: int) -> str | None:
    """Why these schedule flags cannot run (Megatron's checks), or None; `data`: the ranks the
    batch is split over."""
    o, t = cfg.optimizer, cfg.training
    by_samples = t.train_samples is not None
    if by_samples and t.train_iters is not None:
        return "give one of --train-iters and --train-samples, not both"
    if by_samples and t.train_samples < 1:
        return f"--train-samples={t.train_samples} must be a positive integer"
    wrong = (
        [("--lr-warmup-iters", o.lr_warmup_iters), ("--lr-decay-iters", o.lr_decay_iters),
         ("--lr-wsd-decay-iters", o.lr_wsd_decay_iters)] if by_samples
        else [("--lr-warmup-samples", o.lr_warmup_samples),
              ("--lr-decay-samples", o.lr_decay_samples),
              ("--lr-wsd-decay-samples", o.lr_wsd_decay_samples)]
    )  # fmt: skip
    for flag, value in wrong:
        if value:
            kind = (
                "--train-samples: use the -samples"
                if by_samples
                else "--train-iters: use the -iters"
            )
            return f"{flag} does not go with {kind} form of the flag"
    warmup = o.lr_warmup_samples if by_samples else o.lr_warmup_iters
    if o.lr_warmup_fraction is not None and warmup:
        return "give one of --lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples"
    if o.lr_warmup_fraction is not None and not 0 <= o.lr_warmup_fraction < 1:
        return f"--lr-warmup-fraction={o.lr_warmup_fraction} must be in [0, 1)"
    if t.rampup_batch_size is not None:
        reason = _rampup_problem(cfg, data, by_samples)
        if reason:
            return reason
    if t.step_batch_size_schedule is not None:
        reason = _steps_problem(cfg, data)
        if reason:
            return reason
    if train_iters(t, cfg.model.seq_length) < 1:
        return f"--train-samples={t.train_samples} is less than one global batch"
    if not 0 <= o.lr_warmup_init <= o.lr:
        return f"--lr-warmup-init={o.lr_warmup_init} must be in [0, lr={o.lr}]"
    if o.decoupled_lr is None and o.decoupled_min_lr is not None:
        return "--decoupled-min-lr needs --decoupled-lr"
    if o.decoupled_lr is not None:
        floor = o.min_lr if o.decoupled_min_lr is None else o.decoupled_min_lr
        if not 0 <= floor <= o.decoupled_lr:
            return f"--decoupled-lr={o.decoupled_lr} must be at least its minimum {floor} >= 0"
        if o.lr_warmup_init > o.decoupled_lr:
            return f"--lr-warmup-init={o.lr_warmup_init} exceeds --decoupled-lr={o.decoupled_lr}"
    s = LRSchedule.from_config(cfg)
    if s.decay <= 0:
        return "the learning-rate decay must be at least one step (--lr-decay-iters/-samples)"
    # A decay set shorter than its warmup is Megatron's error; a short run of a preset whose
    # warmup outlasts it (--train-iters 2) stays in warmup, as megalite always allowed.
    decay_given = o.lr_decay_samples if by_samples else o.lr_decay_iters
    if decay_given and s.warmup >= s.decay:
        return (f"the warmup ({s.warmup:g} samples) must be shorter than the learning-rate decay "
                f"({s.decay} samples, --lr-decay-iters/-samples)")  # fmt: skip
    if o.lr_decay_style == "WSD":
        if s.wsd_decay is None:
            return "--lr-decay-style WSD needs --lr-wsd-decay-iters (or -samples) for its annealing"
        if not 0 < s.wsd_decay <= s.decay:
            return f"the WSD annealing ({s.wsd_decay} samples) must be in (0, the decay {s.decay}]"
    if o.weight_decay_incr_style == "constant":
        if o.start_weight_decay is not None or o.end_weight_decay is not None:
            return ("--start-weight-decay/--end-weight-decay need --weight-decay-incr-style "
                    "linear or cosine (constant uses --weight-decay)")  # fmt: skip
    elif o.start_weight_decay is None or o.end_weight_decay is None:
        return (f"--weight-decay-incr-style {o.weight_decay_incr_style} needs "
                "--start-weight-decay and --end-weight-decay")  # fmt: skip
    elif not 0 <= o.start_weight_decay <= o.end_weight_decay:
        return "--end-weight-decay must be at least --start-weight-decay (and both >= 0)"
    return None


def _rampup_problem(cfg: Config, data: int, by_samples: bool) -> str | None:
    t = cfg.training
    start, incr, samples = t.rampup_batch_size
    if not by_samples:
        return "--rampup-batch-size needs sample-based training: --train-samples, not --train-iters"
    if start < 1 or incr < 1 or samples < 1:
        return f"--rampup-batch-size {start} {incr} {samples}: each value must be positive"
    diff = t.global_batch_size - start
    if diff <= 0 or diff % incr:
        return (f"--rampup-batch-size {start} {incr} {samples}: the start must be below "
                f"--global-batch-size {t.global_batch_size} by a multiple of the increment")  # fmt: skip
    unit = t.micro_batch_size * data
    for size in batch_sizes(t, cfg.model.seq_length):
        if size % unit:
            return (f"--rampup-batch-size: global batch {size} is not divisible by micro-batch "
                    f"size {t.micro_batch_size} x data-parallel size {data} = {unit}")  # fmt: skip
    return None


def _steps_problem(cfg: Config, data: int) -> str | None:
    t, flag = cfg.training, "--step-batch-size-schedule"
    if t.rampup_batch_size is not None:
        return f"give one of --rampup-batch-size and {flag}, not both"
    try:
        plan = step_sizes(t.step_batch_size_schedule, cfg.model.seq_length)
    except ValueError as e:
        return f'{flag} "{t.step_batch_size_schedule}": {e}'
    if plan.steps[-1][1] != t.global_batch_size:
        return (f"{flag}'s last batch size {plan.steps[-1][1]} must be --global-batch-size "
                f"({t.global_batch_size}): the run's full batch")  # fmt: skip
    unit = t.micro_batch_size * data
    for size in plan.sizes():
        if size % unit:
            return (f"{flag}: global batch {size} is not divisible by micro-batch size "
                    f"{t.micro_batch_size} x data-parallel size {data} = {unit}")  # fmt: skip
    return None
