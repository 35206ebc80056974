"""Learning-rate schedule: linear warmup, then cosine / linear / constant decay to min_lr."""

import math

from megalite.config import OptimizerConfig


def lr_at(step: int, o: OptimizerConfig, train_iters: int) -> float:
    """The learning rate of optimizer step `step` (0 for the first step).

    Warmup climbs linearly over `lr_warmup_iters` steps and reaches `lr` on its last step (so the
    first step is not wasted at lr 0). Decay then runs Megatron's formulas on the ratio
    (step - warmup) / (decay_iters - warmup), reaching `min_lr` at step `lr_decay_iters`
    (default `train_iters`) and staying there.
    """
    warmup = o.lr_warmup_iters
    decay_iters = o.lr_decay_iters if o.lr_decay_iters is not None else train_iters
    if step < warmup:
        return o.lr * (step + 1) / warmup
    if o.lr_decay_style == "constant":
        return o.lr
    if step >= decay_iters:
        return o.min_lr
    ratio = (step - warmup) / (decay_iters - warmup)
    if o.lr_decay_style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    elif o.lr_decay_style == "linear":
        coeff = 1.0 - ratio
    else:
        raise ValueError(f"unknown lr_decay_style {o.lr_decay_style!r}")
    return o.min_lr + coeff * (o.lr - o.min_lr)
