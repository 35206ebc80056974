"""Writing checkpoints in the format of format.py: files written aside and renamed
(`write_atomic`), one rank's slices as a safetensors shard with their index entries
(`write_shard`), and a conversion's whole tensors streamed into files of about a GiB
(`ShardWriter`, `write_full_checkpoint`). Reading is format.py's `Checkpoint`."""

import json
import math
import os
import shutil
from pathlib import Path

import torch

from megalite.checkpoint.format import (
    FORMAT,
    INDEX,
    LazyTensors,
    dtype_name,
    sha256_file,
    tokenizer_name,
)
from megalite.checkpoint.safetensors_file import write_safetensors


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


def write_shard(directory: Path, fname: str, tensors: dict) -> tuple[dict, dict]:
    """Write {key: (tensor, region, global shape)} as one safetensors file, the key an index
    name or `<index name>#<i>` for one of several slices of a tensor; returns the index entries
    ({name: {shape, dtype, shards: [...]}}) and the file's {fname: {sha256, bytes}}. Tensors
    with an empty region (a rank's vocabulary slice that is all padding) are left out."""
    entries, data = shard_entries(fname, tensors)
    return entries, {fname: write_safetensors(directory / fname, data)}


def shard_entries(fname: str, tensors: dict) -> tuple[dict, dict]:
    """write_shard's index entries and {key: contiguous CPU tensor} of what the file holds."""
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
    return entries, data


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


SHARD_BYTES = 1 << 30  # a conversion's output file, at most: what it may hold in anonymous memory


class ShardWriter:
    """Whole tensors written into files of about `max_bytes` as they come (`add`), each file
    written when it fills: a conversion holds one output file's tensors, never the model.
    `name(k)` is file k's name. `finish()` writes the last one and returns ([(file name,
    [keys])], {file name: {sha256, bytes}}); `total` is the tensor bytes added."""

    def __init__(self, directory: Path, name, max_bytes: int = SHARD_BYTES, metadata=None):
        self.directory, self.name, self.max_bytes = directory, name, max_bytes
        self.metadata = metadata
        self.pending, self.held, self.total = {}, 0, 0
        self.written, self.files = [], {}

    def add(self, key: str, t: torch.Tensor, spec: tuple | None = None):
        """Add a tensor, or with `spec` (dtype, shape) a function making it when its file is
        written (`t` is then that function: the file holds one made tensor at a time)."""
        dtype, shape = spec or (t.dtype, tuple(t.shape))
        nbytes = math.prod(shape) * dtype.itemsize
        if self.pending and self.held + nbytes > self.max_bytes:
            self.flush()
        self.pending[key] = (dtype, shape, t if spec else (lambda: t))
        self.held += nbytes
        self.total += nbytes

    def flush(self):
        if not self.pending:
            return
        fname, pending = self.name(len(self.written)), self.pending
        specs = {k: (dtype, shape) for k, (dtype, shape, _) in pending.items()}
        self.files[fname] = write_safetensors(self.directory / fname, specs, self.metadata,
                                              make=lambda k: pending[k][2]())  # fmt: skip
        self.written.append((fname, list(pending)))
        self.pending, self.held = {}, 0

    def finish(self) -> tuple[list, dict]:
        self.flush()
        return self.written, self.files


def write_full_checkpoint(directory: Path, tensors, meta: dict, tokenizer=None,
                          max_bytes: int = SHARD_BYTES):  # fmt: skip
    """A checkpoint of whole logical tensors (conversion tools), written into `directory`
    (which must not exist) through a temporary directory. `tensors`: (name, tensor) pairs,
    consumed one at a time (a generator computes each as it is needed), written into files of
    about `max_bytes` as they fill (model-00000.safetensors, ...). A `LazyTensors` whose shapes
    and dtypes are known is made a tensor at a time as each file is written (not a file's worth
    at once)."""
    tmp = directory.with_name(f".{directory.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    out = ShardWriter(tmp, lambda k: f"model-{k:05d}.safetensors", max_bytes)
    entries = {}
    if isinstance(tensors, LazyTensors) and tensors.shapes and tensors.dtypes:
        items = ((n, f, (tensors.dtypes[n], tuple(tensors.shapes[n])))
                 for n, f in dict.items(tensors))  # fmt: skip
    else:
        items = (
            (n, t, None) for n, t in (tensors.items() if isinstance(tensors, dict) else tensors)
        )
    for name, t, spec in items:
        out.add(name, t, spec)
        dtype, shape = spec or (t.dtype, t.shape)
        entries[name] = {"shape": list(shape), "dtype": dtype_name(dtype), "shards": []}
    written, files = out.finish()
    for fname, keys in written:
        for k in keys:
            whole = [[0, s] for s in entries[k]["shape"]]
            entries[k]["shards"].append({"file": fname, "slice": whole})
    if tokenizer is not None:
        files.update(copy_tokenizer(tokenizer, tmp))
    index = {**meta, "format": FORMAT, "tensors": entries, "files": files}
    write_atomic(tmp / INDEX, json.dumps(index, indent=1))
    os.replace(tmp, directory)
