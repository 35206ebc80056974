"""Saving and resuming training: the distributed side of the checkpoint format (format.py).

Save (every rank takes part): the optimizer state is gathered over DP, then each (tp, pp)
position's DP rank 0 writes its slices of every logical tensor into one file in a temporary
directory; rank 0 gathers the index entries and RNG states, writes the index, renames the
directory into place, updates `latest` (atomically, last) and only then removes checkpoints
beyond --keep-checkpoints. A save that fails leaves the previous checkpoints as they were.

The checkpointer is handed what it saves (the model chunks, the optimizer, the tokenizer) and a
`TrainState` (iteration, data position, skipped steps, this rank's RNG); loading returns the
`TrainState` it found, which the trainer applies. It reads no other object's attributes.

Load: every rank reads, for each of its parameters, the region of the logical tensor its
layout needs (safetensors `get_slice`), whatever layout wrote it. Checksums are verified
before any tensor is read, each file by one rank. A rank's bad-input error is shared with all
ranks so that every rank stops with the same one line, none waiting in a collective.
"""

import base64
import dataclasses
import json
import shutil
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalite.checkpoint import format as fmt
from megalite.checkpoint.format import Checkpoint, opt_name
from megalite.errors import MegaliteError
from megalite.parallel import comm
from megalite.parallel.specs import spec_of

# Fields a checkpoint and a run must agree on beyond the tensor shapes (which are checked one
# by one): the shapes cannot tell a flavour apart, nor a prefix of the layers.
MODEL_FIELDS = ("flavour", "num_layers", "vocab_size")


@dataclass
class TrainState:
    """Where training stands, beside the tensors: what a resumed run continues from."""

    iteration: int = 0
    consumed_samples: int = 0
    skipped_steps: int = 0
    rng: dict | None = None  # this rank's generator states (None: re-seed, another layout)


def resume_path(cfg) -> str | None:
    """What the run resumes from: --load, else --save when it holds a checkpoint (a restarted
    job continues where it stopped), else nothing. Pure file checks, before any process group."""
    c = cfg.checkpoint
    if c.load:
        fmt.resolve(c.load)  # a missing or empty directory fails here, with one line
        return c.load
    if c.save and fmt.has_checkpoint(c.save):
        return c.save
    if cfg.training.eval_only:
        raise MegaliteError("--eval-only needs a checkpoint to evaluate; pass --load DIR")
    return None


# ---- agreement between ranks ---------------------------------------------------------------------


def _world():
    """The world as a counted group (a world of one without torch.distributed)."""
    n = dist.get_world_size() if dist.is_initialized() else 1
    r = dist.get_rank() if dist.is_initialized() else 0
    return comm.Group("world", list(range(n)), r, dist.group.WORLD if n > 1 else None)


def _all_gather(obj, group=None) -> list:
    # Small Python objects (messages, index entries, RNG states as base64) between our own
    # processes; nothing read from disk is ever unpickled.
    return comm.all_gather_object(obj, group or _world())


@contextmanager
def agreed_errors(group=None):
    """Run a block on every rank; if any rank raises MegaliteError, every rank raises it."""
    error = None
    try:
        yield
    except MegaliteError as e:
        error = str(e)
    errors = [e for e in _all_gather(error, group) if e]
    if errors:
        raise MegaliteError(errors[0])


# ---- the parameters of a rank and the regions they hold ----------------------------------------


def _params(chunks):
    """(logical tensor, parameter, spec) for every parameter of this rank's chunks; the last
    stage's tied copy reads the first stage's embedding."""
    for chunk in chunks:
        for p in chunk.parameters():
            spec = spec_of(p)
            yield spec.source, p, spec


def _read_padded(ckpt: Checkpoint, name: str, region, shape) -> torch.Tensor:
    """The region of a tensor, with zero rows added where the local tensor has vocabulary padding."""
    t = ckpt.read(name, region)
    if t.shape[0] < shape[0]:
        t = F.pad(t, (0,) * (2 * (t.dim() - 1)) + (0, shape[0] - t.shape[0]))
    return t


def check_model(chunks, tp, ckpt: Checkpoint):
    """Every parameter of these chunks is in the checkpoint with the global shape it needs."""
    for name, _, spec in _params(chunks):
        if not ckpt.has(name):
            raise MegaliteError(
                f"checkpoint {ckpt.dir} has no tensor {name}; it holds another model "
                "(check --num-layers, the flavour and --untie-embeddings-and-output-weights)"
            )
        if list(ckpt.shape(name)) != list(spec.shape):
            raise MegaliteError(
                f"tensor {name} has shape {list(ckpt.shape(name))} in checkpoint {ckpt.dir} but "
                f"{list(spec.shape)} in this model; use the model flags the checkpoint was trained with"
            )


