"""One rank's parts, built from a config, its run shape and its process groups: the model
chunks of its pipeline stage, the optimizer over them, its schedule's actions.

The trainer builds a rank this way, and so do the benchmarks and the tests that drive the parts
without the trainer's loop (their own data, timings or reference runs): the same kernels,
precision, recompute, sequence and context parallelism, placement and ZeRO stage as a run of
that config.
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megalite.config import Config
from megalite.errors import MegaliteError
from megalite.kernels import fp8_linear
from megalite.model.assemble import DTYPES, build_chunks, layer_env
from megalite.model.gpt import GPTChunk
from megalite.model.materialize import materialize
from megalite.model.moe import aux_loss_scale
from megalite.optim.distributed_optimizer import DistributedOptimizer
from megalite.parallel import comm
from megalite.parallel.buffers import Buffers
from megalite.parallel.data_parallel import build_buffers
from megalite.parallel.groups import ProcessGroups
from megalite.pipeline.executor import PipelineResult, run_schedule
from megalite.pipeline.schedules import get_schedule
from megalite.shape import RunShape
from megalite.training.compile import compile_chunks


@dataclass
class RankParts:
    """What `build_rank` made: the chunks (in chunk order), their optimizer and this rank's
    actions of one step's schedule over `microbatches` micro-batches."""

    chunks: list[GPTChunk]
    opt: DistributedOptimizer
    actions: list
    microbatches: int
    hidden_shape: tuple[int, int, int]  # the tensor between stages, (b, s/cp[/tp], h)
    dtype: torch.dtype
    groups: ProcessGroups
    placement: object  # the schedule's (stage, chunk) placement of the virtual stages

    eval_actions: list  # the same schedule's forward-only actions (evaluation)
    # (name, pp, vpp, pp rank) of the schedule, and the other micro-batch counts a batch
    # ramp-up (--rampup-batch-size) runs it with
    schedule_key: tuple = ()
    ramp_counts: tuple = ()
    _other_counts: dict = field(default_factory=dict)

    def actions_for(self, count: int) -> list:
        """This rank's actions of a step over `count` micro-batches (the shape's, or during a
        batch ramp-up (--rampup-batch-size) a smaller count, built once each)."""
        if count == self.microbatches:
            return self.actions
        if count not in self._other_counts:
            if count not in self.ramp_counts:
                raise MegaliteError(
                    f"the step was given {count} micro-batches but its schedule was built for "
                    f"{self.microbatches} (the run shape's global / (micro-batch size * dp))"
                )
            name, pp, vpp, rank = self.schedule_key
            self._other_counts[count] = get_schedule(name, pp, vpp, count, rank)
        return self._other_counts[count]

    def run(self, batch, microbatches: int | None = None, forward_only: bool = False,
            **kw) -> PipelineResult:  # fmt: skip
        """The schedule over `batch`, this rank's `microbatches` micro-batches (default: the
        run shape's count; a batch ramp-up's step gives its own, `RunShape.microbatches_at`),
        gradients accumulated into the optimizer's buffers; `kw` goes to `run_schedule`
        (timeline, observe, ...). MoE auxiliary losses get the main loss's gradient,
        loss_scale / micro-batches. With `forward_only` (evaluation) the forward-only actions
        run: losses, no gradients."""
        m = self.microbatches if microbatches is None else microbatches
        built = self.microbatches if forward_only else m  # (evaluation: the full global batch)
        if len(batch) != m or m != built:
            what = "evaluation" if forward_only else "the step"
            raise MegaliteError(f"{what} was given {len(batch)} micro-batches but its schedule "
                                f"was built for {built}")  # fmt: skip
        if forward_only:
            return run_schedule(self.eval_actions, self.chunks, self.groups, batch,
                                hidden_shape=self.hidden_shape, dtype=self.dtype,
                                forward_only=True, placement=self.placement, **kw)  # fmt: skip
        scale = self.opt.loss_scale
        with aux_loss_scale(scale / m):
            result = run_schedule(self.actions_for(m), self.chunks, self.groups, batch,
                                  hidden_shape=self.hidden_shape, dtype=self.dtype,
                                  loss_scale=scale, placement=self.placement, **kw)  # fmt: skip
        end_fp8_step(self.chunks, self.groups)
        return result


