"""Merge indexed datasets preprocessed apart (shards of one corpus, made on several machines)
into one PREFIX.bin/.idx: the files Megatron-LM's tools/merge_datasets.py writes, byte for byte.

Megatron's rule, written from its behaviour: every `X.bin`/`X.idx` pair of the input directory,
in sorted order of X; the tokens one after another; the index of all the sequences, each
sequence's byte pointer counted again from the start of the merged .bin, the document bounds of
each shard moved by the sequences before it; the token dtype of the first shard, which every
shard must share (multimodal indexes: their sequence modes appended too).

Unlike Megatron's builder, which holds every sequence length in a Python list, this streams:
the index sections are read, shifted and written a block at a time and the .bin files are
copied by the kernel, so shards of any size merge in a few MB of memory. megalite's
PREFIX.idx.json (vocabulary size, tokenizer fingerprint) is merged as well: shards of different
tokenizers are refused, and a shard without one (made by Megatron) leaves the merge without one.
"""

import json
import os
import shutil
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from megalite.data.indexed_dataset import SIDECAR
from megalite.data.megatron_index import DTYPES, HEADER, MAGIC, VERSION
from megalite.errors import MegaliteError

BLOCK = 1 << 20  # index entries per read: 8 MB of int64


class Shard(NamedTuple):
    prefix: str
    dtype: np.dtype
    sequences: int
    documents: int  # bounds in the index: documents + 1
    tokens: int
    modes: bool  # multimodal: an int8 mode per sequence after the document bounds
    facts: dict | None  # megalite's PREFIX.idx.json, where there is one


def shard_prefixes(directory: str | os.PathLike) -> list[str]:
    """The shards of `directory` in Megatron's order: X for every X.bin/X.idx pair (megalite's
    X.idx.json beside them is not a shard); any other file is refused, as Megatron does."""
    d = Path(directory)
    if not d.is_dir():
        raise MegaliteError(f"--input {d} is not a directory; give the folder holding the shards")
    prefixes = set()
    for name in os.listdir(d):
        path = d / name
        if not path.is_file() or name.endswith(SIDECAR):
            continue
        stem, ext = os.path.splitext(name)
        other = ".bin" if ext == ".idx" else ".idx"
        if ext not in (".bin", ".idx") or not (d / (stem + other)).is_file():
            raise MegaliteError(
                f"{path} has no {stem + other} beside it; --input must hold only .bin/.idx pairs "
                f"(and megalite's {SIDECAR})"
            )
        prefixes.add(stem)
    if not prefixes:
        raise MegaliteError(f"--input {d} holds no .bin/.idx pair to merge")
    return [str(d / p) for p in sorted(prefixes)]


def read_shard(prefix: str, multimodal: bool) -> Shard:
    """A shard's header, checked with its index and .bin, a block at a time."""
    idx = prefix + ".idx"
    with open(idx, "rb") as fh:
        head = fh.read(HEADER.size)
        if len(head) < HEADER.size or not head.startswith(MAGIC):
            raise MegaliteError(
                f"{idx} is not a Megatron-LM index (wrong header); rerun its preprocessing"
            )
        _, version, code, n_seq, n_doc = HEADER.unpack(head)
        if version != VERSION or code not in DTYPES or n_doc < 1:
            raise MegaliteError(
                f"{idx} has version {version}, dtype code {code}, {n_doc} document bounds: not "
                "an index Megatron writes; rerun its preprocessing"
            )
        body = HEADER.size + 12 * n_seq + 8 * n_doc
        size = os.path.getsize(idx)
        modes = size == body + n_seq and n_seq > 0
        if size != body + (n_seq if multimodal else 0):
            why = (
                "has sequence modes: a multimodal index, pass --multimodal"
                if modes
                else "is truncated or corrupt"
            )
            raise MegaliteError(f"{idx} is {size} bytes for {n_seq} sequences: it {why}")
        tokens = 0
        for lengths in _blocks(fh, np.int32, n_seq):
            if lengths.size and lengths.min() < 0:
                raise MegaliteError(f"{idx} has negative sequence lengths; it is corrupt")
            tokens += int(lengths.sum(dtype=np.int64))
        fh.seek(HEADER.size + 12 * n_seq)
        last = -1
        for bounds in _blocks(fh, np.int64, n_doc):
            if (last < 0 and bounds[0] != 0) or bounds[0] < last or np.any(np.diff(bounds) < 0):
                last = -2
                break
            last = int(bounds[-1])
        if last != n_seq:
            raise MegaliteError(
                f"{idx} has corrupt document bounds (they must rise from 0 to its {n_seq} "
                "sequences); rerun its preprocessing"
            )
    dtype = DTYPES[code]
    bin_size = os.path.getsize(prefix + ".bin")
    if bin_size != tokens * dtype.itemsize:
        raise MegaliteError(
            f"{prefix}.bin is {bin_size} bytes but {idx} describes {tokens} {dtype.name} tokens; "
            "the pair does not match"
        )
    return Shard(prefix, dtype, n_seq, n_doc - 1, tokens, modes, _facts(prefix, n_doc - 1, tokens))


