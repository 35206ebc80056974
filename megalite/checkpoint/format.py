"""The on-disk checkpoint format: safetensors shards plus one JSON index, topology-free.

A checkpoint is a directory (`RUN/iter_0000020/`) holding

  index.json            what everything is (below)
  *.safetensors         the tensor data: slices of the tensors
  tokenizer.model       the tokenizer the run trained with, when it had one: a sentencepiece
  or tokenizer.json     model, or a Hugging Face tokenizers file (the name says which)

The index names every logical tensor (model weights by their logical name, optimizer state as
`optimizer.<kind>.<name>` with kind exp_avg, exp_avg_sq, momentum (Muon) or master), its global shape and dtype,
and the slices the files hold as index ranges of the global tensor:

  "tensors": {"layers.0.mlp.up.weight": {"shape": [128, 32], "dtype": "float32",
               "shards": [{"file": "model-tp00-pp00.safetensors", "slice": [[0, 64], [0, 32]]},
                          {"file": "model-tp01-pp00.safetensors", "slice": [[64, 128], [0, 32]]}]}}

Global means: as one process would hold it, with the real vocabulary (no padding rows). Inside
a file a slice is stored under the tensor's index name, or under the shard's "key" where a file
holds several slices of one tensor: a ZeRO shard's part of a parameter is a flat range, which
is stored as up to 2·ndim−1 rectangular blocks, keyed `<name>#<i>` (checkpointer.py). Which
slice of a weight a rank holds is its parameter's `ParamSpec.region` (parallel/specs.py). The
index also holds the sha256 of every file, the iteration, consumed samples, optimizer
scalars, the full config and the RNG states of every rank. Only JSON and safetensors are ever
read: no pickle. The files are valid safetensors files, written by writing.py's `write_shard`.

This module is the format's names and its reading (`Checkpoint`, `resolve`); writing.py
writes it.
"""

import hashlib
import json
import threading
from functools import partial
from pathlib import Path

import torch

from megalite.checkpoint.safetensors_file import MappedSafetensors
from megalite.errors import MegaliteError

FORMAT = "megalite-checkpoint/1"
INDEX = "index.json"
LATEST = "latest"
TOKENIZER = "tokenizer.model"  # a sentencepiece model
HF_TOKENIZER = "tokenizer.json"  # a Hugging Face tokenizers file
TOKENIZERS = (TOKENIZER, HF_TOKENIZER)
OPTIMIZER_KINDS = ("exp_avg", "exp_avg_sq", "momentum", "master")


