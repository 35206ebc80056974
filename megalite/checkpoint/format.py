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
read: no pickle. The files are valid safetensors files, written by `write_shard` itself.
"""

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import torch
from safetensors import safe_open

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


def fsync_dir(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str):
    """Write aside, fsync, rename: readers see the old file or the new one, never a mix."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _safe_name(name, where: Path) -> str:
    """A file name from an index or a `latest` file: a plain name inside the checkpoint."""
    if not isinstance(name, str) or not name or name in (".", "..") or Path(name).name != name:
        raise MegaliteError(
            f"{where} names the file {name!r}, which is not a plain file name inside the "
            "checkpoint directory; refusing to read it (the index is damaged or was tampered with)"
        )
    return name


# ---- writing -------------------------------------------------------------------------------------

# safetensors' names of the dtypes a checkpoint holds
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
                      torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
                      torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}  # fmt: skip


def _safetensors(data: dict) -> tuple[bytes, list]:
    """A safetensors file of `data` ({key: contiguous CPU tensor}, stored in this order): its
    header (8-byte little-endian length, JSON, spaces to a multiple of 8) and the tensors' bytes
    as arrays over their memory (no copy)."""
    header, views, at = {}, [], 0
    for key, t in data.items():
        raw = t.reshape(-1).view(torch.uint8).numpy()
        header[key] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                       "data_offsets": [at, at + raw.nbytes]}  # fmt: skip
        views.append(raw)
        at += raw.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, views


def write_shard(directory: Path, fname: str, tensors: dict) -> tuple[dict, dict]:
    """Write {key: (tensor, region, global shape)} as one safetensors file, the key an index
    name or `<index name>#<i>` for one of several slices of a tensor; returns the index entries
    ({name: {shape, dtype, shards: [...]}}) and the file's {fname: {sha256, bytes}}. Tensors
    with an empty region (a rank's vocabulary slice that is all padding) are left out."""
    entries, data = {}, {}
    for key, (t, region, glob) in tensors.items():
        if any(hi <= lo for lo, hi in region):
            continue
        data[key] = t.detach().to("cpu").contiguous()
        name = key.split("#")[0]
        shard = {"file": fname, "slice": [list(r) for r in region]}
        if key != name:
            shard["key"] = key
        e = entries.setdefault(
            name, {"shape": list(glob), "dtype": dtype_name(t.dtype), "shards": []}
        )
        e["shards"].append(shard)
    # Written and hashed straight from the tensors' memory, in one pass: hashing and writing
    # release the GIL, and neither a serialised copy nor a second read of the file is made.
    path, (head, views) = directory / fname, _safetensors(data)
    digest = hashlib.sha256(head)
    with open(path, "wb") as fh:
        fh.write(head)
        for v in views:
            digest.update(v)
            fh.write(v)
        fh.flush()
        os.fsync(fh.fileno())
    nbytes = len(head) + sum(v.nbytes for v in views)
    return entries, {fname: {"sha256": digest.hexdigest(), "bytes": nbytes}}


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


def copy_tokenizer(src, directory: Path) -> dict:
    """Copy a tokenizer file (sentencepiece model or tokenizer.json) into a checkpoint under
    `tokenizer_name(src)`; returns its {name: {sha256, bytes}}."""
    name = tokenizer_name(src)
    path = directory / name
    shutil.copyfile(src, path)
    return {name: {"sha256": sha256_file(path), "bytes": path.stat().st_size}}


def merge_entries(parts: list[dict]) -> dict:
    """Union of write_shard entries from several files (the shards of a tensor concatenated)."""
    out = {}
    for entries in parts:
        for name, e in entries.items():
            if name in out:
                out[name]["shards"].extend(e["shards"])
            else:
                out[name] = {**e, "shards": list(e["shards"])}
    return out


def write_full_checkpoint(
    directory: Path, tensors: dict[str, torch.Tensor], meta: dict, tokenizer=None
):
    """A checkpoint of whole logical tensors in one file (conversion tools), written into
    `directory` (which must not exist) through a temporary directory."""
    tmp = directory.with_name(f".{directory.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    full = {n: (t, [(0, s) for s in t.shape], list(t.shape)) for n, t in tensors.items()}
    entries, files = write_shard(tmp, "model.safetensors", full)
    if tokenizer is not None:
        files.update(copy_tokenizer(tokenizer, tmp))
    index = {**meta, "format": FORMAT, "tensors": entries, "files": files}
    write_atomic(tmp / INDEX, json.dumps(index, indent=1))
    os.replace(tmp, directory)


# ---- reading -------------------------------------------------------------------------------------


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

    def _file(self, fname):
        if fname not in self._open:
            try:
                self._open[fname] = safe_open(str(self.dir / fname), framework="pt")
            except Exception as e:  # safetensors raises its own error types for bad headers
                raise MegaliteError(
                    f"checkpoint file {self.dir / fname} is not a readable safetensors file "
                    f"({e}); use another checkpoint"
                ) from None
        return self._open[fname]

    def read(self, name: str, region=None) -> torch.Tensor:
        """The part `region` ((lo, hi) per dim; default: all) of a logical tensor, assembled
        from the shards that overlap it; each file read is only the overlap."""
        e = self.tensors[name]
        shape = e["shape"]
        region = [(0, s) for s in shape] if region is None else [tuple(r) for r in region]
        dtype = getattr(torch, e["dtype"])
        out = torch.empty([hi - lo for lo, hi in region], dtype=dtype)
        covered = 0
        for s in e["shards"]:
            sl = [tuple(r) for r in s["slice"]]
            inter = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(region, sl)]
            if any(hi <= lo for lo, hi in inter):
                continue
            src = tuple(slice(lo - c, hi - c) for (lo, hi), (c, _) in zip(inter, sl))
            dst = tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(inter, region))
            key = s.get("key", name)
            part = self._file(s["file"]).get_slice(key)[src] if shape else self._get(s, key)
            out[dst] = part
            covered += out[dst].numel()
        if covered != out.numel():
            raise MegaliteError(
                f"checkpoint {self.dir} lacks part of tensor {name} (region {region} of "
                f"{shape}); the index is incomplete"
            )
        return out

    def _get(self, s, key):  # 0-dim tensors cannot be sliced
        return self._file(s["file"]).get_tensor(key)

    def close(self):
        self._open.clear()
