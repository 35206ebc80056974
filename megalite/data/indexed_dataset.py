"""Tokenized documents on disk: PREFIX.bin (the token stream) and PREFIX.idx (its index).

PREFIX.bin is every document's tokens, one after another, as raw little-endian integers. Two
index formats are read, told apart by their first bytes:

- Megatron-LM's `MMIDIDX` (megatron_index.py), which megalite writes by default: the files
  Megatron's own preprocessing writes for the same tokens, read by Megatron, NeMo and GPT-NeoX.
  Its header has no vocabulary size, so megalite writes its own facts beside it in
  PREFIX.idx.json (the vocabulary size, the tokenizer's fingerprint, the counts they describe);
  an index without one (made by Megatron) reads the same, the vocabulary then unknown.
- megalite's own first format (still read, written only on request): a 40-byte header and the
  `num_docs + 1` document offsets (int64), every document one sequence:

    magic b"MEGALIDX" | version u32 | dtype code u32 | vocab_size u64 | num_docs u64 | num_tokens u64

  with codes 1 uint16 and 2 int32.

The reader checks all of it against the files' sizes before mapping the tokens, so a truncated,
mismatched or foreign file is a clear error rather than garbage samples.
"""

import json
import os
import struct
from pathlib import Path

import numpy as np

from megalite.data import megatron_index
from megalite.data.megatron_index import IndexArrays, megatron_dtype
from megalite.errors import MegaliteError

MAGIC = b"MEGALIDX"
VERSION = 1
HEADER = struct.Struct("<8sIIQQQ")
DTYPES = {1: np.dtype(np.uint16), 2: np.dtype(np.int32)}
_CODES = {dt: code for code, dt in DTYPES.items()}
SIDECAR = ".idx.json"  # PREFIX.idx.json: megalite's facts about a Megatron-format index
MEGATRON, MEGALITE = "megatron", "megalite"  # the index formats the writer writes
# check_vocab looks at this many leading tokens for ids outside the vocabulary: a cheap catch
# of the common mistake (data of another tokenizer) that never reads a whole large file.
_PEEK_TOKENS = 1 << 20


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The token dtype of megalite's own format (uint16 up to 65536 ids, else int32)."""
    return DTYPES[1] if vocab_size <= 2**16 else DTYPES[2]


