"""What pretrain_gpt.py (megalite-train, python -m megalite.train) runs: parse the config, take
the model from the checkpoint it resumes where no flag gives it, validate, set up the groups,
train.

The config is validated before any process group exists, so bad flags fail within seconds.
"""

import atexit
import os

from megalite.config_read import Given, parse_args, where
from megalite.parallel.topology import world_from_env
from megalite.shape import RunShape, model_ranks, validate


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
    return (cfg.parallel.dp or 1) * model_ranks(cfg)


def set_threads(env=os.environ) -> str:
    """torch's intra-op threads for this process, and the launch line that says so.

    torchrun sets OMP_NUM_THREADS=1 for every process when it starts several on a node and
    the variable is unset (torch/distributed/run.py); `python pretrain_gpt.py` (or a launcher
    other than torchrun) leaves torch on every core, which on a shared or busy machine is many
    times slower (configs/tiny.yaml on a busy 2-core VM: 80-520 tokens/s on both cores,
    2,100-7,000 on one thread; issue 54 measured 331 against 5,645).
    So every megalite process gets what torchrun gives each of its processes: one thread, and
    OMP_NUM_THREADS when the user set it (torch read it at import: it wins as it is)."""
    import torch

    given = env.get("OMP_NUM_THREADS", "").strip()
    if given:
        return f"threads: {torch.get_num_threads()} intra-op thread(s) per process (OMP_NUM_THREADS={given})"
    torch.set_num_threads(1)
    env["OMP_NUM_THREADS"] = "1"  # what torchrun passes down: processes this one starts agree
    return (
        "threads: 1 intra-op thread per process (torchrun's default for each of several "
        "processes; set OMP_NUM_THREADS=N for more)"
    )


def builtin_corpus_line(cfg, checkpoints: bool = False) -> str | None:
    """The line that says a run trains on the built-in demo corpus (no data path given), and
    with which tokenizer (`checkpoints`: the one the checkpoint carries); None when it has
    data of its own."""
    from megalite.data.splits import split_blends

    d = cfg.data
    if any(b and b.prefixes for b in split_blends(d, cfg.training.eval_only)[0]):
        return None
    tok = "the checkpoint's tokenizer" if checkpoints else d.tokenizer_model
    tok = tok or ("GPT-2's BPE (--vocab-file)" if d.vocab_file else None)
    how = f"tokenized by {tok}" if tok else \
        f"with a {d.tokenizer_vocab_size}-piece tokenizer trained on it"  # fmt: skip
    return (
        f"data: no --data-path, so the built-in demo corpus (Python's standard library) {how}; "
        "pass --data-path and --tokenizer-model to train on your own"
    )


def open_logs(cfg, path, rank: int):
    """The run's Logger (active on rank 0), with W&B started on the run it continues (`path`:
    the checkpoint it resumes), so that W&B's output.log holds the launch lines too. Every
    rank checks the flags first (--wandb-mode online without credentials, --tensorboard-dir
    without tensorboard), so all of them stop with the same one line."""
    from megalite.checkpoint.resume import resumed_run
    from megalite.training import run_settings
    from megalite.training.logger import Logger

    run_settings.check_wandb_online(cfg.logging)
    logger = Logger(cfg, enabled=rank == 0)
    if rank == 0:
        logger.resume(*resumed_run(cfg, path))
        logger.open()
    return logger


def main(argv):
    given = Given()  # the fields a flag or the YAML set: the checkpoint's model fills the rest
    cfg = parse_args(argv, given)
    c = cfg.checkpoint
    path = note = None  # the checkpoint the run resumes; where its tokenizer came from
    rank, world_size, _ = world_from_env()
    if not cfg.training.dry_run and (
        c.load or c.save and os.path.isdir(c.save) or cfg.training.eval_only
    ):
        from megalite.checkpoint.resume import resume_path  # (imports torch)

        path = resume_path(cfg)  # a missing checkpoint fails now, before any process group
        if path is not None:
            from megalite.checkpoint.args import with_checkpoint_model, with_checkpoint_tokenizer

            cfg = with_checkpoint_model(cfg, given, path)
            cfg, note = with_checkpoint_tokenizer(cfg, given, path)
    if cfg.training.dry_run and world_size == 1:  # plan the layout given, from a laptop
        world_size = planned_world(cfg)
    shape = validate(cfg, world_size)  # before any process group exists
    if cfg.training.dry_run:  # the plan only: no process group, no GPU
        from megalite.training.dry_run import print_applied, print_plan, print_schedule

        if rank == 0:
            print_plan(cfg, shape)
            print_applied(cfg, shape)
            print_schedule(cfg, shape)
            if cfg.training.fake_world:
                from megalite.training.fake_world import print_fake_world

                print_fake_world(cfg, shape)
        return
    from megalite.parallel import groups as pg
    from megalite.training.hang import prepare_nccl
    from megalite.training.launch_phases import LaunchPhases
    from megalite.training.trainer import Trainer

    logger = open_logs(cfg, path, rank)  # W&B before the first line it should hold
    prepare_nccl(cfg)  # NCCL only: before the process group exists
    # printed after the phases' first lines (the rendezvous, the groups), with the layout
    said = [set_threads(), note, builtin_corpus_line(cfg, note is not None)]
    launch = LaunchPhases(echo=rank == 0)  # time to the first step, printed phase by phase
    groups = setup(shape, cfg.parallel.distributed_timeout_minutes, launch)
    # However the run ends, its groups' threads are joined before the interpreter finalizes
    # (pg.destroy); on an error only after the message is out (a join can wait on a stuck peer).
    atexit.register(pg.destroy, groups)
    try:
        if groups.rank == 0:
            print(groups.topo.describe(), *filter(None, said), sep="\n", flush=True)
        # where the vocabulary size came from, for a tokenizer that does not fit in it
        vocab_from = (
            where(given, "model.vocab_size")
            if "model.vocab_size" in given
            else f"checkpoint {path}'s vocab_size"
        )  # (else the tokenizer's: nothing to check)
        trainer = Trainer(cfg, shape, groups, launch=launch, logger=logger, vocab_from=vocab_from)
        with launch.phase("resume"):
            trainer.resume()  # --load, or the latest checkpoint in --save
        if cfg.training.eval_only:
            trainer.eval_only()
        else:
            trainer.train()
        pg.destroy(groups, barrier=True)
    finally:
        pg.destroy()
