"""What pretrain_gpt.py runs: parse and validate the config, set up the groups, train."""

from megalite.checkpoint.checkpointer import resume_path
from megalite.config import parse_args, validate
from megalite.parallel import groups as pg
from megalite.parallel.topology import Topology
from megalite.training.planner import print_plan
from megalite.training.trainer import Trainer


def setup(cfg) -> pg.ProcessGroups:
    p = cfg.parallel
    device = pg.init_distributed(p.distributed_timeout_minutes)
    topo = Topology(tp=p.tp, pp=p.pp, dp=p.dp, order=p.order)
    return pg.build_groups(topo, device, p.distributed_timeout_minutes)


def main(argv):
    cfg = parse_args(argv)
    _, world_size, _ = pg.world_from_env()
    validate(cfg, world_size)  # before any process group exists
    if cfg.training.dry_run:  # the plan only: no process group, no GPU
        if pg.world_from_env()[0] == 0:
            print_plan(cfg, world_size)
        return
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
