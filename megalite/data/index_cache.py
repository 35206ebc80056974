"""The sample-order cache (--data-cache-path, else beside the data): the built arrays kept as
.npy files, keyed by what they depend on, so a restart (or every other rank) memory-maps them
instead of building them again.

An entry is a directory named `<kind>-<split>-<hash of the key>` holding one .npy per array and
key.json (what the hash covers, for a reader wondering what an entry is). It is written to a
temporary directory and renamed into place when complete, under an exclusive file lock: when
every rank builds at once, one builds and the others wait and load its result.
"""

import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from hashlib import sha256
from pathlib import Path

import numpy as np

from megalite.errors import MegaliteError

FORMAT = 1  # bump when the arrays an entry holds, or how they are built, change


def fingerprint(array: np.ndarray) -> str:
    """A short content hash of an array (e.g. the sequence lengths a split exposes)."""
    return sha256(np.ascontiguousarray(array).tobytes()).hexdigest()[:16]


def cached(
    cache_dir: str | os.PathLike | None,
    name: str,
    key: dict,
    build: Callable[[Path], None],
) -> dict[str, np.ndarray]:
    """The arrays `build(directory)` writes there as .npy files (with `save`, `save_blocks`),
    memory-mapped from `cache_dir`: loaded when an entry for `key` is there, else built there
    first, straight to its files (a builder never needs the arrays in memory at once). Without
    a cache_dir, built in a temporary directory and read back into memory."""
    if cache_dir is None:
        with tempfile.TemporaryDirectory(prefix="megalite-index-") as tmp:
            build(Path(tmp))
            return {k: np.array(a) for k, a in _load(Path(tmp)).items()}
    text = json.dumps({"format": FORMAT, **key}, sort_keys=True)
    final = Path(cache_dir) / f"{name}-{sha256(text.encode()).hexdigest()[:20]}"

    def fill(tmp: Path):
        build(tmp)
        (tmp / "key.json").write_text(text + "\n")

    build_once(final, fill, "--data-cache-path")
    return _load(final)


def save(directory: Path, name: str, array: np.ndarray) -> None:
    np.save(directory / f"{name}.npy", array, allow_pickle=False)


def save_blocks(directory: Path, name: str, shape: tuple, dtype, blocks) -> None:
    """Write `name`.npy of `shape` and `dtype` from `blocks`, consecutive pieces of it along the
    first axis, one at a time: the file is the only place the whole array ever is."""
    dtype, rows = np.dtype(dtype), 0
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
              "shape": tuple(shape)}  # fmt: skip
    with open(directory / f"{name}.npy", "wb") as fh:
        np.lib.format.write_array_header_1_0(fh, header)
        for b in blocks:
            if b.dtype != dtype or b.shape[1:] != tuple(shape[1:]):
                raise ValueError(f"{name}: a block of {b.dtype}{b.shape} in {dtype}{shape}")
            np.ascontiguousarray(b).tofile(fh)
            rows += len(b)
    if rows != shape[0]:
        raise ValueError(f"{name}: {rows} rows written of {shape[0]}")


def save_block_pairs(directory: Path, names: tuple[str, str], rows: int, dtypes, blocks) -> None:
    """Write two 1-d .npy files of `rows` at once from `blocks`, pairs of consecutive pieces of
    each (what one pass of a builder yields for two arrays), one pair in memory at a time."""
    heads = [{"descr": np.lib.format.dtype_to_descr(np.dtype(d)), "fortran_order": False,
              "shape": (rows,)} for d in dtypes]  # fmt: skip
    written = 0
    with (
        open(directory / f"{names[0]}.npy", "wb") as f0,
        open(directory / f"{names[1]}.npy", "wb") as f1,
    ):
        for fh, head in zip((f0, f1), heads):
            np.lib.format.write_array_header_1_0(fh, head)
        for pair in blocks:
            for fh, b, d in zip((f0, f1), pair, dtypes):
                if b.dtype != np.dtype(d) or b.ndim != 1 or len(b) != len(pair[0]):
                    raise ValueError(f"{names}: a block of {b.dtype}{b.shape} in {d}[{rows}]")
                np.ascontiguousarray(b).tofile(fh)
            written += len(pair[0])
    if written != rows:
        raise ValueError(f"{names}: {written} rows written of {rows}")


def build_once(final: Path, fill: Callable[[Path], None], flag: str) -> bool:
    """Make the directory `final` once, whoever else tries at the same time: `fill(tmp)` writes a
    temporary directory beside it that is renamed into place when complete, under an exclusive
    file lock, so concurrent callers wait for the first and then find its result (and a reader
    needs no lock). True when this call built it. `flag` names the option choosing the parent
    directory, for the one-line error when it cannot be written."""
    if final.is_dir():
        return False
    cache = final.parent
    try:
        cache.mkdir(parents=True, exist_ok=True)
        lock = open(cache / f".{final.name}.lock", "w")
    except OSError as e:
        raise MegaliteError(
            f"cannot write the data cache {cache} ({e.strerror}); point {flag} at a writable "
            "directory"
        ) from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if final.is_dir():  # another process built it while we waited
            return False
        for stale in cache.glob(f".{final.name}.tmp*"):  # left by a process killed mid-build
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp", dir=cache))
        try:
            fill(tmp)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return True


def _load(entry: Path) -> dict[str, np.ndarray]:
    return {p.stem: np.load(p, mmap_mode="r", allow_pickle=False) for p in entry.glob("*.npy")}
