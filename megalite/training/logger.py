"""Where a step's numbers go: the console, the metrics file, Weights & Biases and TensorBoard,
from one rank."""

import datetime
import importlib.util
import json
import os
import time

from megalite.errors import MegaliteError
from megalite.training import run_settings


def _fmt_time(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(seconds)))


class Logger:
    """Active on one rank (`enabled`); every method is a no-op elsewhere. W&B and TensorBoard
    open at `open` (the launch calls it before any process group exists, so W&B's output.log
    holds every line the run prints), else at the first row written; `resume` says before
    which run a resumed job continues (training/run_settings.py).

    The metrics file never holds two rows of one iteration: before this run's first row, the
    rows past the iteration it starts from (those a resumed run computes again) are dropped,
    the file replaced atomically; an --eval-only row joins its iteration's row."""

    def __init__(self, cfg, enabled: bool):
        self.cfg, self.enabled = cfg, enabled
        self.start = time.time()
        self._wandb = self.tensorboard = None
        self._opened = False
        self._saved, self._resumed_at = {}, None  # the resumed checkpoint's run_ids, iteration
        self._begun = None  # (time, iteration) when this run's first step started (`begin`)
        self._settled = False  # the metrics file's rows past this run's start are dropped
        log = cfg.logging
        # Checked on every rank, so all of them stop with the same error rather than rank 0
        # alone while the others wait for it.
        if log.tensorboard_dir and importlib.util.find_spec("tensorboard") is None:
            raise MegaliteError(
                "--tensorboard-dir needs the tensorboard package; pip install tensorboard "
                "(or megalite[tensorboard]), or drop --tensorboard-dir"
            )
        self.wandb_mode = run_settings.wandb_setting(log, "mode")
        self._run_id = None
        if enabled and log.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(log.metrics_file)), exist_ok=True)

    def resume(self, run_ids: dict, iteration: int):
        """The resumed checkpoint's run ids (TrainState.run_ids): its W&B run and TensorBoard
        directory are continued unless a flag names others. Once open (the launch read the ids
        from the checkpoint before the trainer loads it), the runs opened stay: only the
        iteration is taken."""
        if not self._opened:
            self._saved = dict(run_ids or {})
        self._resumed_at = iteration

    def begin(self, iteration: int):
        """This run's first step starts now, from `iteration`: the ETA counts from here."""
        self._begun = (time.time(), iteration)

    def run_ids(self) -> dict:
        """What a checkpoint saves for the job that resumes it (empty on the other ranks)."""
        if not self.enabled:
            return {}
        log = self.cfg.logging
        tb = run_settings.tensorboard_dir(log, self._saved.get("tensorboard_dir"))
        return {"wandb_run_id": self.wandb_run_id(),
                "tensorboard_dir": tb and os.path.abspath(tb)}  # fmt: skip

    def wandb_run_id(self) -> str | None:
        """The W&B run this job logs to (None with W&B off: the saved one is carried on)."""
        saved = self._saved.get("wandb_run_id")
        if self.wandb_mode == "disabled":
            return self.cfg.logging.wandb_run_id or saved
        if self._run_id is None:
            self._run_id = run_settings.wandb_run_id(self.cfg.logging, saved)
        return self._run_id

    @property
    def wandb(self):
        """The W&B run (`wandb.init()`'s return), or None."""
        self._open()
        return self._wandb

    def open(self):
        """Start W&B (wandb.init) and TensorBoard now, not at the first row."""
        self._open()

    def _open(self):
        if self._opened or not self.enabled:
            return
        self._opened = True
        log = self.cfg.logging
        if self.wandb_mode != "disabled":
            import wandb  # imported only when used: it is slow to import

            kw = run_settings.wandb_init_kwargs(log, self.wandb_run_id())
            os.makedirs(kw["dir"], exist_ok=True)
            self._wandb = wandb.init(**kw, config=self.cfg.to_dict())
        tb = run_settings.tensorboard_dir(log, self._saved.get("tensorboard_dir"))
        # the saved directory is followed only where tensorboard is installed (the flag checks)
        if tb and (log.tensorboard_dir or importlib.util.find_spec("tensorboard")):
            from torch.utils.tensorboard import SummaryWriter  # slow to import: only when used

            # A resumed job drops the events its predecessor logged after the checkpoint.
            purge = None if self._resumed_at is None else self._resumed_at + 1
            self.tensorboard = SummaryWriter(tb, purge_step=purge)

    def print(self, *lines):
        if self.enabled:
            print(*lines, flush=True)

    def step(self, metrics: dict, total_iters: int):
        """One logged step: console line, metrics-file line, W&B row."""
        if not self.enabled:
            return
        it = metrics["iteration"]
        now = time.time()
        elapsed = now - self.start
        # from this run's own steps: a resumed run's global iteration counts steps it never ran
        t0, first = self._begun or (self.start, self._resumed_at or 0)
        eta = (now - t0) / max(it - first, 1) * (total_iters - it)
        mfu = metrics.get("mfu")
        parts = [
            f"iter {it}/{total_iters}",
            f"loss {metrics['loss']:.4f}",
            f"lr {metrics['lr']:.2e}",
            f"grad {metrics['grad_norm']:.3f}",
            f"{metrics['tokens_per_s']:,.0f} tok/s",
            f"mfu {mfu:.1%}" if mfu is not None else "mfu n/a",
        ]
        if "eval_loss" in metrics:
            parts.append(f"eval {metrics['eval_loss']:.4f} (ppl {metrics['eval_ppl']:.1f})")
        if metrics.get("skipped"):
            parts.append("SKIPPED (loss spike)" if metrics.get("spike") else "SKIPPED (non-finite)")
        parts.append(f"{_fmt_time(elapsed)} elapsed, ETA {_fmt_time(eta)}")
        print(" | ".join(parts), flush=True)
        self.write(metrics)

    def write(self, metrics: dict, merge: bool = False):
        """One row into the metrics file, W&B and TensorBoard; `merge`: into the metrics file's
        row of the same iteration (--eval-only), appended where there is none."""
        if not self.enabled:
            return
        path = self.cfg.logging.metrics_file
        if path and merge:
            rewrite_rows(path, lambda rows: merge_row(rows, metrics))
        elif path:
            if not self._settled:  # rows this run computes again are dropped, once
                start = self._begun[1] if self._begun else self._resumed_at or 0
                rewrite_rows(path, lambda rows: [r for r in rows if _iteration(r) <= start])
            with open(path, "a") as fh:
                fh.write(json.dumps(metrics) + "\n")
        self._settled = True
        self._open()
        if self._wandb is not None or self.tensorboard is not None:
            flat, step = flatten(metrics), metrics["iteration"]
            if self._wandb is not None:
                self._wandb.log(flat, step=step)
            if self.tensorboard is not None:
                for k, v in flat.items():
                    self.tensorboard.add_scalar(k, v, global_step=step)
                self.tensorboard.flush()  # a run that dies later keeps what was logged

    def finish(self):
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None


