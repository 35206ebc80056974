"""What every direction of checkpoint conversion (cli/convert.py) shares: progress bars on a
terminal, and the check of the layout a conversion is given against the model."""

import copy

from tqdm import tqdm

from megalite.checkpoint import megatron_args
from megalite.config import Config
from megalite.shape import validate


def progress(items, what: str, unit: str = "tensor", total=None):
    """`items` with a progress bar on stderr when it is a terminal (quiet in logs and pipes)."""
    return tqdm(items, desc=what, unit=unit, disable=None, total=total)


def check_layout(cfg: Config, tp: int, pp: int, vpp: int, stages: dict | None = None):
    """Reject a layout this model cannot take, with validate()'s sentences. A copy is checked,
    with batch fields set so that only the model-vs-layout checks can fail: the conversion's
    layout never enters the saved config. `stages`: uneven pipeline stages (`split_flags`)."""
    cfg = copy.deepcopy(cfg)
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.vpp = tp, pp, vpp
    for k, v in (stages or {}).items():  # (ParallelConfig's fields have Megatron's args names)
        setattr(cfg.parallel, k, v)
    cfg.training.micro_batch_size, cfg.training.global_batch_size = 1, pp
    validate(cfg, tp * pp)


def split_flags(args) -> dict:
    """A legacy Megatron target's uneven pipeline stages, by Megatron's args names: the flags
    given (partition.py reads them)."""
    given = {k: getattr(args, k) for k in megatron_args.PIPELINE_SPLIT_ARGS}
    return {k: v for k, v in given.items() if v}
