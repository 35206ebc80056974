"""Megatron-LM checkpoints used directly by a run: `--load MEGATRON_DIR` and `--ckpt-format
torch_dist` at `--save`.

Loading: `open_checkpoint(path)` gives a megalite `format.Checkpoint` or, for a Megatron
directory (legacy mp_rank_* files or torch_dist, any tp/pp/vpp/ep and uneven stages: what
`megatron_dist.read_megatron` reads), a `MegatronCheckpoint` that answers the same questions
(index, tensors, `read(name, region)`): the model config from the Megatron args
(`megatron_args.config_from_args`), the iteration, the consumed samples
(`consumed_train_samples`), and each logical tensor computed from the Megatron files when a rank
reads it (`megatron.from_megatron_lazy`: the tp shards merged, qkv split, the vocabulary padding
stripped) -- exactly what `megalite-convert --from megatron --keep-position` would have written.
The optimizer state is not mapped (Megatron's param groups are not megalite's): the run starts
a fresh optimizer and says so in its load line, as with --no-load-optim; the LR/WD schedule
continues at the position Megatron's scheduler saved (`schedule_samples`). RNG states re-seed
(another layout's streams). Norm weights saved with --apply-layernorm-1p are read plus 1.

Saving: `export_megatron` writes a megalite checkpoint as Megatron's torch_dist (or legacy) --
megalite-convert --to megatron runs it too. With `--ckpt-format torch_dist` each save
(`write_beside`) puts Megatron's files (common.pt, metadata.json, .metadata, *.distcp) into the
same iter_NNNNNNN directory as megalite's (no name is shared) before it is renamed into place,
and `latest_checkpointed_iteration.txt` beside megalite's `latest`, so Megatron-LM `--load`s the
same --save directory (with --no-load-optim --no-load-rng: weights, iteration and consumed
samples only; the scheduler state written beside them is read by Megatron-LM only with
optimizer state) and megalite keeps resuming exactly from its own files.
"""

import shutil
from pathlib import Path

import torch

from megalite.checkpoint import format as fmt
from megalite.checkpoint import hf, megatron_args, megatron_dist, megatron_files, writing
from megalite.checkpoint import megatron as mg
from megalite.config import Config
from megalite.config_read import from_dict
from megalite.errors import MegaliteError
from megalite.lr_schedule import LRSchedule

TRACKER = megatron_files.LATEST  # latest_checkpointed_iteration.txt


def is_megatron_dir(path) -> bool:
    """A Megatron-LM checkpoint that is not also megalite's (a --save directory written with
    --ckpt-format torch_dist holds both: megalite's own files win)."""
    p = Path(path)
    return p.is_dir() and not fmt.has_checkpoint(p) and megatron_files.is_megatron(p)


def resolve(path) -> Path:
    """`fmt.resolve`, which also admits a Megatron checkpoint directory (one line if neither)."""
    return Path(path) if is_megatron_dir(path) else fmt.resolve(path)


def open_checkpoint(path):
    """A checkpoint opened for reading: megalite's own or Megatron's."""
    return MegatronCheckpoint(path) if is_megatron_dir(path) else fmt.Checkpoint(path)


def schedule_position(facts: dict) -> int | None:
    """Where Megatron's LR/WD scheduler stood (its num_steps: the samples of the successful
    steps, megalite's `schedule_samples`), or None when the checkpoint holds no scheduler."""
    sched = facts.get("scheduler")
    return None if sched is None else int(sched.get("num_steps", sched.get("num_iters", 0)))


def scheduler_state(cfg: Config, position: int) -> dict:
    """Megatron's `opt_param_scheduler` (OptimizerParamScheduler.state_dict()) of a run with
    `cfg`'s schedule at `position`: a Megatron run with the same flags loads it (its values
    checked equal to its own) and continues at the same learning rate and weight decay."""
    s = LRSchedule.from_config(cfg)
    return {"max_lr": s.lr, "lr_warmup_steps": s.warmup, "num_steps": int(position),
            "lr_decay_style": s.style, "lr_decay_steps": s.decay, "min_lr": s.min_lr,
            "start_wd": s.start_wd, "end_wd": s.end_wd, "wd_incr_style": s.wd_style,
            "wd_incr_steps": s.wd_incr}  # fmt: skip


def saved_config(model) -> dict:
    """The config a checkpoint made from another format carries: the model's, every other
    section default."""
    cfg = Config()
    cfg.model = model
    return cfg.to_dict()


