"""What pretrain_gpt.py runs: parse and validate the config, set up the groups, train."""

from megalite.config import parse_args, validate
from megalite.parallel import groups as pg
from megalite.parallel.topology import Topology


def setup(cfg) -> pg.ProcessGroups:
    p = cfg.parallel
    device = pg.init_distributed(p.distributed_timeout_minutes)
    topo = Topology(tp=p.tp, pp=p.pp, dp=p.dp, order=p.order)
    return pg.build_groups(topo, device, p.distributed_timeout_minutes)


def main(argv):
    cfg = parse_args(argv)
    _, world_size, _ = pg.world_from_env()
    validate(cfg, world_size)  # before any process group exists
    groups = setup(cfg)
    try:
        if groups.rank == 0:
            print(groups.topo.describe(), flush=True)
    finally:
        pg.destroy()