def end_fp8_step(chunks, groups: ProcessGroups):
    """Delayed FP8 scaling after a step's schedule: every layer's amaxes of the step, max-reduced
    over the ranks that hold the same layers (tp, then dp and cp: as if one process had seen
    every micro-batch), pushed into their histories (kernels/fp8_linear.py `end_step`)."""

    def reduce(t):
        for g in (groups.tp, groups.replica):
            comm.all_reduce(t, g, op=dist.ReduceOp.MAX)

    fp8_linear.end_step(fp8_linear.fp8_linears(m for c in chunks for m in c.modules()), reduce)


def parallelize(cfg: Config, shape: RunShape, groups: ProcessGroups, ops=None,
                data_parallel: bool = True, loading: bool = False, meta: bool = False
                ) -> tuple[list[GPTChunk], Buffers | None]:  # fmt: skip
    """This rank's model as a run of `cfg` trains it: the chunks of its pipeline stages (one
    per virtual stage, with the layers the schedule's placement gives it) and every
    transformation, in the order applied. `ops`: the kernels every layer calls (default
    `kernels.select(cfg.training.kernels, device)`; `kernels.override` swaps one of them).
    Returns the chunks and, with `data_parallel`, their gradient buffers (the optimizer's).

    `loading`: a checkpoint will be loaded (the trainer's `resume_path`: --load, --finetune,
    --eval-only, a restart resuming its --save): the chunks are built on the meta device and
    given uninitialised memory (model/materialize.py), as the load fills every weight, so none
    is drawn at random first. `meta`: the chunks stay on the meta device (the dry run's plan:
    shapes, specs and what was applied, no memory; groups need no communicator), with
    `data_parallel=False` (buffers need memory).

    `training/applied.py` `applied(cfg, shape, chunks)` lists what this applied, in this
    order, read back from the chunks (and `module_plan` each parameter's placement).
    `cli/generate.py`, `plan/memory.py` and `checkpoint/args.py` build their chunks with the
    same `layer_env` and `build_chunks`."""
    t = cfg.training
    if meta and data_parallel:
        raise ValueError("parallelize(meta=True) builds no buffers: pass data_parallel=False")
    # tensor, sequence, context and expert parallelism, FP8, recompute (model/assemble.py)
    env = layer_env(cfg, groups, shape.sequence_parallel, ops, meta=loading or meta)
    chunks = build_chunks(shape.model, env, shape.partition.rank_chunks(groups.pp.rank))
    for chunk in chunks if loading and not meta else ():
        materialize(chunk, groups.device)  # uninitialised memory for the load
    if t.compile:  # each layer's math compiled; names, hooks and recompute stay as they are
        compile_chunks(chunks)
    # data parallelism / ZeRO: each parameter a view of a flat bucket, its gradient hooked
    buffers = build_buffers(chunks, groups, cfg) if data_parallel else None
    return chunks, buffers


def build_rank(cfg: Config, shape: RunShape, groups: ProcessGroups, ops=None,
               loading: bool = False) -> RankParts:  # fmt: skip
    """The chunks, optimizer and schedule of this rank of a run of `cfg` (`shape` from
    `validate(cfg, world)`, with the tokenizer's vocabulary if it has one; `ops` and
    `loading` as in `parallelize`). Seeding the dropout streams is the caller's: the chunks' initialisation
    depends on `cfg.training.seed` only."""
    chunks, buffers = parallelize(cfg, shape, groups, ops, loading=loading)
    opt = DistributedOptimizer(chunks, buffers, groups, cfg)  # steps the buffers it is given
    order = (shape.schedule, shape.pp, shape.vpp, shape.microbatches, groups.pp.rank)
    ramp = tuple(shape.microbatch_counts(cfg.training))
    return RankParts(chunks, opt, get_schedule(*order), shape.microbatches, shape.hidden_shape,
                     DTYPES[cfg.training.precision], groups, shape.placement,
                     get_schedule(*order, forward_only=True),
                     (shape.schedule, shape.pp, shape.vpp, groups.pp.rank), ramp)  # fmt: skip