def iter_dirname(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def opt_name(kind: str, name: str) -> str:
    return f"optimizer.{kind}.{name}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def sha256_file(path: Path, block: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(block):
            h.update(chunk)
    return h.hexdigest()


def _safe_name(name, where: Path) -> str:
    """A file name from an index or a `latest` file: a plain name inside the checkpoint."""
    if not isinstance(name, str) or not name or name in (".", "..") or Path(name).name != name:
        raise MegaliteError(
            f"{where} names the file {name!r}, which is not a plain file name inside the "
            "checkpoint directory; refusing to read it (the index is damaged or was tampered with)"
        )
    return name


def tokenizer_name(src) -> str:
    """The name a tokenizer file is stored under, from its content: JSON is a Hugging Face
    tokenizer.json; anything else a sentencepiece model (a protobuf, which never starts with
    '{'). The file's own name is not trusted: it may be anything --tokenizer-type allowed."""
    with open(src, "rb") as fh:
        head = fh.read(64).lstrip()
    return HF_TOKENIZER if head.startswith(b"{") else TOKENIZER


def stored_tokenizer(files: dict) -> str | None:
    """The tokenizer file among a checkpoint's `files` (its index), or None."""
    return next((name for name in TOKENIZERS if name in files), None)


# ---- reading -------------------------------------------------------------------------------------


class LazyTensors(dict):
    """Tensors read or computed when asked: {name: a function that returns the tensor}, with
    each one's `shapes` (and `dtypes`) where they are known before any is read. `lazy[name]`
    calls it, and `items()`/`values()` do too, one at a time (a conversion holds one, never the
    model)."""

    def __init__(self, thunks: dict, shapes: dict | None = None, dtypes: dict | None = None):
        super().__init__(thunks)
        self.shapes, self.dtypes = shapes, dtypes

    def __getitem__(self, name):
        return super().__getitem__(name)()

    def get(self, name, default=None):
        return self[name] if name in self else default

    def items(self):
        return ((k, self[k]) for k in self)

    def values(self):
        return (self[k] for k in self)


def resolve(path) -> Path:
    """The checkpoint directory for `path`: an iter dir (with index.json) or a run dir whose
    `latest` file names one."""
    p = Path(path)
    if not p.is_dir():
        raise MegaliteError(
            f"checkpoint directory {p} does not exist; pass a directory written by --save "
            "(or one of its iter_* folders)"
        )
    if (p / INDEX).is_file():
        return p
    if (p / LATEST).is_file():
        name = _safe_name((p / LATEST).read_text().strip(), p / LATEST)
        if not (p / name / INDEX).is_file():
            raise MegaliteError(
                f"{p / LATEST} points to {name}, which holds no {INDEX}; pass one of the iter_* "
                "folders of that directory to --load"
            )
        return p / name
    raise MegaliteError(
        f"{p} holds no checkpoint (neither {INDEX} nor a {LATEST} file); pass a directory "
        "written by --save"
    )


def has_checkpoint(path) -> bool:
    p = Path(path)
    return (p / INDEX).is_file() or (p / LATEST).is_file()


class Checkpoint:
    """A checkpoint directory opened for reading: its index, and slices of its tensors."""

    def __init__(self, path):
        self.dir = resolve(path)
        try:
            self.index = json.loads((self.dir / INDEX).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise MegaliteError(
                f"{self.dir / INDEX} is not readable JSON ({e}); the checkpoint is damaged"
            ) from None
        if not isinstance(self.index, dict) or self.index.get("format") != FORMAT:
            raise MegaliteError(
                f"{self.dir / INDEX} is not a {FORMAT} index; convert other checkpoints with "
                "tools/convert_checkpoint.py"
            )
        try:
            self.tensors: dict = self.index["tensors"]
            self.files: dict = self.index["files"]
            for fname in self.files:
                _safe_name(fname, self.dir / INDEX)
            for name, e in self.tensors.items():
                for s in e["shards"]:
                    if _safe_name(s["file"], self.dir / INDEX) not in self.files:
                        raise MegaliteError(
                            f"{self.dir / INDEX}: tensor {name} is in {s['file']}, which the "
                            "index does not list with a checksum; the checkpoint is damaged"
                        )
                    if len(s["slice"]) != len(e["shape"]) or not isinstance(s.get("key", ""), str):
                        raise ValueError(name)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise MegaliteError(
                f"{self.dir / INDEX} is malformed ({type(e).__name__}: {e}); the checkpoint is "
                "damaged"
            ) from None
        self._open = {}

    @property
    def iteration(self) -> int:
        return int(self.index.get("iteration", 0))

    @property
    def model_config(self) -> dict:
        return self.index["config"]["model"]

    def lazy(self) -> LazyTensors:
        """Every tensor of the checkpoint, read (`read`) when asked."""
        shapes = {n: tuple(self.shape(n)) for n in self.names()}
        return LazyTensors({n: partial(self.read, n) for n in self.names()}, shapes)

    def verify_while_reading(self, files=None) -> "Verification":
        """Check the named files (default: all) in a thread while the caller reads them: the
        bytes come from disk once (the page cache serves the other reader) and hashing, which
        releases the GIL, runs beside the work. Call `.result()` before trusting what was read
        (it raises verify's one line)."""
        return Verification(self, files)

    def verify(self, files=None):
        """Check size and sha256 of the named files (default: all)."""
        for fname in self.files if files is None else files:
            meta, path = self.files[fname], self.dir / fname
            if not path.is_file():
                raise MegaliteError(
                    f"checkpoint file {path} is missing; the checkpoint is incomplete"
                )
            size = path.stat().st_size
            if size != meta["bytes"]:
                raise MegaliteError(
                    f"checkpoint file {path} has {size} bytes, the index says {meta['bytes']} "
                    "(truncated or altered); use another checkpoint"
                )
            if sha256_file(path) != meta["sha256"]:
                raise MegaliteError(
                    f"checkpoint file {path} fails its sha256 checksum (altered or corrupted); "
                    "use another checkpoint"
                )

    def has(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> list[int]:
        return self.tensors[name]["shape"]

    def names(self, optimizer=False) -> list[str]:
        return [n for n in self.tensors if n.startswith("optimizer.") == optimizer]

    def _file(self, fname) -> MappedSafetensors:
        if fname not in self._open:
            if not (self.dir / fname).is_file():
                raise MegaliteError(
                    f"checkpoint file {self.dir / fname} is missing; the checkpoint is incomplete"
                )
            self._open[fname] = MappedSafetensors(self.dir / fname)
        return self._open[fname]

    def part(self, s: dict, name: str) -> torch.Tensor:
        """The whole tensor that shard entry `s` of logical tensor `name` stores, a view of
        its mapped file."""
        key = s.get("key", name)
        f = self._file(s["file"])
        if key not in f.header:
            raise MegaliteError(
                f"checkpoint file {f.path} lacks {key}, which the index places there; the "
                "checkpoint is damaged"
            )
        return f.get(key)

    def read(self, name: str, region=None) -> torch.Tensor:
        """The part `region` ((lo, hi) per dim; default: all) of a logical tensor, contiguous.
        Where one shard holds exactly that part, the result views the mapped file (no copy;
        writing into it copies the pages it touches, never the file); otherwise the overlaps
        of the shards are copied into a new tensor."""
        e = self.tensors[name]
        shape = e["shape"]
        region = [(0, s) for s in shape] if region is None else [tuple(r) for r in region]
        dtype = getattr(torch, e["dtype"])
        for s in e["shards"]:
            if [tuple(r) for r in s["slice"]] == region:
                part = self.part(s, name)
                if part.dtype == dtype and list(part.shape) == [hi - lo for lo, hi in region]:
                    return part
        out = torch.empty([hi - lo for lo, hi in region], dtype=dtype)
        covered = 0
        for s in e["shards"]:
            sl = [tuple(r) for r in s["slice"]]
            inter = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(region, sl)]
            if any(hi <= lo for lo, hi in inter):
                continue
            src = tuple(slice(lo - c, hi - c) for (lo, hi), (c, _) in zip(inter, sl))
            dst = tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(inter, region))
            part = self.part(s, name)
            if list(part.shape) != [hi - lo for lo, hi in sl]:
                raise MegaliteError(
                    f"checkpoint file {self.dir / s['file']} holds {name} at shape "
                    f"{list(part.shape)}, not the slice {sl} the index says; it is damaged"
                )
            out[dst] = part[src]
            covered += out[dst].numel()
        if covered != out.numel():
            raise MegaliteError(
                f"checkpoint {self.dir} lacks part of tensor {name} (region {region} of "
                f"{shape}); the index is incomplete"
            )
        return out

    def close(self):
        self._open.clear()


class Verification:
    """`Checkpoint.verify` run in a thread (see verify_while_reading)."""

    def __init__(self, ckpt: Checkpoint, files=None):
        self.error = None
        self.thread = threading.Thread(target=self._run, args=(ckpt, files), daemon=True)
        self.thread.start()

    def _run(self, ckpt, files):
        try:
            ckpt.verify(files)
        except MegaliteError as e:
            self.error = e

    def result(self):
        self.thread.join()
        if self.error is not None:
            raise self.error
