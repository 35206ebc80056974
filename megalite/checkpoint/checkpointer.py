"""Saving and resuming training: the distributed side of the checkpoint format (format.py).

Save (every rank takes part): each rank writes one file into a temporary directory, with its
own ZeRO shard of the weights and the optimizer state (DP rank 0 all of them at ZeRO-0, TP
rank 0 the TP replicas), so nothing is gathered over DP, hashed beside the write and handed to
the disk as it goes (shard_io.py: a save runs at disk speed, steadily). Rank 0 gathers the
index entries and RNG states, writes the index, renames the directory into place, updates `latest`
(atomically, last) and only then removes checkpoints beyond --keep-checkpoints. A save that fails leaves the previous
checkpoints as they were. With --async-save the step copies what it writes to host memory and
a background thread writes the same files (async_save.py); the next save, a signal and the
end of training wait for it, and its error stops every rank there.

The checkpointer is handed what it saves (the model chunks, the optimizer, the tokenizer) and a
`TrainState` (iteration, data position, skipped steps, this rank's RNG); loading returns the
`TrainState` it found, which the trainer applies. It reads no other object's attributes.

Load: every rank reads, for each of its parameters, the region of the logical tensor its
layout needs (safetensors `get_slice`), whatever layout wrote it, and of the optimizer state
only its own ZeRO shard. Checksums are verified before any tensor is read, each file by one
rank. A rank's bad-input error is shared with all ranks so that every rank stops with the
same one line, none waiting in a collective.
--finetune loads the weights only and starts at iteration 0; --no-load-optim and --no-load-rng
leave out the optimizer state and the RNG states (not when a restart resumes its own --save).
--load also reads a Megatron-LM checkpoint, and --ckpt-format torch_dist adds Megatron's files
to each save (megatron_direct.py). Which checkpoint a run resumes from, decided before any
process group exists, and the `TrainState` are resume.py's.
"""

import dataclasses
import json
import shutil
import time
from pathlib import Path

from megalite.checkpoint import format as fmt
from megalite.checkpoint import megatron_direct, shard_io, writing
from megalite.checkpoint.async_save import (
    BackgroundSave,
    Part,
    collect_parts,
    host_copy,
    write_part,
)
from megalite.checkpoint.format import Checkpoint, opt_name
from megalite.checkpoint.regions import (  # noqa: F401  (check_model, load_model: tools and tests)
    agreed_errors,
    all_gather,
    check_model,
    decode_rng,
    encode_rng,
    fp8_tensors,
    load_fp8_state,
    load_model,
    load_optimizer,
    piece_blocks,
    rank_params,
)
from megalite.checkpoint.resume import TrainState, resumes_own_save
from megalite.errors import MegaliteError
from megalite.model.moe import expert_biases
from megalite.parallel.specs import spec_of

# Fields a checkpoint and a run must agree on beyond the tensor shapes (which are checked one
# by one): the shapes cannot tell a flavour apart, nor a prefix of the layers.
MODEL_FIELDS = ("flavour", "num_layers", "vocab_size")
# Index fields about the model, not the run, that a save carries on from the checkpoint loaded.
CARRIED = ("huggingface",)


