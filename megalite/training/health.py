"""Two watches over a run's health, on the host: stragglers and loss spikes.

Stragglers. At each logging step every rank's compute time per step (forward and backward,
averaged over the steps since the last logging step) is gathered; the metrics file records the
min, median and max and the slowest rank. A rank is slow at a logging step when its time is at
least --straggler-threshold times the median of its peers, the other ranks of its pipeline
stage, which do the same work (a stage of one rank has none: stages differ in cost by design,
so pure pipeline layouts record the times but never warn). Slow at each
of --straggler-window logging steps in a row, it is named in a warning. Ranks of one
tensor-parallel group wait for each other inside their computes, so a slow rank makes its
whole TP group look slow: the warning names the group's slowest, which may be its partner.

Loss spikes (--spike-threshold Z). The step's mean loss comes back with the optimizer's status
reduction (no extra read of the device); a step whose loss is more than Z standard deviations
above the mean of the last --spike-window accepted steps is skipped, like a non-finite one. The
deviation is floored at 0.1% of the mean, so a flat loss curve does not turn noise into spikes.
"""

import bisect
import math
import statistics
from collections import deque


class StragglerMonitor:
    def __init__(self, topo, threshold: float, window: int):
        self.threshold, self.window = threshold, max(1, window)
        stage_axes = "+".join(a for a in topo.axes if a != "pp")
        # ranks doing the same work: the others of a rank's stage; none when a stage is one
        # rank (stage costs differ anyway). Kept per stage, not per rank: a list of peers per
        # rank is world x stage entries (16M at 16,384 ranks, minutes to build).
        self.stages = topo.groups(stage_axes)
        self.slow = deque(maxlen=self.window)  # per logging step: {rank: ratio}

    def update(self, times: list[float]) -> tuple[dict, str | None]:
        """Metrics for one logging step from every rank's compute seconds per step, and a
        warning line when a rank has been slow at each of the last `window` logging steps."""
        ratios, base = {}, {}
        for stage in self.stages:
            ordered = sorted(times[r] for r in stage)
            for r in stage:
                t = times[r]
                base[r] = _median_without(ordered, t) if len(stage) > 1 else t
                ratios[r] = t / base[r] if base[r] > 0 else 1.0
        slowest = max(range(len(times)), key=lambda r: (ratios[r], times[r]))
        metrics = {
            "compute_s_min": min(times),
            "compute_s_median": statistics.median(times),
            "compute_s_max": max(times),
            "slowest_rank": slowest,
            "slowest_ratio": ratios[slowest],
        }
        if self.threshold <= 0 or len(times) < 2:
            return metrics, None
        self.slow.append({r: x for r, x in ratios.items() if x >= self.threshold})
        if len(self.slow) < self.window:
            return metrics, None
        steady = set.intersection(*(set(s) for s in self.slow))
        if not steady:
            return metrics, None
        rank = max(steady, key=lambda r: min(s[r] for s in self.slow))
        worst = min(s[rank] for s in self.slow)
        self.slow.clear()  # the next warning needs another full window
        return metrics, (
            f"megalite: warning: rank {rank} is a straggler: its compute time per step was at "
            f"least {worst:.2f}x its peers' median at each of the last {self.window} logging "
            f"steps (now {times[rank]:.3f} s per step, its peers {base[rank]:.3f} s; "
            f"--straggler-threshold {self.threshold}); check that rank's device, host and "
            "neighbours"
        )


def _median_without(ordered: list[float], x: float) -> float:
    """The median of sorted `ordered` with one occurrence of `x` taken out, in O(log n)."""
    k = bisect.bisect_left(ordered, x)

    def at(i):  # the i-th value of what is left
        return ordered[i if i < k else i + 1]

    n = len(ordered) - 1
    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


class SpikeGuard:
    """The host's record of recent losses and the spike test (`threshold` 0: off)."""

    def __init__(self, threshold: float, window: int, min_steps: int):
        self.threshold, self.min_steps = threshold, max(2, min_steps)
        self.losses = deque(maxlen=max(2, window))
        self.last = None  # the loss of the last step tested

    @property
    def on(self) -> bool:
        return self.threshold > 0

    def limit(self) -> float | None:
        """The loss above which a step is a spike now (None: not enough history yet)."""
        if len(self.losses) < self.min_steps:
            return None
        mean = statistics.fmean(self.losses)
        std = max(statistics.pstdev(self.losses), 1e-3 * abs(mean))
        return mean + self.threshold * std

    def check(self, loss: float) -> bool:
        """Is this step's loss a spike? A step that is not is added to the history."""
        self.last = loss
        limit = self.limit()
        if math.isfinite(loss) and limit is not None and loss > limit:
            return True
        if math.isfinite(loss):
            self.losses.append(loss)
        return False

    def rerun(self, iteration: int, restore, run, warn):
        """--spike-rerun: a step whose loss spiked runs once more on the same batch from the
        same state (`restore` puts it back, `run` is the step, returning (result, report)),
        and `warn` says which it was: the same loss is a data spike (the step stays skipped),
        another is a device or host fault. Returns the re-run's (result, report)."""
        first = self.last
        restore()
        result, stats = run()
        again = self.last
        if again == first:
            what = "the same loss: a data spike, the step stays skipped"
        else:  # the same computation gave another result: a device or host fault
            what = "not reproducible, suspect a hardware fault; " + (
                "the re-run spiked too and is skipped" if stats.spike else "its step is kept"
            )
        warn(
            f"megalite: warning: loss {first:.4f} at iteration {iteration} is above "
            f"the spike limit; a re-run gave {again:.4f}: {what}"
        )
        return result, stats
