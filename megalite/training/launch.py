"""What pretrain_gpt.py runs: parse and validate the config, set up the groups, train.

The config is validated before torch is even imported, so bad flags fail within a second.
"""

from megalite.config import parse_args, validate
from megalite.parallel.topology import Topology, world_from_env


def setup(cfg):
    """torch.distributed and the ProcessGroups of the validated config's layout."""
    from megalite.parallel import groups as pg

    p = cfg.parallel
    device = pg.init_distributed(p.distributed_timeout_minutes)
    topo = Topology(tp=p.tp, pp=p.pp, dp=p.dp, order=p.order)
    return pg.build_groups(topo, device, p.distributed_timeout_minutes)


def main(argv):
    cfg = parse_args(argv)
    rank, world_size, _ = world_from_env()
    validate(cfg, world_size)  # before any process group exists
    if cfg.training.dry_run:  # the plan only: no process group, no GPU
        from megalite.training.layouts import print_plan

        if rank == 0:
            print_plan(cfg, world_size)
        return
    from megalite.checkpoint.checkpointer import resume_path
    from megalite.parallel import groups as pg
    from megalite.training.trainer import Trainer

    resume_path(cfg)  # a missing checkpoint fails now, also before any process group
    groups = setup(cfg)
    try:
        if groups.rank == 0:
            print(groups.topo.describe(), flush=True)
        trainer = Trainer(cfg, groups)
        trainer.checkpointer.resume()  # --load, or the latest checkpoint in --save
        if cfg.training.eval_only:
            trainer.eval_only()
        else:
            trainer.train()
        pg.destroy(barrier=True)
    finally:
        pg.destroy()