@torch.no_grad()
def load_model(chunks, tp, ckpt: Checkpoint):
    """Copy this rank's slices of the model weights into the chunks (any layout)."""
    check_model(chunks, tp, ckpt)
    for name, p, spec in _params(chunks):
        p.copy_(_read_padded(ckpt, name, spec.region(), p.shape))


def _load_optimizer(chunks, tp, optimizer, ckpt: Checkpoint):
    """The moments (and masters) of this rank's parameters, or a fresh optimizer whose masters
    start from the loaded weights when the checkpoint has none (e.g. converted from HF)."""
    scalars = ckpt.index.get("optimizer")
    state = {}
    for name, p, spec in _params(chunks):
        if scalars is None:
            state[name] = {k: torch.zeros_like(p) for k in ("exp_avg", "exp_avg_sq")}
            continue
        kinds = [k for k in fmt.OPTIMIZER_KINDS if ckpt.has(opt_name(k, name))]
        if "exp_avg" not in kinds or "exp_avg_sq" not in kinds:
            raise MegaliteError(
                f"checkpoint {ckpt.dir} lacks the optimizer state of {name}; the index is incomplete"
            )
        region = spec.region()
        state[name] = {k: _read_padded(ckpt, opt_name(k, name), region, p.shape) for k in kinds}
    optimizer.load_state_tensors(state)
    if scalars is not None:
        optimizer.load_scalar_state(scalars)


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def _encode_rng(rng: dict) -> dict:
    return {k: (None if v is None else [_b64(t) for t in v] if isinstance(v, list) else _b64(v))
            for k, v in rng.items()}  # fmt: skip


def _decode_rng(d: dict) -> dict:
    return {k: (None if v is None else [_unb64(t) for t in v] if isinstance(v, list) else _unb64(v))
            for k, v in d.items() if k != "rank"}  # fmt: skip


# ---- the trainer's checkpointing -----------------------------------------------------------------