class MegatronCheckpoint:
    """A Megatron checkpoint directory read as a megalite `Checkpoint` (what the checkpointer
    and `checkpoint/args.py` ask of one). Nothing is converted on disk: a rank reads a tensor,
    the Megatron files it comes from are read then (memory-mapped), and the last whole tensor
    is kept for the next region of it (a ZeRO shard reads several)."""

    files: dict = {}  # nothing megalite checksums (Megatron's files carry none)

    def __init__(self, path):
        src = Path(path)
        margs, state, facts = megatron_dist.read_megatron(src)
        self.dir = megatron_files.iteration_dir(src)
        model = megatron_args.config_from_args(margs)
        self._lazy = mg.from_megatron_lazy(state, model, f"the Megatron checkpoint {src}")
        if megatron_args.zero_centred_gamma(margs):  # --apply-layernorm-1p: weight - 1 stored
            self._lazy = mg.shift_norms(self._lazy, 1.0)
        self.tensors = {
            n: {"shape": list(s), "dtype": fmt.dtype_name(self._lazy.dtypes[n])}
            for n, s in self._lazy.shapes.items()
        }
        it = facts["iteration"]
        self.index = {
            "format": f"megatron:{facts['format']}",
            "iteration": int(it) if str(it).isdigit() else 0,  # ("release": 0)
            "consumed_samples": int(margs.get("consumed_train_samples") or 0),
            "skipped_steps": 0,
            "schedule_samples": schedule_position(facts),  # Megatron's LR/WD schedule position
            "optimizer": None,  # not mapped: the loading run starts a fresh optimizer
            "layout": None,  # another layout: RNG streams re-seed
            "rng": None,
            "config": saved_config(model),
        }
        self.load_note = (
            "; its Megatron optimizer state is not mapped (as with --no-load-optim)"
            if facts["optimizer"]
            else ""
        )
        self._held = (None, None)

    @property
    def iteration(self) -> int:
        return self.index["iteration"]

    @property
    def model_config(self) -> dict:
        return self.index["config"]["model"]

    def lazy(self) -> fmt.LazyTensors:
        return self._lazy

    def verify(self, files=None):
        """Nothing to check: Megatron writes no checksums (a damaged file fails when read)."""

    def has(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> list[int]:
        return self.tensors[name]["shape"]

    def names(self, optimizer=False) -> list[str]:
        return [] if optimizer else list(self.tensors)

    def read(self, name: str, region=None) -> torch.Tensor:
        if self._held[0] != name:
            self._held = (None, None)  # one whole tensor held at a time
            self._held = (name, self._lazy[name])
        whole = self._held[1]
        if region is None:
            return whole
        return whole[tuple(slice(lo, hi) for lo, hi in region)].contiguous()

    def close(self):
        self._held = (None, None)


# ---- writing Megatron's formats -------------------------------------------------------------------


def export_megatron(ckpt: fmt.Checkpoint, dst: Path, form: str = "torch_dist", tp: int = 1,
                    pp: int = 1, vpp: int = 1, ep: int = 1, transformer_impl: str = "local",
                    stages: dict | None = None, layernorm_1p: bool = False):  # fmt: skip
    """Write megalite checkpoint `ckpt` as a Megatron checkpoint DST/iter_N (+ the tracker):
    torch_dist (layout-free; the vocabulary padded for `tp`) or legacy at tp/pp/vpp/ep
    (`stages`: uneven pipeline stages by Megatron's args names). Weights, iteration, consumed
    samples and the LR scheduler's position; no optimizer or RNG state. `layernorm_1p`: for a
    Megatron run with --apply-layernorm-1p (norm weights stored as their offset from 1)."""
    cfg = from_dict({"model": ckpt.model_config}).model
    legacy = form == "legacy"
    dtype = getattr(torch, ckpt.tensors[ckpt.names()[0]]["dtype"])
    layout = (tp, pp, vpp, ep) if legacy else (tp, 1, None, 1)
    margs = megatron_args.args_from_config(
        cfg, *layout, iteration=ckpt.iteration, dtype=dtype,
        ckpt_format="torch" if legacy else "torch_dist", transformer_impl=transformer_impl,
        stages=stages if legacy else None,  # (torch_dist is layout-free: its args say pp=1)
    )  # fmt: skip
    # Megatron-LM takes the data position from the args (args.consumed_train_samples)
    margs["consumed_train_samples"] = int(ckpt.index.get("consumed_samples", 0))
    # not Megatron's own: the model's token ids (and generation config), for the way back to
    # Hugging Face (a Megatron run ignores args it does not know)
    if hub := hf.hub_fields(ckpt):
        margs["huggingface"] = hub
    # each Megatron tensor computed from the mapped checkpoint when a writer asks for it
    logical = ckpt.lazy()
    if layernorm_1p:
        margs.update(apply_layernorm_1p=True, layernorm_zero_centered_gamma=True)
        logical = mg.shift_norms(logical, -1.0)
    state = mg.to_megatron_lazy(logical, cfg, megatron_args.padded_vocab_size(cfg, tp))
    extra = _schedule_extra(ckpt)  # the LR scheduler's state (Megatron's opt_param_scheduler)
    if legacy:
        megatron_files.write_legacy(dst, state, margs, *layout, iteration=ckpt.iteration,
                                    transformer_impl=transformer_impl, extra=extra)  # fmt: skip
    else:
        megatron_dist.write_torch_dist(dst, state, margs, ckpt.iteration, transformer_impl, extra)


def _schedule_extra(ckpt) -> dict:
    """`opt_param_scheduler` for a checkpoint a training run saved (its optimizer's schedule
    position, its config's schedule); nothing for one without optimizer state (converted)."""
    position = (ckpt.index.get("optimizer") or {}).get("schedule_samples")
    if position is None:
        return {}
    return {"opt_param_scheduler": scheduler_state(from_dict(ckpt.index["config"]), position)}


FORMATS = {"torch_dist": "torch_dist", "torch": "legacy"}  # --ckpt-format -> export's form


def megatron_layout(cfg, form: str) -> dict:
    """export_megatron's layout for a run's saves: torch_dist padded for the run's tp; legacy
    (Megatron's --ckpt-format torch) at the run's tp/pp/vpp/ep and its uneven stages, so the
    Megatron job resumes it at the layout it ran."""
    p = cfg.parallel
    if form == "torch_dist":
        return {"tp": p.tp}
    stages = {k: getattr(p, k) for k in megatron_args.PIPELINE_SPLIT_ARGS if getattr(p, k)}
    return {"tp": p.tp, "pp": p.pp, "vpp": p.vpp, "ep": p.ep, "stages": stages}


def check_exportable(model, cfg):
    """--ckpt-format torch_dist|torch: refuse, before training, what Megatron's format cannot
    carry (one line from megatron_args)."""
    form = FORMATS[cfg.checkpoint.ckpt_format]
    if form == "legacy" and model.num_experts and cfg.parallel.etp != cfg.parallel.tp:
        raise MegaliteError(
            f"--ckpt-format torch writes experts split as Megatron's legacy files hold them "
            f"(--expert-tensor-parallel-size equal to --tp), not etp={cfg.parallel.etp} with "
            f"tp={cfg.parallel.tp}; use --ckpt-format torch_dist"
        )
    lay = megatron_layout(cfg, form)
    megatron_args.args_from_config(model, lay["tp"], lay.get("pp", 1), lay.get("vpp"),
                                   lay.get("ep", 1), stages=lay.get("stages"))  # fmt: skip


def write_beside(directory: Path, cfg):
    """Add Megatron's files (--ckpt-format: torch_dist, or legacy mp_rank_* folders) of the
    megalite checkpoint in `directory` (index written, not yet renamed into place) to that
    directory; the tracker is `write_tracker`'s."""
    form = FORMATS[cfg.checkpoint.ckpt_format]
    stage = directory / ".megatron"
    shutil.rmtree(stage, ignore_errors=True)
    try:
        ckpt = fmt.Checkpoint(directory)
        export_megatron(ckpt, stage, form, **megatron_layout(cfg, form),
                        layernorm_1p=cfg.checkpoint.megatron_layernorm_1p)  # fmt: skip
        ckpt.close()
        written = stage / fmt.iter_dirname(ckpt.iteration)
        for f in written.iterdir():
            f.rename(directory / f.name)
    except MegaliteError as e:
        raise OSError(f"Megatron's {form} files: {e}") from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def write_tracker(root: Path, iteration: int):
    """Megatron's `latest_checkpointed_iteration.txt`, once the iteration is in place."""
    writing.write_atomic(root / TRACKER, str(iteration))
