"""What the Logger prints and writes after a resume (training/logger.py): the ETA from this run's
own steps, and a metrics file with one row per iteration."""

import json

from megalite.config import Config
from megalite.training import logger as logger_mod
from megalite.training.logger import Logger


def _logger(tmp_path, **logging) -> Logger:
    cfg = Config()
    cfg.logging.wandb_mode = "disabled"
    cfg.logging.metrics_file = str(tmp_path / "metrics.jsonl")
    for k, v in logging.items():
        setattr(cfg.logging, k, v)
    return Logger(cfg, enabled=True)


def _row(it: int, loss: float) -> dict:
    return {"iteration": it, "loss": loss, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1.0,
            "mfu": None}  # fmt: skip


def test_eta_counts_this_runs_steps(tmp_path, monkeypatch, capsys):
    """Resumed at 90 of 100, 5 steps in 50 s: 5 steps left take 50 s more (the global
    iteration would say 50 / 95 * 5 = 2 s)."""
    clock = [1000.0]
    monkeypatch.setattr(logger_mod.time, "time", lambda: clock[0])
    log = _logger(tmp_path)
    log.resume({}, 90)
    clock[0] += 30  # the launch: loading the checkpoint, building the data index
    log.begin(90)
    clock[0] += 50
    log.step(_row(95, 2.0), total_iters=100)
    assert "ETA 0:00:50" in capsys.readouterr().out
    fresh = _logger(tmp_path / "fresh")  # no begin (a Trainer used directly): from the start
    clock[0] += 10
    fresh.step(_row(5, 2.0), total_iters=10)
    assert "ETA 0:00:10" in capsys.readouterr().out


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def test_a_resumed_run_replaces_the_rows_it_runs_again(tmp_path):
    """A job logged 1..6 and died; its checkpoint is at 4. The resumed job's rows 5, 6 replace
    the dead job's (written aside and renamed: never a half file); rows up to 4 are kept."""
    first = _logger(tmp_path)
    first.begin(0)
    for i in range(1, 7):
        first.write(_row(i, float(i)))
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"iteration": 7, "lo')  # the line the crash cut
    again = _logger(tmp_path)
    again.resume({}, 4)
    again.begin(4)
    for i in (5, 6, 7):
        again.write(_row(i, 10.0 * i))
    rows = _rows(tmp_path / "metrics.jsonl")
    assert [(r["iteration"], r["loss"]) for r in rows] == [
        (1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 50.0), (6, 60.0), (7, 70.0)]  # fmt: skip
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temporary left

    fresh = _logger(tmp_path)  # a new run from iteration 0 into the same file starts it over
    fresh.begin(0)
    fresh.write(_row(1, 0.5))
    assert [(r["iteration"], r["loss"]) for r in _rows(tmp_path / "metrics.jsonl")] == [(1, 0.5)]


def test_eval_only_joins_the_row_of_its_iteration(tmp_path):
    run = _logger(tmp_path)
    run.begin(0)
    for i in (1, 2):
        run.write(_row(i, float(i)))
    ev = _logger(tmp_path)
    ev.resume({}, 2)
    ev.write({"iteration": 2, "eval_loss": 1.5, "eval_ppl": 4.48}, merge=True)
    rows = _rows(tmp_path / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == [1, 2]
    assert rows[1]["loss"] == 2.0 and rows[1]["eval_loss"] == 1.5
    ev.write({"iteration": 3, "eval_loss": 1.0, "eval_ppl": 2.7}, merge=True)  # none: appended
    assert [r["iteration"] for r in _rows(tmp_path / "metrics.jsonl")] == [1, 2, 3]
