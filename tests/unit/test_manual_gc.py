"""--manual-gc: the automatic collector is off for the whole run and every rank collects on the
same steps (multiples of --manual-gc-interval) and after each evaluation."""

import gc

from megalite.testing import tiny_config, tiny_trainer


def _run(monkeypatch, manual: bool, interval: int = 0, eval_interval: int = 0):
    cfg = tiny_config()
    t = cfg.training
    t.train_iters, t.manual_gc, t.manual_gc_interval, t.eval_interval = (
        6,
        manual,
        interval,
        eval_interval,
    )
    tr = tiny_trainer(cfg, world=1)
    seen, collected = [], []
    step = tr.train_step

    def train_step(log=True):
        seen.append(gc.isenabled())
        return step(log)

    monkeypatch.setattr(tr, "train_step", train_step)
    real = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(tr.iteration) or real(*a))
    assert gc.isenabled()
    tr.train()
    assert gc.isenabled()  # restored after the run
    return seen, collected


def test_manual_gc_collects_on_the_same_steps(monkeypatch):
    seen, collected = _run(monkeypatch, True, interval=2)
    assert seen == [False] * 6
    # once before the first step (what the build made), then after steps 2, 4 and 6
    assert collected == [0, 2, 4, 6]


def test_manual_gc_after_evaluations(monkeypatch):
    _, collected = _run(monkeypatch, True, interval=0, eval_interval=3)
    assert collected == [0, 3, 6]  # evaluations after steps 3 and 6 (the last)


def test_automatic_gc_is_left_alone(monkeypatch):
    seen, collected = _run(monkeypatch, False)
    assert seen == [True] * 6 and collected == []
