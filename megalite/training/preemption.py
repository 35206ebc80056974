"""Stopping a run early, every rank after the same step: a signal (SIGTERM: preemption; SIGINT:
Ctrl-C), a time limit (--exit-duration-in-mins) or an iteration limit (--exit-interval).

A rank knows only its own signal and clock. `flags()` gives them by name; the trainer adds them
to the optimizer step's one status reduction (summed over the world), and `reason` reads the
sums, so every rank sees the same values and stops at the same step. The trainer then saves
(checkpointer.after_step) and leaves its loop.
"""

import signal
import time
from contextlib import contextmanager


class Preemption:
    """The stop conditions of one run (its training config; signals are caught only with
    --save, when a stop can keep the work)."""

    def __init__(self, training, catch_signals: bool):
        self.duration_mins = training.exit_duration_in_mins
        self.interval = training.exit_interval
        self.catch = catch_signals
        self.started = time.monotonic()  # --exit-duration-in-mins counts from here
        self._signal = None

    @contextmanager
    def catching(self):
        """SIGTERM and SIGINT in the block make the run stop after the current step (it saves
        first); a second Ctrl-C stops at once. The old handlers come back afterwards."""
        if not self.catch:
            yield
            return

        def handler(signum, frame):
            if self._signal == signal.SIGINT and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self._signal = signum

        old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    @property
    def signalled(self) -> bool:
        """This rank got SIGTERM/SIGINT."""
        return self._signal is not None

    def time_up(self) -> bool:
        limit = self.duration_mins
        return limit is not None and time.monotonic() - self.started >= limit * 60

    def flags(self) -> dict[str, float]:
        """This rank's view, to be summed over the world: {"signal", "time_up"}."""
        return {"signal": float(self.signalled), "time_up": float(self.time_up())}

    def reason(self, flags: dict[str, float], iteration: int) -> str | None:
        """Why every rank stops after `iteration`, from `flags()` summed over the world (None:
        it goes on)."""
        if flags["signal"] > 0:  # on some rank
            name = signal.Signals(self._signal).name if self._signal else "a signal on another rank"
            return f"received {name}"
        if flags["time_up"] > 0:
            return f"trained for --exit-duration-in-mins {self.duration_mins}"
        if self.interval and iteration % self.interval == 0:
            return f"reached --exit-interval {self.interval}"
        return None
