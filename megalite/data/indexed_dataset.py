"""Tokenized documents on disk: PREFIX.bin (the token stream) and PREFIX.idx (its index).

PREFIX.bin is every document's tokens, one after another, as raw `uint16` (vocabularies up to
65536 pieces) or `int32`. PREFIX.idx is a 40-byte little-endian header followed by the
`num_docs + 1` token offsets (int64) where each document starts, the last being `num_tokens`:

    magic b"MEGALIDX" | version u32 | dtype code u32 | vocab_size u64 | num_docs u64 | num_tokens u64

The reader checks all of it against the two files' sizes before mapping the tokens, so a
truncated, mismatched or foreign file is a clear error rather than garbage samples.
"""

import multiprocessing
import os
import struct
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from megalite.errors import MegaliteError

MAGIC = b"MEGALIDX"
VERSION = 1
HEADER = struct.Struct("<8sIIQQQ")
DTYPES = {1: np.dtype(np.uint16), 2: np.dtype(np.int32)}
_CODES = {dt: code for code, dt in DTYPES.items()}
_MEGATRON_MAGIC = b"MMIDIDX\x00\x00"


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    return DTYPES[1] if vocab_size <= 2**16 else DTYPES[2]


class IndexedDatasetWriter:
    """Appends documents; `finalize()` makes PREFIX.bin and PREFIX.idx appear (atomically).

    Used as a context manager, an exception leaves no partial files behind.
    """

    def __init__(self, prefix: str | os.PathLike, vocab_size: int):
        self.prefix = str(prefix)
        self.vocab_size = vocab_size
        self.dtype = dtype_for_vocab(vocab_size)
        self.offsets = [0]
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._tmp = f".tmp{os.getpid()}"
        self._bin = open(self.prefix + ".bin" + self._tmp, "wb")

    def add_document(self, ids) -> None:
        arr = np.asarray(ids)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size})")  # a bug, not input
        self._bin.write(arr.astype(self.dtype.newbyteorder("<"), copy=False).tobytes())
        self.offsets.append(self.offsets[-1] + arr.size)

    def finalize(self) -> None:
        self._bin.close()
        if len(self.offsets) == 1:
            self._discard()
            raise MegaliteError(f"no documents to write to {self.prefix}; give non-empty input")
        idx_tmp = self.prefix + ".idx" + self._tmp
        n_docs, n_tokens = len(self.offsets) - 1, self.offsets[-1]
        with open(idx_tmp, "wb") as fh:
            fh.write(
                HEADER.pack(MAGIC, VERSION, _CODES[self.dtype], self.vocab_size, n_docs, n_tokens)
            )
            fh.write(np.asarray(self.offsets, dtype="<i8").tobytes())
        # .bin first: a reader that finds the new .idx always finds the .bin it describes.
        os.replace(self.prefix + ".bin" + self._tmp, self.prefix + ".bin")
        os.replace(idx_tmp, self.prefix + ".idx")

    def _discard(self) -> None:
        self._bin.close()
        for ext in (".bin", ".idx"):
            if os.path.exists(self.prefix + ext + self._tmp):
                os.remove(self.prefix + ext + self._tmp)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self._discard()


class IndexedDataset:
    """Memory-mapped reader: `len()` documents, `document(i)`, and the whole `tokens` stream."""

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = str(prefix)
        idx, bin_ = self.prefix + ".idx", self.prefix + ".bin"
        if not os.path.isfile(idx):
            raise MegaliteError(
                f"{idx} does not exist; pass the prefix written by tools/preprocess_data.py "
                "(without .bin/.idx) to --data-path"
            )
        if not os.path.isfile(bin_):
            raise MegaliteError(
                f"{bin_} is missing beside {idx}; copy it there or rerun tools/preprocess_data.py"
            )
        raw = Path(idx).read_bytes()
        head = raw[: HEADER.size]
        if raw.startswith(_MEGATRON_MAGIC):
            raise MegaliteError(
                f"{idx} is a Megatron-LM index, not megalite's; rerun tools/preprocess_data.py "
                "on the text"
            )
        if len(head) < HEADER.size or not head.startswith(MAGIC):
            raise MegaliteError(
                f"{idx} is not a megalite index file (wrong header); rerun "
                "tools/preprocess_data.py to write PREFIX.idx"
            )
        magic, version, code, self.vocab_size, self.num_docs, self.num_tokens = HEADER.unpack(head)
        if version != VERSION:
            raise MegaliteError(
                f"{idx} has format version {version} but this megalite reads version {VERSION}; "
                "rerun tools/preprocess_data.py with this version"
            )
        if code not in DTYPES:
            raise MegaliteError(
                f"{idx} declares unknown token dtype code {code}; it is corrupt or from another "
                "tool, rerun tools/preprocess_data.py"
            )
        self.dtype = DTYPES[code]
        if len(raw) != HEADER.size + 8 * (self.num_docs + 1):
            raise MegaliteError(
                f"{idx} is {len(raw)} bytes but its header describes {self.num_docs} documents; "
                "it is truncated or corrupt, rerun tools/preprocess_data.py"
            )
        bin_size = os.path.getsize(bin_)
        if bin_size != self.num_tokens * self.dtype.itemsize:
            raise MegaliteError(
                f"{bin_} is {bin_size} bytes but {idx} describes {self.num_tokens} "
                f"{self.dtype.name} tokens ({self.num_tokens * self.dtype.itemsize} bytes); "
                "the pair does not match, rerun tools/preprocess_data.py"
            )
        self.doc_offsets = np.frombuffer(raw, dtype="<i8", offset=HEADER.size)
        offs = self.doc_offsets
        if offs[0] != 0 or offs[-1] != self.num_tokens or np.any(np.diff(offs) < 0):
            raise MegaliteError(
                f"{idx} has corrupt document offsets; rerun tools/preprocess_data.py"
            )
        self.tokens = (
            np.memmap(bin_, dtype=self.dtype.newbyteorder("<"), mode="r")
            if self.num_tokens
            else np.empty(0, dtype=self.dtype)
        )

    def __len__(self) -> int:
        return self.num_docs

    def document(self, i: int) -> np.ndarray:
        return self.tokens[self.doc_offsets[i] : self.doc_offsets[i + 1]]