def flatten(metrics: dict) -> dict:
    """The scalars of a metrics row (W&B and TensorBoard log the same): numbers as they are,
    per-group communication as comm/<group>_bytes and comm/<group>_seconds, MoE loads as
    moe_load/layer<i>_expert<e>."""
    flat = {k: v for k, v in metrics.items() if isinstance(v, int | float)}
    for layer, loads in (metrics.get("moe_load") or {}).items():  # MoE: each expert's share
        flat.update({f"moe_load/layer{layer}_expert{e}": x for e, x in enumerate(loads)})
    for kind, v in (metrics.get("comm") or {}).items():
        flat[f"comm/{kind}_bytes"] = v["bytes"]
        flat[f"comm/{kind}_seconds"] = v["seconds"]
    return flat


def _iteration(row) -> int:
    """A metrics row's iteration (a row without one, or a line that is not a row, counts as
    0: kept)."""
    it = row.get("iteration") if isinstance(row, dict) else None
    return it if isinstance(it, int) else 0


def rewrite_rows(path: str, change):
    """Replace the metrics file at `path` by `change(rows)`, atomically (written aside, then
    renamed); no file: `change([])` when it gives any rows. A line that is not JSON (a row cut by
    a crash) is dropped."""
    rows = []
    if os.path.exists(path):
        with open(path) as fh:
            for line in fh:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    new = change(rows)
    if new == rows and os.path.exists(path) or not new and not os.path.exists(path):
        return
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in new)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def merge_row(rows: list, row: dict) -> list:
    """`rows` with `row`'s fields added to the last row of its iteration, or `row` appended."""
    for i in range(len(rows) - 1, -1, -1):
        if _iteration(rows[i]) == row["iteration"]:
            return [*rows[:i], {**rows[i], **row}, *rows[i + 1 :]]
    return [*rows, row]