class IndexedDatasetWriter:
    """Appends documents; `finalize()` makes PREFIX.bin and PREFIX.idx appear (atomically).

    `index_format` MEGATRON (the default) writes Megatron-LM's index, with the token dtype its
    preprocessing picks for `vocab_size`, plus PREFIX.idx.json; MEGALITE writes megalite's first
    format. Used as a context manager, an exception leaves no partial files behind.
    """

    def __init__(
        self,
        prefix: str | os.PathLike,
        vocab_size: int,
        tokenizer_fingerprint: str | None = None,
        index_format: str = MEGATRON,
    ):
        if index_format not in (MEGATRON, MEGALITE):
            raise ValueError(f"unknown index format {index_format!r}")  # a bug, not input
        self.prefix, self.vocab_size, self.format = str(prefix), vocab_size, index_format
        self.fingerprint = tokenizer_fingerprint
        self.dtype = (
            megatron_dtype(vocab_size) if index_format == MEGATRON else dtype_for_vocab(vocab_size)
        )
        self.sequence_lengths, self.document_indices = [], [0]
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._tmp = f".tmp{os.getpid()}"
        self._bin = open(self.prefix + ".bin" + self._tmp, "wb")

    def add_document(self, ids, lengths: list[int] | None = None) -> None:
        """Append one document: `ids`, made of sequences of `lengths` tokens (Megatron's
        sentences; default one sequence, none for an empty document, as Megatron writes)."""
        arr = np.asarray(ids)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size})")  # a bug, not input
        lengths = ([arr.size] if arr.size else []) if lengths is None else list(lengths)
        if sum(lengths) != arr.size or (self.format == MEGALITE and len(lengths) > 1):
            raise ValueError(f"sequence lengths {lengths} do not fit {arr.size} tokens")  # a bug
        self._bin.write(arr.astype(self.dtype.newbyteorder("<"), copy=False).tobytes())
        self.sequence_lengths += lengths
        self.document_indices.append(len(self.sequence_lengths))

    def finalize(self) -> None:
        self._bin.close()
        if len(self.document_indices) == 1:
            self._discard()
            raise MegaliteError(f"no documents to write to {self.prefix}; give non-empty input")
        n_docs, n_tokens = len(self.document_indices) - 1, sum(self.sequence_lengths)
        idx_tmp = self.prefix + ".idx" + self._tmp
        with open(idx_tmp, "wb") as fh:
            if self.format == MEGATRON:
                megatron_index.write_index(
                    fh, self.dtype, self.sequence_lengths, self.document_indices
                )
            else:
                head = (MAGIC, VERSION, _CODES[self.dtype], self.vocab_size, n_docs, n_tokens)
                fh.write(HEADER.pack(*head))
                ends = np.cumsum([0] + self.sequence_lengths)[self.document_indices]
                fh.write(np.asarray(ends, dtype="<i8").tobytes())
        # .bin first: a reader that finds the new .idx always finds the .bin it describes.
        os.replace(self.prefix + ".bin" + self._tmp, self.prefix + ".bin")
        if self.format == MEGATRON:
            facts = {"megalite_sidecar": 1, "vocab_size": self.vocab_size}
            facts |= {"tokenizer_fingerprint": self.fingerprint}
            facts |= {"documents": n_docs, "tokens": n_tokens}
            side_tmp = self.prefix + SIDECAR + self._tmp
            Path(side_tmp).write_text(json.dumps(facts, indent=1) + "\n")
            os.replace(side_tmp, self.prefix + SIDECAR)
        os.replace(idx_tmp, self.prefix + ".idx")

    def _discard(self) -> None:
        self._bin.close()
        for ext in (".bin", ".idx", SIDECAR):
            if os.path.exists(self.prefix + ext + self._tmp):
                os.remove(self.prefix + ext + self._tmp)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self._discard()


