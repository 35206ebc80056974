"""A rank's model chunks as a run of a config builds them: the one place that turns a config and
a rank's groups into a `LayerEnv` and `GPTChunk`s.

Training (`training/build.py` `parallelize`), generation (cli/generate.py), the planner's
templates (plan/memory.py) and the checkpoint's shape check (checkpoint/args.py) all build
here, so a model is the same object whichever of them made it: the same kernels, FP8 coverage,
recompute, dtype and groups. `groups` is a `ProcessGroups` or, built without process groups,
a `ChunkGroups` (what the builder reads of them: the planner's templates at a tp and ep); None
is one process. What a rank builds is a list of chunk arguments,
`shape.partition.rank_chunks(pp_rank)` for a run (the planner and the checkpoint check name
their own layers).
"""

from dataclasses import dataclass, field

import torch

from megalite import kernels
from megalite.config import Config, ModelConfig
from megalite.kernels import fp8, fp8_linear
from megalite.model.env import LOCAL, LayerEnv
from megalite.model.gpt import GPTChunk
from megalite.parallel.comm import Group
from megalite.parallel.expert_parallel import ExpertGroups

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ChunkGroups:
    """What `layer_env` reads of a rank's groups (`ProcessGroups` has them all), for a model
    built without process groups; the defaults are one process."""

    tp: Group = field(default_factory=lambda: LOCAL)
    cp: Group | None = None
    cp_levels: tuple[Group, Group] | None = None
    experts: ExpertGroups | None = None
    device: torch.device | str | None = None


def with_fp8(ops, cfg: Config, cp=None):
    """`ops` whose attention and MLP linears are FP8 ones with --fp8-format (docs/fp8.md);
    `cp`: the group that splits the tokens (their amaxes are those of whole sequences)."""
    t = cfg.training
    if t.fp8_format is None:
        return ops
    recipe = fp8.make_recipe(t.fp8_recipe, t.fp8_format, history_len=t.fp8_amax_history_len,
                             algo=t.fp8_amax_compute_algo, margin=t.fp8_margin,
                             pow2=t.fp8_scale_pow2)  # fmt: skip
    casts = getattr(ops, "fp8_casts", fp8.TORCH_CASTS)
    maker = fp8_linear.Fp8Maker(recipe, cp, t.fp8_first_last_layers_bf16, casts)
    return kernels.override(ops, fp8_linear=maker)


def layer_env(cfg: Config, groups=None, sequence_parallel: bool = False, ops=None,
              dtype: torch.dtype | None = None, meta: bool = False) -> LayerEnv:  # fmt: skip
    """How every layer of a run of `cfg` is built on a rank of `groups` (None: one process):
    `sequence_parallel` as the run shape has it, `ops` the kernels (default
    `kernels.select(cfg.training.kernels, device)`), with FP8 where the config asks for it;
    `dtype` (default the config's precision); `meta`: parameters on the meta device."""
    t = cfg.training
    groups = ChunkGroups() if groups is None else groups
    ops = ops or kernels.select(t.kernels, groups.device or "cpu")
    return LayerEnv(
        tp=groups.tp,  # tensor parallelism
        sequence_parallel=sequence_parallel,  # sequence parallelism (tp > 1)
        tp_comm_overlap=cfg.parallel.tp_comm_overlap,  # its collectives behind the matmuls
        cp=groups.cp,  # context parallelism, its attention exchange
        cp_comm_type=cfg.parallel.cp_comm_type,
        cp_levels=groups.cp_levels,
        experts=groups.experts,  # expert parallelism (ep, etp)
        ops=with_fp8(ops, cfg, groups.cp),  # FP8 linears
        recompute=t.recompute,  # activation recompute
        seed=t.seed,
        dtype=dtype or DTYPES[t.precision],
        device=groups.device,
        meta=meta,  # no memory, nothing drawn: a checkpoint fills it, or shapes only
    )


def build_chunks(model: ModelConfig, env: LayerEnv, chunks: list[dict]) -> list[GPTChunk]:
    """The chunks of `chunks` (GPTChunk's keyword arguments each, e.g.
    `shape.partition.rank_chunks(pp_rank)`) of `model` (a run's `shape.model`: its vocabulary
    known), in chunk order, each built with `env`."""
    return [GPTChunk(model, env, **kw) for kw in chunks]
