"""A rank's model chunks as a run of a config builds them: the one place that turns a config and
a rank's groups into a `LayerEnv` and `GPTChunk`s.

Training (`training/build.py` `parallelize`), generation (cli/generate.py), the planner's
templates (plan/memory.py) and the checkpoint's shape check (checkpoint/args.py) all build
here, so a model is the same object whichever of them made it: the same kernels, FP8 coverage,
recompute, dtype and groups. `groups` is anything holding `tp`, `cp`, `cp_levels`, `experts`
and `device` as `ProcessGroups` does; None is one process. What a rank builds is a list of
chunk arguments, `shape.partition.rank_chunks(pp_rank)` for a run (the planner and the
checkpoint check name their own layers).
"""

import torch

from megalite import kernels
from megalite.config import Config
from megalite.kernels import fp8, fp8_linear
from megalite.model.env import LayerEnv
from megalite.model.gpt import GPTChunk

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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
    device = groups.device if groups is not None else None
    ops = ops or kernels.select(t.kernels, device or "cpu")
    placed = {}
    if groups is not None:
        placed = dict(tp=groups.tp, cp=groups.cp, cp_levels=groups.cp_levels,
                      experts=groups.experts)  # fmt: skip
    return LayerEnv(
        sequence_parallel=sequence_parallel,  # sequence parallelism (tp > 1)
        tp_comm_overlap=cfg.parallel.tp_comm_overlap,  # its collectives behind the matmuls
        cp_comm_type=cfg.parallel.cp_comm_type,  # context parallelism's attention exchange
        ops=with_fp8(ops, cfg, placed.get("cp")),  # FP8 linears
        recompute=t.recompute,  # activation recompute
        seed=t.seed,
        dtype=dtype or DTYPES[t.precision],
        device=device,
        meta=meta,  # no memory, nothing drawn: a checkpoint or the planner fills it
        **placed,  # tensor, context and expert parallelism
    )


def build_chunks(cfg: Config, env: LayerEnv, chunks: list[dict]) -> list[GPTChunk]:
    """The chunks of `chunks` (GPTChunk's keyword arguments each, e.g.
    `shape.partition.rank_chunks(pp_rank)`), in chunk order, each built with `env`."""
    return [GPTChunk(cfg.model, env, **kw) for kw in chunks]
