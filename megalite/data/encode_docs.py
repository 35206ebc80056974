"""Building an indexed dataset from text: documents tokenized in worker processes, in order,
and written through `IndexedDatasetWriter` (the same records Megatron's preprocessing writes).
"""

import multiprocessing
import os
import sys
import time
from collections.abc import Iterable, Iterator

import numpy as np
from tqdm import tqdm

from megalite.data.indexed_dataset import IndexedDatasetWriter
from megalite.errors import MegaliteError

_worker = None  # (tokenizer, encoding threads, append EOD) of this process


def _init_worker(model_path: str, threads: int = 1, kind: str | None = None, eod=True) -> None:
    global _worker
    from megalite.data.tokenizer import load_tokenizer

    _worker = (load_tokenizer(model_path, kind), threads, eod)


def _encode_batch(records: list[tuple[list[str], ...]]) -> list[list[tuple[np.ndarray, list]]]:
    """Each record's fields (each a list of sentences) as (ids, sequence lengths), the way
    Megatron's preprocessing makes them: empty sentences dropped, EOD after a non-empty
    document's last sentence when asked (megalite always asks)."""
    tok, threads, eod = _worker
    flat = [s for rec in records for field in rec for s in field]
    encoded = iter(tok.encode_batch(flat, num_threads=threads))
    out = []
    for rec in records:
        fields = []
        for field in rec:
            seqs = [ids for ids in (next(encoded) for _ in field) if len(ids)]
            lengths = [len(ids) for ids in seqs]
            if seqs and eod:  # samples crossing documents see where one ends
                seqs.append([tok.eos_id])
                lengths[-1] += 1
            arr, at = np.empty(sum(lengths), dtype=np.int64), 0
            for ids in seqs:  # slice assignment: no Python loop over the tokens
                arr[at : at + len(ids)] = ids
                at += len(ids)
            fields.append((arr, lengths))
        out.append(fields)
    return out


def _batches(
    records: Iterable[tuple], sizes: list, max_chars: int = 1 << 18
) -> Iterator[list[tuple]]:
    """Groups of records of about `max_chars`: big enough to amortise the inter-process hop.
    Each group's characters are appended to `sizes` (progress reads them in order)."""
    batch, size = [], 0
    for rec in records:
        batch.append(rec)
        size += sum(len(s) for field in rec for s in field)
        if size >= max_chars:
            sizes.append(size)
            yield batch
            batch, size = [], 0
    if batch:
        sizes.append(size)
        yield batch


class Progress:
    """How far a run is: tqdm's bar on a terminal; off one (a SLURM log, a file), a line every
    `every_docs` documents or `every_s` seconds, whichever comes first, with the rates and, when
    the input's size is known (`total_bytes`), an estimate of the time left."""

    def __init__(self, every_docs=1000, every_s=30.0, total_bytes=None, enabled=True, out=None):
        self.out = out or sys.stderr
        self.every_docs, self.every_s, self.total = every_docs, every_s, total_bytes
        self.start = self.last_t = time.perf_counter()
        self.docs = self.tokens = self.chars = self.last_docs = 0
        tty = enabled and self.out.isatty()
        self.lines = enabled and not tty
        # the total is unknown (documents stream in): the bar counts tokens and shows the rate
        self.bar = tqdm(unit="tok", unit_scale=True, disable=not tty, leave=False, file=self.out)

    def update(self, docs: int, tokens: int, chars: int) -> None:
        self.docs, self.tokens, self.chars = (
            self.docs + docs,
            self.tokens + tokens,
            chars + self.chars,
        )
        self.bar.update(tokens)
        self.bar.set_postfix_str(f"{self.docs} documents", refresh=False)
        now = time.perf_counter()
        due = self.docs - self.last_docs >= self.every_docs or now - self.last_t >= self.every_s
        if self.lines and due:
            self.last_t, self.last_docs = now, self.docs
            print(self.line(now), file=self.out, flush=True)

    def line(self, now: float) -> str:
        s = max(now - self.start, 1e-9)
        mb = self.chars / 2**20
        eta = ""
        if self.total and 0 < self.chars < self.total:  # characters as bytes: about right
            eta = f", ETA {_hms(s * (self.total / self.chars - 1))}"
        return (
            f"processed {self.docs:,} documents, {self.tokens:,} tokens, {mb:,.1f} MB in "
            f"{_hms(s)}: {self.tokens / s:,.0f} tokens/s, {mb / s:.2f} MB/s{eta}"
        )

    def close(self) -> None:
        self.bar.close()


