"""Megatron-LM's index format (`MMIDIDX`, version 1): what Megatron, NeMo and GPT-NeoX write.

A Megatron PREFIX.idx describes PREFIX.bin as *sequences* grouped into *documents* (a document is
usually one sequence; sentence-split data has several). Little-endian:

    magic b"MMIDIDX\\0\\0" | version u64 (1) | dtype code u8 | sequence count S u64 | D u64
    sequence_lengths int32[S]   tokens of each sequence
    sequence_pointers int64[S]  byte offset of each sequence in PREFIX.bin
    document_indices int64[D]   D = documents + 1: document k is sequences [d[k], d[k+1])
    (modes int8[S]              multimodal data only; megalite does not read it)

The dtype codes are Megatron's: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
7 float32, 8 uint16. The header carries no vocabulary size; megalite keeps its own facts (the
vocabulary size and the tokenizer's fingerprint) in a sidecar JSON (see indexed_dataset.py).
"""

import struct
from typing import NamedTuple

import numpy as np

from megalite.errors import MegaliteError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, S, D: 34 bytes
DTYPES = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODES = {dt: code for code, dt in DTYPES.items()}
_RERUN = "rerun the preprocessing (tools/preprocess_data.py or Megatron's) to rewrite it"


class IndexArrays(NamedTuple):
    """What either index format says about PREFIX.bin, in Megatron's terms."""

    dtype: np.dtype
    sequence_lengths: np.ndarray  # int32 (S,)
    sequence_offsets: np.ndarray  # int64 (S,), in tokens
    document_indices: np.ndarray  # int64 (D,), in sequences; [0, ..., S]


def megatron_dtype(vocab_size: int) -> np.dtype:
    """The token dtype Megatron's preprocessing picks for a vocabulary (its optimal_dtype rule:
    uint16 below 65500 ids, else int32), so megalite writes the files Megatron would."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def write_index(fh, dtype: np.dtype, sequence_lengths, document_indices) -> None:
    """Write a Megatron index for contiguous sequences of `sequence_lengths` tokens."""
    lengths = np.asarray(sequence_lengths, dtype="<i4")
    docs = np.asarray(document_indices, dtype="<i8")
    pointers = np.zeros(len(lengths), dtype="<i8")
    np.cumsum(lengths[:-1], dtype="<i8", out=pointers[1:])
    pointers *= dtype.itemsize
    fh.write(HEADER.pack(MAGIC, VERSION, _CODES[np.dtype(dtype)], len(lengths), len(docs)))
    for arr in (lengths, pointers, docs):
        fh.write(arr.tobytes())


def read_index(idx: str, raw: bytes) -> IndexArrays:
    """Parse and check the bytes `raw` of the Megatron index `idx`: every inconsistency (a
    truncated file, an unknown or float dtype, multimodal modes, sequences that do not tile the
    token stream, document bounds out of order) is one MegaliteError naming the file."""
    if len(raw) < HEADER.size:
        raise MegaliteError(f"{idx} is a truncated Megatron-LM index (header cut short); {_RERUN}")
    _, version, code, n_seq, n_doc = HEADER.unpack_from(raw)
    if version != VERSION:
        raise MegaliteError(
            f"{idx} is a Megatron-LM index of version {version}, but megalite reads version "
            f"{VERSION}; {_RERUN}"
        )
    if code not in DTYPES:
        raise MegaliteError(
            f"{idx} declares unknown token dtype code {code} (Megatron's are 1..8); it is corrupt "
            f"or from another tool: {_RERUN}"
        )
    dtype = DTYPES[code]
    if dtype.kind == "f":
        raise MegaliteError(
            f"{idx} holds {dtype.name} values, not token ids; megalite trains on tokenized text "
            "only: point --data-path at a dataset of integer tokens"
        )
    body = HEADER.size + 12 * n_seq + 8 * n_doc
    if len(raw) == body + n_seq and n_seq:
        raise MegaliteError(
            f"{idx} is a multimodal Megatron-LM index (it has sequence modes); megalite trains "
            "on text only: preprocess the text without modes"
        )
    if len(raw) != body or n_doc < 1:
        raise MegaliteError(
            f"{idx} is {len(raw)} bytes but its header describes {n_seq} sequences in "
            f"{max(n_doc, 1) - 1} documents; it is truncated or corrupt, {_RERUN}"
        )
    lengths = np.frombuffer(raw, dtype="<i4", count=n_seq, offset=HEADER.size)
    pointers = np.frombuffer(raw, dtype="<i8", count=n_seq, offset=HEADER.size + 4 * n_seq)
    docs = np.frombuffer(raw, dtype="<i8", count=n_doc, offset=HEADER.size + 12 * n_seq)
    if docs[0] != 0 or docs[-1] != n_seq or np.any(np.diff(docs) < 0):
        raise MegaliteError(
            f"{idx} has corrupt document indices (they must rise from 0 to the {n_seq} "
            f"sequences); {_RERUN}"
        )
    offsets = np.zeros(n_seq, dtype=np.int64)
    np.cumsum(lengths[:-1], dtype=np.int64, out=offsets[1:])
    # megalite reads the tokens as one stream: the sequences must follow one another in order
    if np.any(lengths < 0) or not np.array_equal(pointers, offsets * dtype.itemsize):
        raise MegaliteError(
            f"{idx} has corrupt sequence lengths or pointers (the sequences must follow one "
            f"another in PREFIX.bin); {_RERUN}"
        )
    return IndexArrays(dtype, lengths, offsets, docs)