class Checkpointer:
    """--save/--load/--save-interval/--keep-checkpoints, for the parts it is handed: cfg
    (recorded in the index), the run shape, groups, this rank's model chunks, the optimizer
    and the tokenizer model the run reads (or None). When to stop early is the trainer's
    (training/preemption.py); the checkpointer saves when told."""

    def __init__(self, cfg, shape, groups, chunks, optimizer, tokenizer_path=None, log=print):
        self.cfg, self.shape, self.groups = cfg, shape, groups
        self.chunks, self.optimizer, self.tokenizer_path = chunks, optimizer, tokenizer_path
        self.log = log
        self.last_saved = None  # iteration of the newest checkpoint in --save
        self._background = BackgroundSave()  # --async-save: the save in flight
        self._host = {}  # --async-save: host buffers reused from save to save
        # what the loaded checkpoint says beyond the run (a converted model's Hugging Face
        # token ids and generation config): carried into every save, for the export back
        self.carried = {}
        # --ckpt-format torch_dist|torch: Megatron's files beside each save's (None: megalite's only)
        self.megatron_form = megatron_direct.FORMATS.get(cfg.checkpoint.ckpt_format)
        if cfg.checkpoint.save and self.megatron_form:
            megatron_direct.check_exportable(shape.model, cfg)  # one line, now

    # ---- loading ----------------------------------------------------------------------------

    def load(self, path, own: bool | None = None) -> TrainState:
        """Load a checkpoint into the chunks and optimizer; --finetune (weights only, from
        iteration 0), --no-load-optim and --no-load-rng apply unless `path` is --save's own
        (or `own`: the run's local checkpoint, local_restore.py)."""
        g, tp, c = self.groups, self.groups.tp, self.cfg.checkpoint
        # a restart resuming its own --save (or local checkpoint) continues in full
        own = own or resumes_own_save(self.cfg, path)
        finetune = c.finetune and not own
        start = time.perf_counter()
        with agreed_errors(g.world):
            ckpt = megatron_direct.open_checkpoint(path)  # megalite's own, or Megatron's
            files = sorted(ckpt.files)
            ckpt.verify(files[g.rank :: g.topo.world_size])  # each file hashed by one rank
            self._check_compatible(ckpt)
            check_model(self.chunks, tp, ckpt)
        with agreed_errors(g.world):
            with self.optimizer.gathered_params(write_back=True):  # ZeRO-3 holds shards
                no_bias = load_model(self.chunks, tp, ckpt)
            no_fp8 = load_fp8_state(self.chunks, ckpt)
            fresh = finetune or not (c.load_optim or own)
            load_optimizer(self.chunks, tp, self.optimizer, ckpt, fresh)
        idx = ckpt.index
        self.carried = {k: idx[k] for k in CARRIED if idx.get(k)}
        same_layout = idx.get("layout") == self.shape.layout()
        keep_rng = same_layout and not finetune and (c.load_rng or own)
        rng = idx["rng"][g.rank] if idx.get("rng") and keep_rng else None
        state = TrainState(ckpt.iteration, int(idx.get("consumed_samples", 0)),
                           int(idx.get("skipped_steps", 0)), rng and decode_rng(rng),
                           idx.get("run_ids"))  # fmt: skip
        if idx.get("schedule_samples") is not None and not fresh:  # (as Megatron: with the optim)
            state.schedule_samples = int(idx["schedule_samples"])
        if finetune:  # weights only: a new run that starts from them
            state = TrainState()
        if c.save and Path(c.save).resolve() == ckpt.dir.parent.resolve() and not finetune:
            self.last_saved = ckpt.iteration
        what = (
            "weights only, fresh optimizer" if idx.get("optimizer") is None or fresh else "resuming"
        )
        what = "fine-tuning from its weights at iteration 0" if finetune else what
        rng_note = "" if keep_rng or not same_layout else "; RNG streams re-seeded"
        rng_note = rng_note if same_layout else "; another layout, so RNG streams are re-seeded"
        if not fresh:  # a Megatron checkpoint's optimizer state, not mapped
            rng_note += getattr(ckpt, "load_note", "")
        if no_bias:  # written before checkpoints held them
            rng_note += f"; it holds no expert bias ({no_bias[0]}, ...): they start from zero"
        if no_fp8:  # trained without delayed FP8 scaling
            rng_note += f"; it holds no FP8 amax history ({no_fp8[0]}, ...): they start empty"
        self.log(
            f"loaded checkpoint {ckpt.dir} (iteration {ckpt.iteration}, {what}{rng_note}) in "
            f"{time.perf_counter() - start:.1f} s"
        )
        ckpt.close()
        return state

    def _check_compatible(self, ckpt: Checkpoint):
        ours, theirs = self.shape.model, ckpt.model_config
        saved_tok = fmt.stored_tokenizer(ckpt.files)  # tokenizer.model or tokenizer.json
        for f in MODEL_FIELDS:
            if theirs.get(f) != getattr(ours, f):
                hint = (
                    f"pass the checkpoint's tokenizer: --tokenizer-model {ckpt.dir / saved_tok}"
                    if f == "vocab_size" and saved_tok
                    else "use the model flags the checkpoint was trained with"
                )
                raise MegaliteError(
                    f"checkpoint {ckpt.dir} has {f}={theirs.get(f)} but this run has "
                    f"{getattr(ours, f)}; {hint}"
                )
        tok, saved = self.tokenizer_path, ckpt.files.get(saved_tok) if saved_tok else None
        if tok is not None and saved and fmt.sha256_file(Path(tok)) != saved["sha256"]:
            raise MegaliteError(
                f"tokenizer {tok} differs from the one checkpoint {ckpt.dir} was trained "
                f"with; pass --tokenizer-model {ckpt.dir / saved_tok}"
            )

    # ---- saving -----------------------------------------------------------------------------

    def _local_tensors(self) -> dict:
        """{key: (tensor, region, global shape)} of what this rank writes (shard_io.write_shard):
        its own part of the weights and the optimizer state (optimizer.state_pieces: nothing is
        gathered), as blocks of the global tensors. TP replicas are written by TP rank 0, the
        expert biases (buffers, equal on every rank of a stage) by each stage's first rank."""
        out = {}
        for piece in self.optimizer.state_pieces():
            p, spec = piece.range.param, spec_of(piece.range.param)
            if not piece.writes or (spec.split_dim is None and self.groups.tp.rank != 0):
                continue
            blocks = piece_blocks(spec, p.shape, piece.lo, piece.hi)
            whole = (piece.lo, piece.hi) == (0, p.numel()) and len(blocks) == 1
            for i, (lo, hi, region) in enumerate(blocks):
                shape = [b - a for a, b in region]
                for kind, t in piece.views.items():
                    key = spec.source if kind == "param" else opt_name(kind, spec.source)
                    key += "" if whole else f"#{i}"
                    out[key] = (t[lo:hi].view(shape), region, spec.shape)
        topo, rank = self.groups.topo, self.groups.rank
        if rank == topo.rank(pp=topo.coords(rank)["pp"]):  # the first rank of each stage
            for name, bias in expert_biases(self.chunks):  # replicated buffers, whole (fp32)
                out[name] = (bias, [(0, bias.numel())], list(bias.shape))
            for name, t in fp8_tensors(self.chunks).items():  # delayed FP8: amax histories
                out[name] = (t, [(0, n) for n in t.shape], list(t.shape))
        return out

    def _paths(self, iteration: int) -> tuple[Path, Path]:
        root = Path(self.cfg.checkpoint.save)
        name = fmt.iter_dirname(iteration)
        return root / name, root / f".{name}.tmp"

    def _make_tmp(self, tmp: Path):
        """Rank 0 creates the (empty) temporary directory; every rank learns if it failed."""
        with agreed_errors(self.groups.world):
            if self.groups.rank == 0:
                try:
                    tmp.parent.mkdir(parents=True, exist_ok=True)
                    shutil.rmtree(tmp, ignore_errors=True)  # a save that died at this iteration
                    tmp.mkdir()
                except OSError as e:
                    raise MegaliteError(f"cannot create checkpoint directory {tmp}: {e}") from None

    def _meta(self, state: TrainState) -> dict:
        """The index fields besides files and tensors, taken when the save starts."""
        return {
            "format": fmt.FORMAT,
            "iteration": state.iteration,
            "consumed_samples": state.consumed_samples,
            "skipped_steps": state.skipped_steps,
            "run_ids": state.run_ids or {},
            "optimizer": self.optimizer.scalar_state(),
            "layout": self.shape.layout(),
            "zero_stage": self.cfg.optimizer.zero_stage,
            "config": {**self.cfg.to_dict(), "model": dataclasses.asdict(self.shape.model)},
            **self.carried,
        }

    @property
    def _fname(self) -> str:
        """The file this rank writes, named by its coordinates: tp and pp, and every other axis
        of more than one rank (model-tp01-dp00-pp01.safetensors)."""
        topo = self.groups.topo
        coords = topo.coords(self.groups.rank).items()
        name = "-".join(f"{a}{i:02d}" for a, i in coords if a in ("tp", "pp") or topo.sizes[a] > 1)
        return f"model-{name}.safetensors"

    def save(self, state: TrainState):
        """Save `state` and the parts (collective: every rank calls it). With --async-save the
        files are written in the background: see async_save.py."""
        if self.cfg.checkpoint.async_save:
            self._save_async(state)
        else:
            self._save_sync(state)

    def _save_sync(self, state: TrainState):
        g = self.groups
        start = time.perf_counter()
        final, tmp = self._paths(state.iteration)
        self._make_tmp(tmp)
        entries, files, error, tensors = {}, {}, None, self._local_tensors()
        if tensors:
            try:
                entries, files = shard_io.write_shard(tmp, self._fname, tensors)
            except OSError as e:
                error = f"could not write checkpoint file {tmp / self._fname} ({e})"
        rng = {"rank": g.rank, **encode_rng(state.rng or {})}
        parts = all_gather(Part(entries, files, rng, error), g.world)
        outcome = self._commit(parts, tmp, final, self._meta(state)) if g.rank == 0 else None
        outcome = all_gather(outcome, g.world)[0]
        if outcome is not None:
            raise MegaliteError(outcome)
        self.last_saved = state.iteration
        self._log_saved(final, parts, time.perf_counter() - start)

    def _log_saved(self, final: Path, parts: list[Part], secs: float, how: str = ""):
        nbytes = sum(m["bytes"] for p in parts for m in p.files.values())
        self.log(
            f"saved checkpoint {final} ({nbytes / 1e9:.3f} GB) in {secs:.1f} s{how} "
            f"({nbytes / 1e9 / max(secs, 1e-9):.2f} GB/s)"
        )

    def _save_async(self, state: TrainState):
        """The foreground of an asynchronous save: wait for the previous one, copy this rank's
        own shard to host (nothing is gathered over DP), gather the RNG states, start the
        background write. Returns once the step may go on."""
        g = self.groups
        self.wait()  # one save in flight at most; its error stops every rank here
        start = time.perf_counter()
        final, tmp = self._paths(state.iteration)
        self._make_tmp(tmp)
        tensors, event = host_copy(self._local_tensors(), self._host)
        fname = self._fname if tensors else None
        rng = {"rank": g.rank, **encode_rng(state.rng or {})}
        gathered = all_gather((rng, fname is not None), g.world)  # the last collective
        meta = self._meta(state)
        timeout = self.cfg.parallel.distributed_timeout_minutes * 60

        def write() -> str | None:  # the background thread: files only, no collective
            if event is not None:
                event.synchronize()  # the copies to host memory have landed
            own = write_part(tmp, fname, tensors, g.rank, g.rank != 0) if fname else Part()
            if g.rank != 0:
                return own.error
            try:
                parts = collect_parts(tmp, own, *zip(*gathered), timeout)
            except OSError as e:
                parts = [Part(error=str(e))]
            error = self._commit(parts, tmp, final, meta)
            if error is None:
                self._log_saved(final, parts, time.perf_counter() - start, " in the background")
            return error

        self._background.start(write)
        self.last_saved = state.iteration
        self.log(
            f"saving checkpoint {final} in the background (the step waited {time.perf_counter() - start:.2f} s)"
        )

    def wait(self):
        """Wait for the save in flight (if any); every rank raises its error, or none does
        (collective when a save was in flight, which every rank knows alike)."""
        if not self._background.busy:
            return
        errors = [e for e in all_gather(self._background.wait(), self.groups.world) if e]
        if errors:
            raise MegaliteError(errors[0])

    def _commit(self, parts: list[Part], tmp: Path, final: Path, meta: dict) -> str | None:
        """Rank 0: write the index, move the checkpoint into place, point `latest` at it, prune.
        Returns an error message, or None."""
        c = self.cfg.checkpoint
        errors = [p.error for p in parts if p.error]
        try:
            if errors:
                raise OSError(errors[0])
            files = {k: v for p in parts for k, v in p.files.items()}
            if self.tokenizer_path is not None:  # generate.py and conversion to HF find it here
                files.update(writing.copy_tokenizer(self.tokenizer_path, tmp))
            index = {**meta, "rng": [p.rng for p in parts], "files": files,
                     "tensors": writing.merge_entries([p.entries for p in parts])}  # fmt: skip
            writing.write_atomic(tmp / fmt.INDEX, json.dumps(index, indent=1))
            if self.megatron_form:  # Megatron's files too, in the same directory
                megatron_direct.write_beside(tmp, self.cfg)
            old = final.with_name(f".{final.name}.old")
            if final.exists():  # the same iteration saved again: keep the old one until replaced
                shutil.rmtree(old, ignore_errors=True)
                final.rename(old)
            tmp.rename(final)
            writing.fsync_dir(final.parent)
            writing.write_atomic(final.parent / fmt.LATEST, final.name)
            if self.megatron_form:
                megatron_direct.write_tracker(final.parent, meta["iteration"])
            shutil.rmtree(old, ignore_errors=True)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            return f"could not save checkpoint {final} ({e}); the previous checkpoints are intact"
        self._prune(final.parent, keep=c.keep_checkpoints, current=final.name)
        return None

    @staticmethod
    def _prune(root: Path, keep: int, current: str):
        if keep <= 0:
            return
        done = sorted(p for p in root.glob("iter_*") if (p / fmt.INDEX).is_file())
        for p in done[:-keep]:
            if p.name != current:
                shutil.rmtree(p, ignore_errors=True)

    # ---- during training -----------------------------------------------------------------------

    def after_step(self, state_fn, stop: str | None) -> bool:
        """Save when due (`state_fn()` gives the TrainState) or when `stop` says why the run
        stops now (a signal on some rank, a time limit); returns whether it stops."""
        c = self.cfg.checkpoint
        if not c.save:
            if stop:
                self.log(f"{stop}: stopping (no --save, so nothing is saved)")
            return bool(stop)
        state = state_fn()
        if stop or (c.save_interval and state.iteration % c.save_interval == 0):
            self.save(state)
        if stop:
            self.wait()  # the process exits next: the background write must be complete
            self.log(f"{stop}: saved iteration {state.iteration} to {c.save}; stopping")
        return bool(stop)

    def finish(self, state: TrainState):
        """The save at the end of training (unless this iteration is saved already); waits for
        the background write."""
        if self.cfg.checkpoint.save and self.last_saved != state.iteration:
            self.save(state)
        self.wait()