def _hms(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}h{m % 60:02d}m{s:02d}s" if m >= 60 else f"{m}m{s:02d}s"


def build_indexed_dataset(
    documents: Iterable[str],
    tokenizer_model: str | os.PathLike,
    output_prefix: str | os.PathLike,
    workers: int = 1,
    progress: bool = True,
    threads: int = 1,
    tokenizer_type: str | None = None,
    log: dict | None = None,
) -> dict:
    """Tokenize `documents` (EOS after each) into PREFIX.bin/.idx; returns a summary dict.

    `tokenizer_model`/`tokenizer_type` are what `load_tokenizer` takes. `workers > 1` encodes
    in that many worker processes (order kept), each single-threaded. They are spawned, which
    re-imports the caller's `__main__`: use them from a script file. `threads` is for
    `workers == 1`: the tokenizer's own encoding threads in this process (-1: all cores), the
    way to go parallel inside a library caller (no processes, nothing re-imported).
    `progress` shows a bar on a terminal and writes lines off one (a log file); `log` holds
    `Progress`'s every_docs, every_s and total_bytes.
    """
    from megalite.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_model, tokenizer_type)
    if tok.eos_id < 0:
        raise MegaliteError(
            f"tokenizer {tokenizer_model} has no end-of-sequence token; megalite ends every "
            "document with one: use a tokenizer that has one (e.g. </s> or <|endoftext|>)"
        )
    records = (([doc],) for doc in documents)
    return build_datasets_of_fields(
        records, tok, [output_prefix], True, workers, progress, threads, log
    )


def build_datasets_of_fields(
    records: Iterable[tuple[list[str], ...]],
    tok,
    prefixes: list,
    append_eod: bool,
    workers: int = 1,
    progress: bool = True,
    threads: int = 1,
    log: dict | None = None,
) -> dict:
    """Tokenize records of k text fields (each a list of sentences) with the loaded tokenizer
    `tok` into k datasets, field j to `prefixes[j]` (Megatron's preprocessing with k
    --json-keys); see `build_indexed_dataset` for `workers`, `threads`, `progress` and `log`."""
    start = time.perf_counter()
    ndocs = ntokens = 0
    bar = Progress(enabled=progress, **(log or {}))
    chars = []  # of each batch, counted as it is read; pool.imap keeps the order
    pool = None
    init = (tok.model_path, 1, tok.kind, append_eod)  # the file a directory holds, and its kind
    if workers > 1:
        ctx = multiprocessing.get_context("spawn")
        pool = ctx.Pool(workers, initializer=_init_worker, initargs=init)
        encoded = pool.imap(_encode_batch, _batches(records, chars))
    else:
        _init_worker(tok.model_path, threads, tok.kind, append_eod)
        encoded = map(_encode_batch, _batches(records, chars))
    writers = [IndexedDatasetWriter(p, tok.vocab_size, tok.fingerprint) for p in prefixes]
    try:
        for k, batch in enumerate(encoded):
            before = ntokens
            for fields in batch:
                for writer, (ids, lengths) in zip(writers, fields):
                    writer.add_document(ids, lengths)
                    ntokens += ids.size
                ndocs += 1
            bar.update(len(batch), ntokens - before, chars[k])
        for writer in writers:
            writer.finalize()
    except BaseException:
        for writer in writers:
            writer._discard()
        raise
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
    seconds = time.perf_counter() - start
    out = [str(p) for p in prefixes]
    return {
        "documents": ndocs,
        "tokens": ntokens,
        "seconds": seconds,
        "prefix": out[0],
        "prefixes": out,
    }