class IndexedDataset:
    """Memory-mapped reader of either index format.

    `len()` documents and `document(i)`; the arrays, in Megatron's terms for both formats (in
    megalite's own every document is one sequence): `tokens` (the whole stream, memory-mapped),
    `doc_offsets` (num_docs + 1 token offsets), `sequence_lengths`, `sequence_offsets` (in
    tokens) and `document_indices` (num_docs + 1, in sequences). `vocab_size` and
    `tokenizer_fingerprint` are None where the files do not say (a Megatron index without
    megalite's sidecar); `check_vocab` checks a tokenizer against what is known.
    """

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
        self.vocab_size = self.tokenizer_fingerprint = None
        if raw.startswith(megatron_index.MAGIC):
            self.format, arrays = MEGATRON, megatron_index.read_index(idx, raw)
        elif raw.startswith(MAGIC) and len(raw) >= HEADER.size:
            self.format, arrays = MEGALITE, self._read_megalite(idx, raw)
        else:
            raise MegaliteError(
                f"{idx} is not a megalite index file nor a Megatron-LM one (wrong header); "
                "rerun tools/preprocess_data.py to write PREFIX.idx"
            )
        self.dtype, self.sequence_lengths, self.sequence_offsets, self.document_indices = arrays
        self.num_docs = len(self.document_indices) - 1
        self.num_tokens = int(self.sequence_lengths.sum(dtype=np.int64))
        self._check_bin_size(self.dtype, self.num_tokens)
        starts = np.append(self.sequence_offsets, self.num_tokens)
        self.doc_offsets = starts[self.document_indices]
        if self.format == MEGATRON:
            self._read_sidecar()
        self.tokens = (
            np.memmap(bin_, dtype=self.dtype.newbyteorder("<"), mode="r")
            if self.num_tokens
            else np.empty(0, dtype=self.dtype)
        )

    def _check_bin_size(self, dtype: np.dtype, num_tokens: int) -> None:
        bin_, size = self.prefix + ".bin", os.path.getsize(self.prefix + ".bin")
        if size != num_tokens * dtype.itemsize:
            raise MegaliteError(
                f"{bin_} is {size} bytes but {self.prefix}.idx describes {num_tokens} "
                f"{dtype.name} tokens ({num_tokens * dtype.itemsize} bytes); "
                "the pair does not match, rerun tools/preprocess_data.py"
            )

    def _read_megalite(self, idx: str, raw: bytes) -> IndexArrays:
        magic, version, code, vocab, num_docs, num_tokens = HEADER.unpack_from(raw)
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
        if len(raw) != HEADER.size + 8 * (num_docs + 1):
            raise MegaliteError(
                f"{idx} is {len(raw)} bytes but its header describes {num_docs} documents; "
                "it is truncated or corrupt, rerun tools/preprocess_data.py"
            )
        self._check_bin_size(DTYPES[code], num_tokens)  # before the offsets, as it always was
        offs = np.frombuffer(raw, dtype="<i8", offset=HEADER.size)
        if offs[0] != 0 or offs[-1] != num_tokens or np.any(np.diff(offs) < 0):
            raise MegaliteError(
                f"{idx} has corrupt document offsets; rerun tools/preprocess_data.py"
            )
        self.vocab_size = vocab
        lengths = np.diff(offs).astype(np.int32)
        return IndexArrays(DTYPES[code], lengths, offs[:-1], np.arange(num_docs + 1))

    def _read_sidecar(self) -> None:
        path = self.prefix + SIDECAR
        if not os.path.isfile(path):
            return  # Megatron's own files: the vocabulary is unknown, check_vocab does what it can
        try:
            facts = json.loads(Path(path).read_text())
            vocab, docs, tokens = facts["vocab_size"], facts["documents"], facts["tokens"]
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            raise MegaliteError(
                f"{path} is not megalite's description of {self.prefix}.idx; delete it (the data "
                "still reads) or rerun tools/preprocess_data.py"
            ) from None
        if (docs, tokens) != (self.num_docs, self.num_tokens):
            raise MegaliteError(
                f"{path} describes {docs} documents of {tokens} tokens but {self.prefix}.idx has "
                f"{self.num_docs} of {self.num_tokens}; it belongs to other data: delete it or "
                "rerun tools/preprocess_data.py"
            )
        self.vocab_size, self.tokenizer_fingerprint = vocab, facts.get("tokenizer_fingerprint")

    def check_vocab(self, vocab_size: int, tokenizer_name: str, fingerprint: str | None = None):
        """Raise one MegaliteError if this data cannot come from the tokenizer `tokenizer_name`
        of `vocab_size` ids (and `fingerprint`): another vocabulary size or tokenizer on record,
        a token dtype too narrow for its ids, or leading tokens outside its vocabulary."""
        fix = "pass the tokenizer it was made with to --tokenizer-model"
        if self.vocab_size is not None and self.vocab_size != vocab_size:
            raise MegaliteError(
                f"dataset {self.prefix} was tokenized with a {self.vocab_size}-piece vocabulary "
                f"but {tokenizer_name} has {vocab_size}; {fix}"
            )
        theirs = self.tokenizer_fingerprint
        if fingerprint is not None and theirs is not None and theirs != fingerprint:
            raise MegaliteError(
                f"dataset {self.prefix} was tokenized with another tokenizer than "
                f"{tokenizer_name} (same vocabulary size, other pieces); {fix}"
            )
        top = int(np.iinfo(self.dtype).max)
        if top < vocab_size - 1:
            raise MegaliteError(
                f"dataset {self.prefix} stores {self.dtype.name} tokens (ids up to {top}) but "
                f"{tokenizer_name} has {vocab_size} ids; it was made with a smaller vocabulary: "
                f"{fix}"
            )
        head = np.asarray(self.tokens[:_PEEK_TOKENS])
        if head.size and (head.min() < 0 or head.max() >= vocab_size):
            bad = int(head.max() if head.max() >= vocab_size else head.min())
            raise MegaliteError(
                f"dataset {self.prefix} holds token id {bad}, outside the {vocab_size} ids of "
                f"{tokenizer_name}; {fix}"
            )

    def __len__(self) -> int:
        return self.num_docs

    def document(self, i: int) -> np.ndarray:
        return self.tokens[self.doc_offsets[i] : self.doc_offsets[i + 1]]
