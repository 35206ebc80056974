"""The launch line of a plan: `torchrun --nnodes N --nproc_per_node G pretrain_gpt.py` with the
flags that rebuild the planned run (`launch_line`): every model, batch and training field that
differs from megalite's defaults, and the layout of the plan (tp, pp, cp, ep, etp, vpp, dp,
sequence parallelism, the ZeRO stage, the micro-batch size, the pipeline split). `launch_config`
is that run's Config: validated at the plan's world it gives the plan's layout (a test checks
it against `pretrain_gpt.py --dry-run`); and the layout to launch (`preferred`): the fastest,
or a layout within HEADROOM_MARGIN of it with more memory to spare."""

import dataclasses
import shlex

from megalite.config import Config
from megalite.config_read import SECTIONS, _base_type, _fields
from megalite.plan import stages

# run-time fields a plan does not carry into the launch line (what to do, not what to train)
SKIPPED = {"training.dry_run", "training.fake_world", "training.fake_world_device"}
# said even at their defaults: the model's size, the batch and the layout
ALWAYS = {"model.num_layers", "model.hidden_size", "model.num_attention_heads", "model.seq_length",
          "training.micro_batch_size", "training.global_batch_size", "training.precision",
          "training.recompute", "parallel.tp", "parallel.pp", "parallel.dp",
          "optimizer.zero_stage"}  # fmt: skip
HEADROOM_MARGIN = 0.03  # a layout this much slower may be preferred for its spare memory
HEADROOM_GAIN = 0.10  # ... where it leaves at least this share of the usable memory more free


def launch_config(cfg: Config, p) -> Config:
    """cfg with the plan's layout: what `validate` turns back into `p.layout` at its world."""
    lay = p.layout
    split = {**stages.NO_SPLIT, **dict(p.split)}
    overlap = cfg.parallel.tp_comm_overlap and lay.sequence_parallel and lay.tp > 1
    sched = lay.schedule if cfg.parallel.pp_schedule else None
    par = dataclasses.replace(cfg.parallel, tp=lay.tp, pp=lay.pp, cp=lay.cp, vpp=lay.vpp,
                              ep=lay.ep, etp=lay.etp, dp=lay.dp, dp_replicate=lay.dpr,
                              sequence_parallel=lay.sequence_parallel, tp_comm_overlap=overlap,
                              pp_schedule=sched, **split)  # fmt: skip
    opt = dataclasses.replace(cfg.optimizer, zero_stage=lay.zero.stage)
    train = dataclasses.replace(
        cfg.training,
        micro_batch_size=lay.micro_batch_size,
        recompute=p.recompute or cfg.training.recompute,
    )
    model = dataclasses.replace(cfg.model, vocab_size=lay.model.vocab_size)
    return dataclasses.replace(cfg, model=model, parallel=par, optimizer=opt, training=train)


def config_flags(cfg: Config) -> list[str]:
    """The flags (pretrain_gpt.py's names) of every field that differs from the default, and of
    ALWAYS's."""
    out, defaults = [], Config()
    for sec in SECTIONS:
        obj, base = getattr(cfg, sec), getattr(defaults, sec)
        for f, tp in _fields(obj):
            value = getattr(obj, f.name)
            key = f"{sec}.{f.name}"
            if key in SKIPPED or value == getattr(base, f.name) and key not in ALWAYS:
                continue
            name = "--" + f.name.replace("_", "-")
            scalar, is_list = _base_type(tp)
            if scalar is bool:
                out.append(name if value else "--no-" + name[2:])
            elif value is None:
                raise ValueError(
                    f"{sec}.{f.name} is None where its default is not: no flag says it"
                )
            elif is_list:
                out += [name, *map(shlex.quote, map(str, value))]
            else:
                out += [name, shlex.quote(str(value))]
    return out


def launch_line(cfg: Config, p, gpus_per_node: int) -> str:
    """The torchrun command that launches the plan's layout (its world over nodes of
    `gpus_per_node`; fewer on a single node that is not full)."""
    world = p.layout.world_size
    per_node = min(gpus_per_node, world)
    nodes = world // per_node
    flags = config_flags(launch_config(cfg, p))
    return f"torchrun --nnodes {nodes} --nproc_per_node {per_node} pretrain_gpt.py " + " ".join(
        flags
    )


def preferred(plans: list, usable_bytes: float):
    """(the plan to launch, the fastest): the fastest, unless one at most HEADROOM_MARGIN slower
    leaves at least HEADROOM_GAIN of the usable memory more free (then the one leaving most
    free of those): a layout at 98% of the memory the planner counts has no room for what it
    does not count (the allocator's fragmentation, a longer document, a larger NCCL buffer)."""
    best = plans[0]
    near = [p for p in plans if p.step_time <= (1 + HEADROOM_MARGIN) * best.step_time]
    roomy = min(near, key=lambda p: (p.memory["total"], p.step_time))
    if best.memory["total"] - roomy.memory["total"] >= HEADROOM_GAIN * usable_bytes:
        return roomy, best
    return best, best
