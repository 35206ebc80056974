"""Where a step's numbers go: the console, the metrics file, Weights & Biases and TensorBoard,
from one rank."""

import datetime
import importlib.util
import json
import os
import time

from megalite.errors import MegaliteError


def _fmt_time(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(seconds)))


class Logger:
    """Active on one rank (`enabled`); every method is a no-op elsewhere."""

    def __init__(self, cfg, enabled: bool):
        self.cfg, self.enabled = cfg, enabled
        self.start = time.time()
        self.wandb = self.tensorboard = None
        log = cfg.logging
        # Checked on every rank, so all of them stop with the same error rather than rank 0
        # alone while the others wait for it.
        if log.tensorboard_dir and importlib.util.find_spec("tensorboard") is None:
            raise MegaliteError(
                "--tensorboard-dir needs the tensorboard package; pip install tensorboard "
                "(or megalite[tensorboard]), or drop --tensorboard-dir"
            )
        if not enabled:
            return
        if log.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(log.metrics_file)), exist_ok=True)
        if log.wandb_mode != "disabled":
            import wandb  # imported only when used: it is slow to import

            os.makedirs(log.wandb_dir, exist_ok=True)
            self.wandb = wandb.init(
                project=log.wandb_project,
                name=log.wandb_run_name,
                mode=log.wandb_mode,
                dir=log.wandb_dir,
                config=cfg.to_dict(),
            )
        if log.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter  # slow to import: only when used

            self.tensorboard = SummaryWriter(log.tensorboard_dir)

    def print(self, *lines):
        if self.enabled:
            print(*lines, flush=True)

    def step(self, metrics: dict, total_iters: int):
        """One logged step: console line, metrics-file line, W&B row."""
        if not self.enabled:
            return
        it = metrics["iteration"]
        elapsed = time.time() - self.start
        eta = elapsed / max(it, 1) * (total_iters - it)
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

    def write(self, metrics: dict):
        if not self.enabled:
            return
        if self.cfg.logging.metrics_file:
            with open(self.cfg.logging.metrics_file, "a") as fh:
                fh.write(json.dumps(metrics) + "\n")
        if self.wandb is not None or self.tensorboard is not None:
            flat, step = flatten(metrics), metrics["iteration"]
            if self.wandb is not None:
                self.wandb.log(flat, step=step)
            if self.tensorboard is not None:
                for k, v in flat.items():
                    self.tensorboard.add_scalar(k, v, global_step=step)
                self.tensorboard.flush()  # a run that dies later keeps what was logged

    def finish(self):
        if self.wandb is not None:
            self.wandb.finish()
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