class Checkpointer:
    """--save/--load/--save-interval/--keep-checkpoints and preemption, for the parts it is
    handed: cfg (recorded in the index), the run shape, groups, this rank's model chunks, the
    optimizer and the tokenizer model the run reads (or None)."""

    def __init__(self, cfg, shape, groups, chunks, optimizer, tokenizer_path=None, log=print):
        self.cfg, self.shape, self.groups = cfg, shape, groups
        self.chunks, self.optimizer, self.tokenizer_path = chunks, optimizer, tokenizer_path
        self.log = log
        self.last_saved = None  # iteration of the newest checkpoint in --save
        self._signal = None

    # ---- loading ----------------------------------------------------------------------------

    def resume(self) -> TrainState | None:
        """Load what `resume_path` picks (if anything)."""
        path = resume_path(self.cfg)
        return None if path is None else self.load(path)

    def load(self, path) -> TrainState:
        g, tp = self.groups, self.groups.tp
        start = time.perf_counter()
        with agreed_errors(g.world):
            ckpt = Checkpoint(path)
            files = sorted(ckpt.files)
            ckpt.verify(files[g.rank :: g.topo.world_size])  # each file hashed by one rank
            self._check_compatible(ckpt)
            check_model(self.chunks, tp, ckpt)
        with agreed_errors(g.world):
            load_model(self.chunks, tp, ckpt)
            _load_optimizer(self.chunks, tp, self.optimizer, ckpt)
        idx = ckpt.index
        same_layout = idx.get("layout") == self.shape.layout()
        rng = idx["rng"][g.rank] if idx.get("rng") and same_layout else None
        state = TrainState(ckpt.iteration, int(idx.get("consumed_samples", 0)),
                           int(idx.get("skipped_steps", 0)), rng and _decode_rng(rng))  # fmt: skip
        save = self.cfg.checkpoint.save
        if save and Path(save).resolve() == ckpt.dir.parent.resolve():
            self.last_saved = ckpt.iteration
        what = "weights only, fresh optimizer" if idx.get("optimizer") is None else "resuming"
        rng_note = "" if same_layout else "; another layout, so RNG streams are re-seeded"
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

    def _local_tensors(self, opt_state: dict) -> dict:
        """{index name: (tensor, region, global shape)} of what this (tp, pp) position writes."""
        tp = self.groups.tp
        out = {}
        for name, p, spec in _params(self.chunks):
            if spec.tied_to or (spec.split_dim is None and tp.rank != 0):
                continue  # tied copies are the first stage's tensor; TP replicas are written once
            region = spec.region()
            rows = region[0][1] - region[0][0]  # fewer than p.shape[0] where vocabulary padding is
            out[name] = (p[:rows], region, spec.shape)
            for kind, t in opt_state[name].items():
                out[opt_name(kind, name)] = (t[:rows], region, spec.shape)
        return out

    def save(self, state: TrainState):
        g, c = self.groups, self.cfg.checkpoint
        start = time.perf_counter()
        it = state.iteration
        root = Path(c.save)
        final, tmp = root / fmt.iter_dirname(it), root / f".{fmt.iter_dirname(it)}.tmp"
        opt_state = self.optimizer.state_tensors()  # collective over DP
        with agreed_errors(g.world):
            if g.rank == 0:
                try:
                    root.mkdir(parents=True, exist_ok=True)
                    shutil.rmtree(tmp, ignore_errors=True)  # a save that died at this iteration
                    tmp.mkdir()
                except OSError as e:
                    raise MegaliteError(f"cannot create checkpoint directory {tmp}: {e}") from None
        entries, files, error = {}, {}, None
        if g.replicas.rank == 0:
            fname = f"model-tp{g.tp.rank:02d}-pp{g.pp.rank:02d}.safetensors"
            try:
                entries, files = fmt.write_shard(tmp, fname, self._local_tensors(opt_state))
            except OSError as e:
                error = f"could not write checkpoint file {tmp / fname} ({e})"
        del opt_state
        rng = {"rank": g.rank, **_encode_rng(state.rng or {})}
        parts = _all_gather((entries, files, rng, error), g.world)
        outcome = self._commit(parts, tmp, final, state) if g.rank == 0 else None
        outcome = _all_gather(outcome, g.world)[0]
        if outcome is not None:
            raise MegaliteError(outcome)
        self.last_saved = it
        nbytes = sum(m["bytes"] for p in parts for m in p[1].values())
        secs = time.perf_counter() - start
        self.log(
            f"saved checkpoint {final} ({nbytes / 1e9:.3f} GB) in {secs:.1f} s "
            f"({nbytes / 1e9 / max(secs, 1e-9):.2f} GB/s)"
        )

    def _commit(self, parts, tmp: Path, final: Path, state: TrainState) -> str | None:
        """Rank 0: write the index, move the checkpoint into place, point `latest` at it, prune.
        Returns an error message, or None."""
        c = self.cfg.checkpoint
        errors = [p[3] for p in parts if p[3]]
        try:
            if errors:
                raise OSError(errors[0])
            files = {k: v for p in parts for k, v in p[1].items()}
            if self.tokenizer_path is not None:  # generate.py and conversion to HF find it here
                files.update(fmt.copy_tokenizer(self.tokenizer_path, tmp))
            config = {**self.cfg.to_dict(), "model": dataclasses.asdict(self.shape.model)}
            index = {
                "format": fmt.FORMAT,
                "iteration": state.iteration,
                "consumed_samples": state.consumed_samples,
                "skipped_steps": state.skipped_steps,
                "optimizer": self.optimizer.scalar_state(),
                "layout": self.shape.layout(),
                "zero_stage": self.cfg.optimizer.zero_stage,
                "config": config,
                "rng": [p[2] for p in parts],
                "files": files,
                "tensors": fmt.merge_entries([p[0] for p in parts]),
            }
            fmt.write_atomic(tmp / fmt.INDEX, json.dumps(index, indent=1))
            old = final.with_name(f".{final.name}.old")
            if final.exists():  # the same iteration saved again: keep the old one until replaced
                shutil.rmtree(old, ignore_errors=True)
                final.rename(old)
            tmp.rename(final)
            fmt.fsync_dir(final.parent)
            fmt.write_atomic(final.parent / fmt.LATEST, final.name)
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

    @contextmanager
    def catch_preemption(self):
        """With --save, SIGTERM (preemption) and SIGINT (Ctrl-C) make the run save at the end of
        the current step and stop; a second Ctrl-C stops at once."""
        if not self.cfg.checkpoint.save:
            yield
            return

        def handler(signum, frame):
            if self._signal == signal.SIGINT and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self._signal = signum

        old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    @property
    def signalled(self) -> bool:
        """This rank got SIGTERM/SIGINT (the trainer shares it in the step's status reduction,
        so every rank stops at the same step)."""
        return self._signal is not None

    def after_step(self, state_fn, stop: bool) -> bool:
        """Save when due (`state_fn()` gives the TrainState) or when `stop` (some rank was
        signalled); returns `stop`."""
        c = self.cfg.checkpoint
        if not c.save:
            return False
        state = state_fn()
        if stop or (c.save_interval and state.iteration % c.save_interval == 0):
            self.save(state)
        if stop:
            name = signal.Signals(self._signal).name if self._signal else "a signal on another rank"
            self.log(f"received {name}: saved iteration {state.iteration} to {c.save}; stopping")
        return stop

    def finish(self, state: TrainState):
        """The save at the end of training (unless this iteration is saved already)."""
        if self.cfg.checkpoint.save and self.last_saved != state.iteration:
            self.save(state)
