"""A trainer's shard written at disk speed, steadily: hashing beside the write, writeback as
it goes.

`writing.write_shard` hashes each tensor, then writes it, then fsyncs the whole file at the end:
the sha256 (about 0.6 GB/s on one core) is added to the write instead of overlapping it, and
every byte stays dirty in the page cache until the final fsync, which then waits for all of it,
and for whatever else the machine left dirty before (a conversion, the previous checkpoint):
the same save took 18.8 s and 50.1 s in two identical runs. Here

- the sha256 runs in a second thread over the same memory (hashlib and write() both release
  the GIL), so a save costs max(write, hash), not their sum;
- each written 64 MB range is handed to the disk at once (`sync_file_range` WRITE), the range
  before it waited for and dropped from the page cache (the trainer will not read it back),
  so at most two ranges are dirty: the disk is busy from the first range on, the final fsync
  has little left, and the save neither fills the page cache nor waits on other files' dirty
  pages. Without `sync_file_range` (not Linux) a plain fdatasync every 256 MB bounds them.

`write_shard` takes and returns what `writing.write_shard` does and writes the same bytes.
"""

import ctypes
import ctypes.util
import hashlib
import os
import threading
from pathlib import Path

import torch

from megalite.checkpoint import writing
from megalite.checkpoint.safetensors_file import safetensors_header

CHUNK = 64 << 20  # bytes handed to the disk at a time
_WAIT_BEFORE, _WRITE, _WAIT_AFTER = 1, 2, 4  # sync_file_range flags (linux/fs.h)


def _sync_file_range():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        f = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]

    def call(fd, offset, nbytes, flags):
        if f(fd, offset, nbytes, flags) != 0:
            raise OSError(ctypes.get_errno(), "sync_file_range failed")

    return call


_SYNC_RANGE = _sync_file_range()


class _Writeback:
    """Starts writeback of each range as it is written, waits for the one before."""

    def __init__(self, fd: int):
        self.fd, self.done, self.prev = fd, 0, None

    def wrote(self, nbytes: int):
        lo, self.done = self.done, self.done + nbytes
        if _SYNC_RANGE is None:
            if self.done // (4 * CHUNK) != lo // (4 * CHUNK):
                os.fdatasync(self.fd)
            return
        _SYNC_RANGE(self.fd, lo, nbytes, _WRITE)
        if self.prev is not None:
            plo, pn = self.prev
            _SYNC_RANGE(self.fd, plo, pn, _WAIT_BEFORE | _WRITE | _WAIT_AFTER)
            os.posix_fadvise(self.fd, plo, pn, os.POSIX_FADV_DONTNEED)
        self.prev = (lo, nbytes)


def write_views(path: Path, head: bytes, views) -> str:
    """Write `head` then the byte arrays `views` to `path`, fsynced; returns its sha256 (hex),
    computed by a second thread while the first writes."""
    pieces = [memoryview(head)]
    for v in views:
        m = memoryview(v).cast("B")
        pieces += [m[i : i + CHUNK] for i in range(0, len(m), CHUNK)]
    digest, ready = hashlib.sha256(), threading.Semaphore(0)
    errors = []

    def hash_all():
        try:
            for p in pieces:
                digest.update(p)
        except Exception as e:  # reported by the writer
            errors.append(e)
        ready.release()

    hasher = threading.Thread(target=hash_all, daemon=True)
    hasher.start()
    try:
        with open(path, "wb") as fh:
            wb = _Writeback(fh.fileno())
            for p in pieces:
                fh.write(p)
                wb.wrote(len(p))
            fh.flush()
            os.fsync(fh.fileno())
    finally:
        ready.acquire()
    if errors:
        raise errors[0]
    return digest.hexdigest()


def write_shard(directory: Path, fname: str, tensors: dict) -> tuple[dict, dict]:
    """`writing.write_shard` (same arguments, same file, same index entries), written by
    `write_views`."""
    entries, data = writing.shard_entries(fname, tensors)
    head = safetensors_header({k: (t.dtype, tuple(t.shape)) for k, t in data.items()})
    views = [t.reshape(-1).view(torch.uint8).numpy() for t in data.values() if t.numel()]
    digest = write_views(directory / fname, head, views)
    nbytes = len(head) + sum(v.nbytes for v in views)
    return entries, {fname: {"sha256": digest, "bytes": nbytes}}
