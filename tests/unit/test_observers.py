"""training/observers.py: the trainer calls its observers, in order, at the named points of an
iteration, and the micro-batch count of a step comes from the run shape."""

import pytest

from megalite.errors import MegaliteError
from megalite.shape import validate
from megalite.testing import tiny_config, tiny_trainer
from megalite.training.observers import LedgerWatch, Observer, Observers


class Recorder(Observer):
    def __init__(self, calls, name="r", flag=None, refuse=False):
        self.calls, self.name, self.flag, self.refuse = calls, name, flag, refuse

    def before_step(self, it):
        self.calls.append((self.name, "before_step", it))

    def phase(self, it, name):
        self.calls.append((self.name, name, it))

    def flags(self, result):
        return {} if self.flag is None else {self.flag: 1.0}

    def refuses(self, summed):
        self.calls.append((self.name, "refuses", sorted(summed)))
        return self.refuse

    def after_step(self, it, report):
        self.calls.append((self.name, "after_step", it, report.skipped))

    def metrics(self, results):
        return {f"{self.name}_steps": len(results)}


def test_observers_are_called_in_order_and_every_one_is_asked():
    calls = []
    watch = Observers(Recorder(calls, "a", "x", refuse=True), None, Recorder(calls, "b", "y"))
    watch.phase(3, "schedule")
    assert calls == [("a", "schedule", 3), ("b", "schedule", 3)]
    assert watch.flags(None) == {"x": 1.0, "y": 1.0}
    calls.clear()
    assert watch.refuses({"x": 2.0}) is True
    assert [c[0] for c in calls] == ["a", "b"]  # b is asked though a refused already
    assert watch.metrics([1, 2]) == {"a_steps": 2, "b_steps": 2}


def test_a_step_passes_its_points_in_order():
    """train_step: before_step, schedule, optimizer (the flags in the step's one read and the
    guard asked), logging on a logging step, after_step; the loop adds evaluation and
    checkpoint."""
    cfg = tiny_config()
    cfg.training.train_iters, cfg.training.eval_interval, cfg.training.eval_iters = 2, 2, 1
    tr = tiny_trainer(cfg, world=1)
    calls = []
    tr.watch.items.append(Recorder(calls, flag="seen"))
    tr.train_step(log=False)
    assert calls == [("r", "before_step", 1), ("r", "schedule", 1), ("r", "optimizer", 1),
                     ("r", "refuses", ["seen", "signal", "time_up"]),
                     ("r", "after_step", 1, False)]  # fmt: skip
    calls.clear()
    row = tr.train_step(log=True)
    assert [c[1] for c in calls] == ["before_step", "schedule", "optimizer", "refuses",
                                     "logging", "after_step"]  # fmt: skip
    assert row["r_steps"] == 2  # the steps since the last logging step
    assert {"comm_bytes", "comm", "slowest_rank", "bubble_theory"} <= row.keys()
    calls.clear()
    cfg.training.train_iters = tr.train_iters = 3
    tr.train()
    assert [c[1] for c in calls if c[1] in ("evaluation", "checkpoint")] == ["evaluation",
                                                                              "checkpoint",
                                                                              "checkpoint"]  # fmt: skip


def test_the_ledger_counts_from_each_steps_start():
    cfg = tiny_config()
    tr = tiny_trainer(cfg, world=1)
    ledger = tr.groups.ledger
    ledger.bytes["dp"] = 10**9  # left over from before the step
    (watch,) = [o for o in tr.watch.items if isinstance(o, LedgerWatch)]
    watch.before_step(1)
    assert ledger.snapshot() == {}


def test_the_step_count_comes_from_the_run_shape():
    """RunShape.microbatches_at: the shape's count at its own global batch, a ramp-up's smaller
    one below it; the schedule runs with the count it is given, refusing a batch of another."""
    cfg = tiny_config()
    cfg.training.global_batch_size, cfg.training.micro_batch_size = 8, 2
    shape = validate(cfg, 1)
    assert shape.microbatches_at(8) == shape.microbatches == 4
    assert shape.microbatches_at(4) == 2
    with pytest.raises(MegaliteError, match="not divisible"):
        shape.microbatches_at(5)
    tr = tiny_trainer(cfg, world=1)
    batch = tr._microbatches(tr.data.train, tr.sampler.next_batch())
    tr.opt.zero_grad(4)
    with pytest.raises(
        MegaliteError, match="given 4 micro-batches but its schedule was built for 3"
    ):
        tr.parts.run(batch, 3)


def test_a_profiled_step_draws_its_schedule_and_optimizer(tmp_path):
    """--profile-steps 1:2 through the trainer: the executor's spans, the optimizer's span
    (its phase until the next point) and the file written after the step's logging."""
    import json

    cfg = tiny_config()
    cfg.training.train_iters, cfg.training.profile_steps = 2, "1:2"
    cfg.logging.metrics_file = str(tmp_path / "m.jsonl")
    tr = tiny_trainer(cfg, world=1)
    tr.train()
    spans = json.loads((tmp_path / "timeline.json").read_text())["ranks"][0]["spans"]
    kinds = [s["kind"] for s in spans]
    assert kinds.count("optimizer") == kinds.count("schedule") == 1 and "forward" in kinds
    opt = spans[kinds.index("optimizer")]
    assert opt["step"] == 1 and opt["end"] > opt["start"] >= spans[kinds.index("schedule")]["end"]
