"""One safetensors file: its header, its writing (a tensor at a time, hashed as it goes out) and
its reading as tensors over the file's mapped pages. The checkpoint format (format.py), the
trainer's shard writer (shard_io.py) and the conversions all read and write files this way."""

import hashlib
import json
import mmap
import os
import struct
from pathlib import Path

import torch

from megalite.errors import MegaliteError

# safetensors' names of the dtypes a checkpoint holds
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
                      torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
                      torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}  # fmt: skip


DTYPES_BY_NAME = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def safetensors_header(specs: dict, metadata: dict | None = None) -> bytes:
    """The header of a safetensors file of {key: (dtype, shape)}, stored in this order: 8-byte
    little-endian length, JSON, spaces to a multiple of 8."""
    header, at = ({"__metadata__": metadata} if metadata else {}), 0
    for key, (dtype, shape) in specs.items():
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[key] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                       "data_offsets": [at, at + n]}  # fmt: skip
        at += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_safetensors(path: Path, data: dict, metadata: dict | None = None, make=None) -> dict:
    """Write a safetensors file and return its {sha256, bytes}. `data`: {key: tensor}, or with
    `make`, {key: (dtype, shape)} and `make(key)` gives each tensor when its turn comes (so only
    one is held: the header is written first). Each tensor is written from its own memory (one
    that views a mapped input file is read from there: no copy) and hashed as it goes out, in
    one pass: hashing and writing release the GIL, and no second read of the file is made."""
    specs = data if make is not None else {k: (t.dtype, tuple(t.shape)) for k, t in data.items()}
    head = safetensors_header(specs, metadata)
    digest, nbytes = hashlib.sha256(head), len(head)
    with open(path, "wb") as fh:
        fh.write(head)
        for key, (dtype, shape) in specs.items():
            t = (make(key) if make is not None else data[key]).detach().to("cpu").contiguous()
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise ValueError(f"{key}: made {t.dtype} {tuple(t.shape)}, not {dtype} {shape}")
            if t.numel():
                raw = t.reshape(-1).view(torch.uint8).numpy()
                digest.update(raw)
                fh.write(raw)
                nbytes += raw.nbytes
            del t
        fh.flush()
        os.fsync(fh.fileno())
    return {"sha256": digest.hexdigest(), "bytes": nbytes}


class MappedSafetensors:
    """A safetensors file mapped into memory: `get(key)` is a tensor over the file's pages (no
    copy; the pages are the page cache's, not the process's anonymous memory). The mapping is
    private: writing into such a tensor copies the page it touches and never alters the file.
    A tensor keeps the mapping alive after the object is gone."""

    def __init__(self, path):
        self.path = Path(path)
        with open(self.path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            try:
                (n,) = struct.unpack("<Q", fh.read(8))
                if n > size - 8:
                    raise ValueError(f"a header of {n} bytes in a file of {size}")
                header = json.loads(fh.read(n))
                self.map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
            except (struct.error, ValueError, UnicodeDecodeError) as e:
                raise MegaliteError(
                    f"{self.path} is not a readable safetensors file ({e}); use another file"
                ) from None
        self.metadata = header.pop("__metadata__", None) or {}
        self.header, self.start, self.size = header, 8 + n, size
        for key, e in header.items():
            lo, hi = e.get("data_offsets", (0, -1))
            if e.get("dtype") not in DTYPES_BY_NAME or not 0 <= lo <= hi <= size - self.start:
                raise MegaliteError(
                    f"{self.path}: tensor {key} has a dtype or byte range this file cannot hold "
                    "(damaged, or a dtype megalite does not read)"
                )

    def keys(self):
        return self.header.keys()

    def meta(self, key: str) -> tuple[torch.dtype, list[int]]:
        e = self.header[key]
        return DTYPES_BY_NAME[e["dtype"]], e["shape"]

    def get(self, key: str) -> torch.Tensor:
        dtype, shape = self.meta(key)
        lo, hi = self.header[key]["data_offsets"]
        count = 1
        for d in shape:
            count *= d
        elem = torch.empty((), dtype=dtype).element_size()
        if hi - lo != count * elem:
            raise MegaliteError(
                f"{self.path}: tensor {key} of shape {shape} holds {hi - lo} bytes; the file is "
                "damaged"
            )
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        at = self.start + lo
        if at % elem:  # an unaligned tensor (after an odd-sized one): read as bytes, copied
            raw = torch.frombuffer(self.map, dtype=torch.uint8, count=hi - lo, offset=at)
            return raw.clone().view(dtype).reshape(shape)
        # a storage of exactly this tensor's bytes (not the whole file): torch.save and DCP
        # write a tensor's whole storage, or copy it to avoid that
        view = memoryview(self.map)[at : at + hi - lo]
        return torch.frombuffer(view, dtype=dtype).reshape(shape)
