"""`torch.save` of a state whose tensors are computed one at a time as they are written.

`torch.save` pickles the whole object first and then writes every storage, so each tensor must
exist at once: a Megatron legacy rank file (every layer of a pipeline stage) sat whole in memory
during its save. `save_streaming` writes the same file with a tensor in memory at a time:

1. the object is saved with fake tensors of the right shapes and dtypes under
   `torch.serialization.skip_data`, which writes the pickle and reserves each storage's record;
2. each tensor is then computed (`Later`) and its bytes written at its record's offset, the
   zip's CRC-32 of the record patched in the local header and the central directory, so the
   file is a valid zip (`unzip -t`) as well as what `torch.load` reads.

Storages are numbered in the order the pickler meets them, which is the order of the object's
own traversal (dicts in insertion order), so the n-th tensor found here is record `data/n`;
the records' sizes are checked against the tensors before a byte is written.
"""

import math
import os
import struct
import zipfile
import zlib
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode


class Later:
    """A tensor computed when it is written: its shape, dtype and a function making it."""

    def __init__(self, shape, dtype: torch.dtype, make):
        self.shape, self.dtype, self.make = tuple(shape), dtype, make


def _replace(obj, fn):
    """obj with every tensor and Later x replaced by fn(x), dicts/lists/tuples rebuilt in order."""
    if isinstance(obj, (torch.Tensor, Later)):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _replace(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_replace(v, fn) for v in obj)
    return obj


def save_streaming(obj, path) -> None:
    """torch.save(obj, path) with each tensor (or `Later`) made and written one at a time."""
    path = Path(path)
    order = []  # the tensors in the pickler's order

    def fake(x):
        order.append(x)
        return torch.empty(x.shape, dtype=x.dtype)

    with FakeTensorMode():
        skeleton = _replace(obj, fake)
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(skeleton, path)
    del skeleton
    reader = torch._C.PyTorchFileReader(str(path))
    names = sorted((n for n in reader.get_all_records() if n.startswith("data/")),
                   key=lambda n: int(n.split("/")[1]))  # fmt: skip
    offsets = [reader.get_record_offset(n) for n in names]
    del reader
    with zipfile.ZipFile(path) as z:  # record sizes and where their headers are
        infos = {i.filename.split("/", 1)[1]: i for i in z.infolist()}
        central = _central_entries(path, z)
    sizes = [infos[n].file_size for n in names]
    want = [math.prod(x.shape) * x.dtype.itemsize for x in order]
    if sizes != want:
        raise RuntimeError(f"torch.save laid out records {sizes}, not the tensors' {want}")
    with open(path, "r+b") as fh:
        fd = fh.fileno()
        for name, offset, x in zip(names, offsets, order):
            t = x.make() if isinstance(x, Later) else x
            if tuple(t.shape) != tuple(x.shape) or t.dtype != x.dtype:
                raise RuntimeError(
                    f"{name}: made {tuple(t.shape)} {t.dtype}, not {x.shape} {x.dtype}"
                )
            data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
            os.pwrite(fd, data, offset)
            crc = struct.pack("<I", zlib.crc32(data))
            info = infos[name]
            os.pwrite(fd, crc, info.header_offset + 14)  # local file header: CRC-32 at 14
            os.pwrite(fd, crc, central[info.filename] + 16)  # central directory: CRC-32 at 16
            del t, data


def _central_entries(path: Path, z: zipfile.ZipFile) -> dict:
    """{name: offset of its central directory entry}."""
    out = {}
    with open(path, "rb") as fh:
        fh.seek(z.start_dir)
        for _ in z.infolist():
            at = fh.tell()
            head = fh.read(46)
            if head[:4] != b"PK\x01\x02":
                raise RuntimeError(f"{path}: no central directory entry at {at}")
            n, m, k = struct.unpack("<HHH", head[28:34])
            out[fh.read(n).decode()] = at
            fh.seek(m + k, os.SEEK_CUR)
    return out
