"""Asynchronous saves (--async-save): the step copies to host memory, a thread writes.

The tensors a rank writes (its weights and its own part of the optimizer state: nothing is
gathered over DP) are copied into host buffers reused from save to save (pinned on a GPU: the
copies are queued on the stream and the step does not wait for them), the RNG states
are gathered in the foreground (an all_gather_object over the world), and the step goes on.
A background thread writes the safetensors file exactly as a synchronous save does
(`shard_io.write_shard`: same bytes, same sha256), which releases the GIL while it writes and
hashes.

The thread never calls a collective: the training groups belong to the training thread. The
ranks meet through the checkpoint's temporary directory instead, which every rank already
writes into: each writer leaves `.rank<N>.json` (its index entries and file checksum, or its
error) beside its shard, and rank 0's thread waits for those of every writer, removes them, and
commits exactly as a synchronous save does (index, rename, `latest` last, pruning). A crash at
any point before the commit leaves the previous `latest` as it was.

At most one save is in flight: the next save, the end of training and a signal wait for it,
then the ranks agree on its outcome in the foreground (`Checkpointer.wait`), so an error of the
background write ends the run with one line on every rank.
"""

import json
import os
import threading
import time
import traceback
from pathlib import Path
from typing import NamedTuple

import torch

from megalite.checkpoint import shard_io, writing

POLL_S = 0.05


class Part(NamedTuple):
    """What one rank contributes to a checkpoint's index (a rank that writes nothing: empty)."""

    entries: dict = {}  # index entries of the tensors in its file (shard_io.write_shard)
    files: dict = {}  # {its file: {"sha256", "bytes"}}
    rng: dict | None = None  # its RNG states, encoded (regions.encode_rng)
    error: str | None = None  # why its write failed


def host_copy(tensors: dict, buffers: dict) -> tuple[dict, object]:
    """{name: (tensor, region, shape)} with the tensors copied into host buffers the training
    step will not touch (it updates the weights and the optimizer state in place), and the CUDA
    event to wait for before reading them (None on CPU). The buffers are kept in `buffers` from
    save to save (the previous save has finished with them when the next one starts), so a
    save allocates nothing; on a GPU they are pinned and the copies queued on the stream."""
    out, cuda = {}, False
    for name, (t, region, shape) in tensors.items():
        cuda = t.device.type == "cuda"
        buf = buffers.get(name)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = buffers[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda)
        buf.copy_(t, non_blocking=cuda)
        out[name] = (buf, region, shape)
    event = torch.cuda.Event() if cuda else None
    if event is not None:
        event.record()
    return out, event


def _sidecar(tmp: Path, rank: int) -> Path:
    return tmp / f".rank{rank:05d}.json"


def write_part(tmp: Path, fname: str, tensors: dict, rank: int, report: bool) -> Part:
    """Write this rank's shard (`shard_io.write_shard`); returns its Part (no RNG states) and,
    when `report` (a rank other than 0), leaves it in the rank's sidecar file for rank 0."""
    entries, files, error = {}, {}, None
    try:
        entries, files = shard_io.write_shard(tmp, fname, tensors)
    except OSError as e:
        error = f"could not write checkpoint file {tmp / fname} ({e})"
    if report:
        writing.write_atomic(_sidecar(tmp, rank), json.dumps([entries, files, error]))
    return Part(entries, files, None, error)


def collect_parts(tmp: Path, own: Part, rngs: list, writers: list, timeout_s: float) -> list:
    """Rank 0: the Part of every rank, in rank order (what a synchronous save gathers), from
    the writers' sidecar files, which are then removed."""
    parts, deadline = [], time.monotonic() + timeout_s
    for rank, (rng, writes) in enumerate(zip(rngs, writers)):
        if rank == 0:
            parts.append(own._replace(rng=rng))
        elif not writes:
            parts.append(Part(rng=rng))
        else:
            path = _sidecar(tmp, rank)
            while not path.is_file():
                if time.monotonic() > deadline:
                    raise OSError(
                        f"rank {rank} did not finish writing its file in {timeout_s:.0f} s"
                    )
                time.sleep(POLL_S)
            entries, files, error = json.loads(path.read_text())
            path.unlink()
            parts.append(Part(entries, files, rng, error))
    return parts


def _yield_cpu():
    """Give the calling thread the lowest CPU priority (Linux: a thread's nice value is its
    own), so that the writer runs where training leaves the CPU idle; elsewhere a no-op."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


class BackgroundSave:
    """One save at a time on a daemon thread (a crash of the process must not wait for it)."""

    def __init__(self):
        self._thread, self._error = None, None

    @property
    def busy(self) -> bool:
        return self._thread is not None

    def start(self, job):
        assert self._thread is None, "a save is still in flight"

        def run():
            _yield_cpu()
            try:
                self._error = job()
            except Exception as e:  # an unexpected error still ends as one line
                self._error = f"the background save failed: {type(e).__name__}: {e}"
                traceback.print_exc()

        self._error = None
        self._thread = threading.Thread(target=run, name="megalite-save", daemon=True)
        self._thread.start()

    def wait(self) -> str | None:
        """Block until the save in flight (if any) is done; its error message, or None."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread, error = None, self._error
        return error
