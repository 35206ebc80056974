"""What watches a training step without being part of it, behind one small interface.

The trainer keeps one list of observers (`Observers`) and calls each, in order, at the named
points of an iteration (`it`: the step's number, from 1):

  before_step(it)          before the step reads its batch
  phase(it, name)          the iteration enters a phase: schedule, optimizer, logging,
                           evaluation, checkpoint (hang.PHASES); a re-run enters schedule again
  run_hooks(m)             keyword arguments for the executor's run of m micro-batches
                           (`observe`, `timeline`)
  flags(result)            this rank's values for the optimizer's one device read, summed over
                           the world in the same reduction as the gradient norm (by name)
  refuses(summed)          True: the summed flags refuse the update (a loss spike)
  after_step(it, report)   step `it` done (after a re-run), with the optimizer's StepReport
  metrics(results)         on logging steps only (every rank calls it: collectives allowed),
                           fields for the metrics row; `results`: the steps since the last one

No hook reads the device outside a logging step: the step keeps its one host read (the
optimizer's status). The helpers themselves (hang.py, timeline.py, torch_profile.py,
manual_gc.py, launch_phases.py, health.py, preemption.py, parallel/ledger.py) know nothing of
this interface: each adapter here says which of their calls belongs at which point.
"""

import time

import torch

from megalite.parallel import comm


class Observer:
    """The hooks, each doing nothing: an observer overrides the ones it needs."""

    def before_step(self, it: int):
        pass

    def phase(self, it: int, name: str):
        pass

    def run_hooks(self, microbatches: int) -> dict:
        return {}

    def flags(self, result) -> dict:
        return {}

    def refuses(self, summed: dict) -> bool:
        return False

    def after_step(self, it: int, report):
        pass

    def metrics(self, results: list) -> dict:
        return {}


class Observers:
    """The trainer's observers, called in the order given (None entries: not watching)."""

    def __init__(self, *observers: Observer | None):
        self.items = [o for o in observers if o is not None]

    def before_step(self, it: int):
        for o in self.items:
            o.before_step(it)

    def phase(self, it: int, name: str):
        for o in self.items:
            o.phase(it, name)

    def run_hooks(self, microbatches: int) -> dict:
        return {k: v for o in self.items for k, v in o.run_hooks(microbatches).items()}

    def flags(self, result) -> dict:
        return {k: v for o in self.items for k, v in o.flags(result).items()}

    def refuses(self, summed: dict) -> bool:
        return any([o.refuses(summed) for o in self.items])  # (a list: every one is asked)

    def after_step(self, it: int, report):
        for o in self.items:
            o.after_step(it, report)

    def metrics(self, results: list) -> dict:
        return {k: v for o in self.items for k, v in o.metrics(results).items()}


class HangWatch(Observer):
    """Where this rank is, for its hang report (hang.HangRecorder): the phase, and the
    executor's last action."""

    def __init__(self, recorder):
        self.recorder = recorder

    def phase(self, it, name):
        self.recorder.at(it, name)

    def run_hooks(self, microbatches):
        self.recorder.schedule_runs(microbatches)  # (fewer during a batch-size ramp-up)
        return {"observe": self.recorder.observe}


class TimelineWatch(Observer):
    """--profile-steps (timeline.Timeline): the executor's spans during the profiled steps, the
    optimizer's span (its phase, until the next point), and after the last profiled step's
    logging every rank's spans gathered to rank 0."""

    def __init__(self, timeline, groups, meta: dict, logger):
        self.timeline, self.groups, self.meta, self.logger = timeline, groups, meta, logger
        self.now, self.opt_start = None, None  # the timeline while a step is profiled

    def _close(self):
        if self.opt_start is not None:
            self.now.record("optimizer", self.opt_start, self.now.clock.mark())
            self.opt_start = None

    def before_step(self, it):
        self.now = self.timeline.at(it)

    def run_hooks(self, microbatches):
        return {"timeline": self.now}

    def phase(self, it, name):
        self._close()
        if name == "optimizer" and self.now is not None:
            self.opt_start = self.now.clock.mark()
        if name == "checkpoint":  # after the step's logging: every rank, the same step
            self.timeline.step_done(it, self.groups, self.meta, self.logger.wandb)

    def after_step(self, it, report):
        self._close()


class ProfileWatch(Observer):
    """--profile (torch_profile.TorchProfile): the trace starts and stops between steps."""

    def __init__(self, profile):
        self.profile = profile

    def before_step(self, it):
        self.profile.before_step(it - 1)

    def after_step(self, it, report):
        if self.profile.after_step(it):
            print(f"rank {self.profile.rank}: profile trace written to {self.profile.path}",
                  flush=True)  # fmt: skip


class FirstStep(Observer):
    """The launch's last phase (launch_phases.py): the first step this process runs."""

    def __init__(self, launch):
        self.launch, self.t0 = launch, None

    def before_step(self, it):
        if "first step" not in self.launch.seconds:
            self.t0 = time.perf_counter()

    def after_step(self, it, report):
        if self.t0 is not None:
            self.launch.add("first step", time.perf_counter() - self.t0)
            self.t0 = None


class GCWatch(Observer):
    """--manual-gc (manual_gc.ManualGC): a collection on the steps of its interval."""

    def __init__(self, gc):
        self.gc = gc

    def after_step(self, it, report):
        self.gc.after_step(it)


class Stop(Observer):
    """Preemption (preemption.Preemption): its signal and time limit ride on the step's read,
    and every rank reads the same reason to stop (`reason`, None: go on) after the step."""

    def __init__(self, preemption):
        self.preemption, self.reason = preemption, None

    def flags(self, result):
        return self.preemption.flags()

    def after_step(self, it, report):
        self.reason = self.preemption.reason(report.flags, it)


class SpikeWatch(Observer):
    """The loss-spike guard (health.SpikeGuard): this rank's mean loss (0 off the last stage)
    rides on the step's read; the mean over the `heads` ranks holding a loss decides."""

    def __init__(self, guard, heads: int):
        self.guard, self.heads = guard, heads

    def flags(self, result):
        return {"loss": result.loss_tensor.mean()} if self.guard.on else {}

    def refuses(self, summed):
        return self.guard.on and self.guard.check(summed["loss"] / self.heads)


class StragglerWatch(Observer):
    """Stragglers (health.StragglerMonitor): every rank's compute seconds per step since the
    last logging step (one all-gather over the world); a warning when one is due."""

    def __init__(self, monitor, groups, logger):
        self.monitor, self.groups, self.logger = monitor, groups, logger

    def metrics(self, results):
        mine = sum(r.compute_s for r in results) / len(results)  # reads the clock marks
        world, device = self.groups.world, self.groups.device
        out = torch.zeros(world.size, dtype=torch.float64, device=device)
        comm.all_gather(out, torch.tensor([mine], dtype=torch.float64, device=device), world)
        health, warning = self.monitor.update(out.tolist())
        if warning:
            self.logger.print(warning)
        return health


class LedgerWatch(Observer):
    """The step's communication (parallel/ledger.CommLedger): counted from each step's start;
    a logging step reports its bytes and calls per group kind (its own reads included)."""

    def __init__(self, ledger):
        self.ledger = ledger

    def before_step(self, it):
        self.ledger.reset()

    def metrics(self, results):
        snapshot = self.ledger.snapshot()
        return {"comm_bytes": {k: v["bytes"] for k, v in snapshot.items()}, "comm": snapshot}
