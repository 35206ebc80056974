"""What a run resumes from, decided from the files alone before any process group exists:
the checkpoint directory (`resume_path`: --load, else --save when it holds one), whether it is
the run's own --save (`resumes_own_save`: a restart continues in full), the W&B run and
iteration it continues (`resumed_run`), and the `TrainState` a load returns (checkpointer.py)."""

from dataclasses import dataclass
from pathlib import Path

from megalite.checkpoint import format as fmt
from megalite.checkpoint import megatron_direct
from megalite.checkpoint.format import Checkpoint
from megalite.errors import MegaliteError


@dataclass
class TrainState:
    """Where training stands, beside the tensors: what a resumed run continues from."""

    iteration: int = 0
    consumed_samples: int = 0
    skipped_steps: int = 0
    rng: dict | None = None  # this rank's generator states (None: re-seed, another layout)
    run_ids: dict | None = None  # the W&B run and TensorBoard dir a resumed job continues
    schedule_samples: int | None = None  # a Megatron checkpoint's LR/WD schedule position


def resume_path(cfg) -> str | None:
    """What the run resumes from: --load, else --save when it holds a checkpoint (a restarted
    job continues where it stopped), else nothing. Pure file checks, before any process group."""
    c = cfg.checkpoint
    if c.finetune and c.save and fmt.has_checkpoint(c.save):
        return c.save  # a restarted fine-tuning job continues its own run, not --load again
    if c.load:
        megatron_direct.resolve(c.load)  # a missing or empty directory fails here, with one line
        return c.load
    if c.save and fmt.has_checkpoint(c.save):
        return c.save
    if cfg.training.eval_only:
        raise MegaliteError("--eval-only needs a checkpoint to evaluate; pass --load DIR")
    return None


def resumes_own_save(cfg, path) -> bool:
    """A restart resuming its own --save (another directory than --load): it continues in full."""
    c = cfg.checkpoint
    return bool(c.save) and Path(path).resolve() == Path(c.save).resolve() != (
        Path(c.load).resolve() if c.load else None
    )


def resumed_run(cfg, path) -> tuple[dict, int]:
    """(run_ids, iteration) of the TrainState `Checkpointer.load(path)` will return, from the
    index alone: the launch opens W&B before any process group exists, on the run it continues."""
    if (
        path is None
        or not fmt.has_checkpoint(path)
        or cfg.checkpoint.finetune
        and not resumes_own_save(cfg, path)
    ):
        return {}, 0
    ckpt = Checkpoint(path)
    return dict(ckpt.index.get("run_ids") or {}), ckpt.iteration
