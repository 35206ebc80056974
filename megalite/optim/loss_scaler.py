"""Loss scaling for fp16: keep small gradients representable, back off on overflow (Megatron's
DynamicGradScaler), or a static scale (--loss-scale: its ConstantGradScaler). `scaler_for`
picks one from the flags; the optimizer unscales with it and the executor scales the loss."""


class LossScaler:
    """Megatron's dynamic grad scaler.

    An overflowing step (inf/nan gradient anywhere) is skipped and uses up one unit of
    `hysteresis`; when none is left the scale halves (never below `min_scale`). After `window`
    good steps in a row the scale doubles and the hysteresis is restored. Hysteresis lets a
    lone spike pass without giving up precision.
    """

    def __init__(
        self,
        initial: float = 2.0**16,
        window: int = 1000,
        min_scale: float = 1.0,
        hysteresis: int = 2,
        backoff: float = 0.5,
        growth: float = 2.0,
    ):
        self.scale = float(initial)
        self.window, self.min_scale, self.hysteresis = window, min_scale, hysteresis
        self.backoff, self.growth = backoff, growth
        self.good_steps = 0
        self.hysteresis_left = hysteresis

    def can_back_off(self) -> bool:
        """An overflow now is the scaler's to answer (the scale is not yet at its floor)."""
        return self.scale > self.min_scale

    def update(self, found_inf: bool):
        if found_inf:
            self.good_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff, self.min_scale)
            return
        self.good_steps += 1
        if self.good_steps == self.window:
            self.good_steps = 0
            self.hysteresis_left = self.hysteresis
            self.scale *= self.growth

    def state_dict(self) -> dict:
        return {
            "loss_scale": self.scale,
            "good_steps": self.good_steps,
            "hysteresis_left": self.hysteresis_left,
        }

    def load_state_dict(self, d: dict):
        self.scale = float(d["loss_scale"])
        self.good_steps = int(d["good_steps"])
        self.hysteresis_left = int(d["hysteresis_left"])


class ConstantLossScaler:
    """--loss-scale S: every step's loss is scaled by S, never adjusted (an overflowing step is
    still skipped); nothing to checkpoint."""

    def __init__(self, scale: float):
        self.scale = float(scale)

    def can_back_off(self) -> bool:
        return False

    def update(self, found_inf: bool):
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, d: dict):
        pass


def scaler_for(precision: str, o) -> "LossScaler | ConstantLossScaler | None":
    """The run's scaler (`o`: the OptimizerConfig), as Megatron chooses it: a static
    --loss-scale for fp16 or bf16 parameters, else dynamic scaling for fp16, else none."""
    if precision not in ("fp16", "bf16"):
        return None
    if o.loss_scale is not None:
        return ConstantLossScaler(o.loss_scale)
    if precision == "fp16":
        return LossScaler(o.initial_loss_scale, o.loss_scale_window, o.min_loss_scale, o.hysteresis)
    return None
