"""What pretrain_gpt.py (megalite-train, python -m megalite.train) runs: parse the config, take
the model from the checkpoint it resumes where no flag gives it, validate, set up the groups,
train.

The config is validated before any process group exists, so bad flags fail within seconds.
"""

import atexit
import os

from megalite.config_read import parse_args
from megalite.parallel.axes import AXES
from megalite.parallel.topology import world_from_env
from megalite.shape import RunShape, validate


def setup(shape: RunShape, timeout_minutes: float = 10.0, launch=None):
    """torch.distributed and the ProcessGroups of the run's layout; `launch`
    (launch_phases.LaunchPhases) times the rendezvous and the groups."""
    from megalite.parallel import groups as pg
    from megalite.training.launch_phases import LaunchPhases

    launch = launch or LaunchPhases()
    with launch.phase("rendezvous"):
        device = pg.init_distributed(timeout_minutes)
    stages = shape.partition.end_stages()
    with launch.phase("groups"):
        return pg.build_groups(shape.topology(), device, timeout_minutes, embed_stages=stages)


def planned_world(cfg) -> int:
    """The world a --dry-run outside torchrun plans for: every axis's configured size, --dp (1
    when omitted, else every rank that splits the batch: --dp-replicate divides it) for data
    parallelism."""
    n = cfg.parallel.dp or 1
    for axis in AXES.values():
        n *= axis.size(cfg) if axis.size and not axis.splits_batch else 1
    return n


def main(argv):
    given = set()  # the fields a flag or the YAML set: the checkpoint's model fills the rest
    cfg = parse_args(argv, given)
    c = cfg.checkpoint
    if not cfg.training.dry_run and (
        c.load or c.save and os.path.isdir(c.save) or cfg.training.eval_only
    ):
        from megalite.checkpoint.checkpointer import resume_path  # (imports torch)

        path = resume_path(cfg)  # a missing checkpoint fails now, before any process group
        if path is not None:
            from megalite.checkpoint.args import with_checkpoint_model

            cfg = with_checkpoint_model(cfg, given, path)
    rank, world_size, _ = world_from_env()
    if cfg.training.dry_run and world_size == 1:  # plan the layout given, from a laptop
        world_size = planned_world(cfg)
    shape = validate(cfg, world_size)  # before any process group exists
    if cfg.training.dry_run:  # the plan only: no process group, no GPU
        from megalite.training.dry_run import print_plan

        if rank == 0:
            print_plan(cfg, shape)
            if cfg.training.fake_world:
                from megalite.training.fake_world import print_fake_world

                print_fake_world(cfg, shape)
        return
    from megalite.parallel import groups as pg
    from megalite.training.hang import prepare_nccl
    from megalite.training.launch_phases import LaunchPhases
    from megalite.training.trainer import Trainer

    prepare_nccl(cfg)  # NCCL only: before the process group exists
    launch = LaunchPhases(echo=rank == 0)  # time to the first step, printed phase by phase
    groups = setup(shape, cfg.parallel.distributed_timeout_minutes, launch)
    # However the run ends, its groups' threads are joined before the interpreter finalizes
    # (pg.destroy); on an error only after the message is out (a join can wait on a stuck peer).
    atexit.register(pg.destroy, groups)
    try:
        if groups.rank == 0:
            print(groups.topo.describe(), flush=True)
        trainer = Trainer(cfg, shape, groups, launch=launch)
        with launch.phase("resume"):
            trainer.resume()  # --load, or the latest checkpoint in --save
        if cfg.training.eval_only:
            trainer.eval_only()
        else:
            trainer.train()
        pg.destroy(groups, barrier=True)
    finally:
        pg.destroy()