# --- building one from text: tokenization in worker processes -------------------------------

_worker = None  # (tokenizer, encoding threads) of this process


def _init_worker(model_path: str, threads: int = 1, kind: str | None = None) -> None:
    global _worker
    from megalite.data.tokenizer import load_tokenizer

    _worker = (load_tokenizer(model_path, kind), threads)


def _encode_batch(docs: list[str]) -> list[np.ndarray]:
    tok, threads = _worker
    dtype = dtype_for_vocab(tok.vocab_size)
    out = []
    for ids in tok.encode_batch(docs, num_threads=threads):
        arr = np.empty(len(ids) + 1, dtype=dtype)
        arr[:-1] = ids
        arr[-1] = tok.eos_id  # EOS closes every document: samples crossing documents see the end
        out.append(arr)
    return out


def _batches(docs: Iterable[str], max_chars: int = 1 << 18) -> Iterator[list[str]]:
    """Groups of documents of about `max_chars`: big enough to amortise the inter-process hop."""
    batch, size = [], 0
    for doc in docs:
        batch.append(doc)
        size += len(doc)
        if size >= max_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def build_indexed_dataset(
    documents: Iterable[str],
    tokenizer_model: str | os.PathLike,
    output_prefix: str | os.PathLike,
    workers: int = 1,
    progress: bool = True,
    threads: int = 1,
    tokenizer_type: str | None = None,
) -> dict:
    """Tokenize `documents` (EOS after each) into PREFIX.bin/.idx; returns a summary dict.

    `tokenizer_model`/`tokenizer_type` are what `load_tokenizer` takes. `workers > 1` encodes
    in that many worker processes (order kept), each single-threaded. They are spawned, which
    re-imports the caller's `__main__`: use them from a script file. `threads` is for
    `workers == 1`: the tokenizer's own encoding threads in this process (-1: all cores), the
    way to go parallel inside a library caller (no processes, nothing re-imported).
    `progress` shows a bar on a terminal; it stays quiet when stderr is not one (a log file).
    """
    from megalite.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_model, tokenizer_type)
    if tok.eos_id < 0:
        raise MegaliteError(
            f"tokenizer {tokenizer_model} has no end-of-sequence token; megalite ends every "
            "document with one: use a tokenizer that has one (e.g. </s> or <|endoftext|>)"
        )
    start = time.perf_counter()
    ndocs = ntokens = 0
    # the total is unknown (documents stream in): the bar counts tokens and shows the rate
    bar = tqdm(unit="tok", unit_scale=True, disable=None if progress else True, leave=False)
    pool = None
    if workers > 1:
        ctx = multiprocessing.get_context("spawn")
        init = (tok.model_path, 1, tok.kind)  # the file a directory holds, and its kind
        pool = ctx.Pool(workers, initializer=_init_worker, initargs=init)
        encoded = pool.imap(_encode_batch, _batches(documents))
    else:
        _init_worker(tok.model_path, threads, tok.kind)
        encoded = map(_encode_batch, _batches(documents))
    try:
        with IndexedDatasetWriter(output_prefix, tok.vocab_size) as writer:
            for batch in encoded:
                for arr in batch:
                    writer.add_document(arr)
                    ndocs += 1
                    ntokens += arr.size
                bar.update(sum(a.size for a in batch))
                bar.set_postfix_str(f"{ndocs} documents", refresh=False)
            writer.finalize()
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
    seconds = time.perf_counter() - start
    return {"documents": ndocs, "tokens": ntokens, "seconds": seconds, "prefix": str(output_prefix)}