def _facts(prefix: str, documents: int, tokens: int) -> dict | None:
    path = prefix + SIDECAR
    if not os.path.isfile(path):
        return None
    try:
        facts = json.loads(Path(path).read_text())
        ok = (facts["documents"], facts["tokens"]) == (documents, tokens)
        facts["vocab_size"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        ok = False
    if not ok:
        raise MegaliteError(
            f"{path} does not describe {prefix}.idx ({documents} documents, {tokens} tokens); "
            "delete it or rerun the preprocessing of that shard"
        )
    return facts


def _blocks(fh, dtype, count: int):
    """`count` values of `dtype` from the file's position on, BLOCK at a time."""
    while count > 0:
        n = min(BLOCK, count)
        arr = np.fromfile(fh, dtype=np.dtype(dtype).newbyteorder("<"), count=n)
        if arr.size != n:
            raise MegaliteError(f"{fh.name} ends early; it is truncated")
        yield arr
        count -= n


def merged_facts(shards: list[Shard], documents: int, tokens: int) -> dict | None:
    """megalite's PREFIX.idx.json of the merge: one tokenizer for every shard, or none known."""
    if any(s.facts is None for s in shards):
        return None
    first = shards[0]
    for s in shards[1:]:
        for key in ("vocab_size", "tokenizer_fingerprint"):
            if s.facts.get(key) != first.facts.get(key):
                raise MegaliteError(
                    f"shards {first.prefix} and {s.prefix} were tokenized with different "
                    f"tokenizers ({key} {first.facts.get(key)} vs {s.facts.get(key)}); merge "
                    "shards of one tokenizer only"
                )
    facts = {"megalite_sidecar": 1, "vocab_size": first.facts["vocab_size"]}
    facts |= {"tokenizer_fingerprint": first.facts.get("tokenizer_fingerprint")}
    return facts | {"documents": documents, "tokens": tokens}


def merge(directory: str | os.PathLike, output_prefix: str, multimodal: bool = False) -> dict:
    """Merge the shards of `directory` into output_prefix.bin/.idx (and .idx.json); returns
    {"shards", "documents", "tokens", "seconds", "sidecar": None or why there is none}."""
    t0 = time.perf_counter()
    prefixes = shard_prefixes(directory)
    out = os.path.abspath(output_prefix)
    if out in map(os.path.abspath, prefixes):
        raise MegaliteError(
            f"--output-prefix {output_prefix} is one of the shards; write elsewhere"
        )
    shards = [read_shard(p, multimodal) for p in prefixes]
    dtype = shards[0].dtype
    for s in shards[1:]:
        if s.dtype != dtype:
            raise MegaliteError(
                f"shard {s.prefix} holds {s.dtype.name} tokens but {shards[0].prefix} holds "
                f"{dtype.name}; shards of one merge share a token dtype (one tokenizer)"
            )
    documents, tokens = sum(s.documents for s in shards), sum(s.tokens for s in shards)
    facts = merged_facts(shards, documents, tokens)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    tmp = f".tmp{os.getpid()}"
    try:
        with open(out + ".bin" + tmp, "wb", buffering=0) as dst:
            for s in shards:
                with open(s.prefix + ".bin", "rb") as src:
                    _append(src, dst)
        with open(out + ".idx" + tmp, "wb") as dst:
            _write_index(dst, shards, multimodal)
        os.replace(out + ".bin" + tmp, out + ".bin")  # .bin first, as the writer does
        if facts is not None:
            Path(out + SIDECAR + tmp).write_text(json.dumps(facts, indent=1) + "\n")
            os.replace(out + SIDECAR + tmp, out + SIDECAR)
        elif os.path.exists(out + SIDECAR):
            os.remove(out + SIDECAR)  # an old merge's facts would describe other data
        os.replace(out + ".idx" + tmp, out + ".idx")
    finally:
        for ext in (".bin", ".idx", SIDECAR):
            if os.path.exists(out + ext + tmp):
                os.remove(out + ext + tmp)
    missing = next((s.prefix for s in shards if s.facts is None), None)
    why = None if facts or missing is None else f"{missing} has no {SIDECAR} (made by Megatron?)"
    return {"shards": len(shards), "documents": documents, "tokens": tokens, "sidecar": why,
            "seconds": time.perf_counter() - t0}  # fmt: skip


def _write_index(dst, shards: list[Shard], multimodal: bool) -> None:
    itemsize = shards[0].dtype.itemsize
    n_seq = sum(s.sequences for s in shards)
    code = next(c for c, dt in DTYPES.items() if dt == shards[0].dtype)
    dst.write(HEADER.pack(MAGIC, VERSION, code, n_seq, 1 + sum(s.documents for s in shards)))
    for s in shards:  # the sequence lengths as they are
        with open(s.prefix + ".idx", "rb") as fh:
            fh.seek(HEADER.size)
            for lengths in _blocks(fh, np.int32, s.sequences):
                dst.write(lengths.tobytes())
    pointer = 0  # each sequence's byte offset in the merged .bin, counted from its lengths
    for s in shards:
        with open(s.prefix + ".idx", "rb") as fh:
            fh.seek(HEADER.size)
            for lengths in _blocks(fh, np.int32, s.sequences):
                sizes = lengths.astype("<i8") * itemsize
                ends = np.cumsum(sizes)
                dst.write((pointer + ends - sizes).tobytes())
                pointer += int(ends[-1])
    dst.write(np.zeros(1, dtype="<i8").tobytes())
    before = 0  # sequences of the shards before
    for s in shards:  # each shard's document bounds after its leading 0, moved by `before`
        with open(s.prefix + ".idx", "rb") as fh:
            fh.seek(HEADER.size + 12 * s.sequences + 8)
            for bounds in _blocks(fh, np.int64, s.documents):
                dst.write((bounds + before).tobytes())
        before += s.sequences
    if multimodal:
        for s in shards:
            with open(s.prefix + ".idx", "rb") as fh:
                fh.seek(HEADER.size + 12 * s.sequences + 8 * (s.documents + 1))
                for modes in _blocks(fh, np.int8, s.sequences):
                    dst.write(modes.tobytes())


def _append(src, dst) -> None:
    """Copy all of `src` to the end of the unbuffered `dst`, in the kernel where it can."""
    start = dst.tell()
    try:
        while os.copy_file_range(src.fileno(), dst.fileno(), 1 << 30):
            pass
    except (AttributeError, OSError):  # no copy_file_range here, or not between these files
        src.seek(0)
        dst.truncate(start)
        dst.seek(start)
        shutil.copyfileobj(src, dst, 1 << 24)
