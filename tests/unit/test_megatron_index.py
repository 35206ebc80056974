"""Megatron-LM's MMIDIDX index, with megatron-core's own IndexedDataset(Builder) as the oracle."""

import json
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from megalite.data.indexed_dataset import SIDECAR, IndexedDataset, IndexedDatasetWriter
from megalite.data.megatron_index import HEADER
from megalite.errors import MegaliteError

with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed"
    warnings.simplefilter("ignore")
    from megatron.core.datasets import indexed_dataset as mcore


def _random_documents(rng, high, n=12, split=False):
    """(ids, sequence lengths) per document; an empty one (no sequences) among them."""
    docs = []
    for k in range(n):
        size = 0 if k == 3 else int(rng.integers(1, 40))
        ids = rng.integers(0, high, size)
        cuts = (
            np.sort(rng.choice(np.arange(1, size), min(size - 1, 2), replace=False))
            if split and size > 1
            else []
        )
        lengths = np.diff([0, *cuts, size]).tolist() if size else []
        docs.append((ids, lengths))
    return docs


def _megatron_documents(prefix):
    """Every document as megatron-core's IndexedDataset reads it (its sequences joined)."""
    m = mcore.IndexedDataset(str(prefix))
    d = m.document_indices
    docs = [np.concatenate([m[j] for j in range(d[k], d[k + 1])] or [np.empty(0, m.index.dtype)])
            for k in range(len(d) - 1)]  # fmt: skip
    return m, docs


@pytest.mark.parametrize(
    "dtype, high, split",
    [
        (np.uint8, 256, False),
        (np.int8, 128, False),
        (np.int16, 32768, False),
        (np.int32, 100_000, False),
        (np.int64, 2**40, False),
        (np.uint16, 65535, True),  # several sequences per document (add_document's lengths)
    ],
)
def test_megalite_reads_what_megatron_writes(tmp_path, dtype, high, split):
    docs = _random_documents(np.random.default_rng(0), high, split=split)
    prefix = str(tmp_path / "m")
    builder = mcore.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for ids, lengths in docs:
        builder.add_document(torch.from_numpy(ids), lengths)
    builder.finalize(prefix + ".idx")
    ds, (m, _) = IndexedDataset(prefix), _megatron_documents(prefix)
    assert ds.format == "megatron" and ds.dtype == np.dtype(dtype) and ds.vocab_size is None
    assert len(ds) == len(docs) and ds.num_tokens == sum(ids.size for ids, _ in docs)
    for i, (ids, _) in enumerate(docs):
        assert ds.document(i).tolist() == ids.tolist()
    np.testing.assert_array_equal(ds.sequence_lengths, m.sequence_lengths)
    np.testing.assert_array_equal(ds.document_indices, m.document_indices)
    np.testing.assert_array_equal(
        ds.sequence_offsets * ds.dtype.itemsize, m.index.sequence_pointers
    )
    for j in range(len(m)):
        s = ds.sequence_offsets[j]
        assert ds.tokens[s : s + ds.sequence_lengths[j]].tolist() == m[j].tolist()


@pytest.mark.parametrize("vocab, dtype", [(1000, np.uint16), (65499, np.uint16), (65500, np.int32)])
def test_megatron_reads_what_megalite_writes_byte_for_byte(tmp_path, vocab, dtype):
    docs = _random_documents(np.random.default_rng(1), vocab, split=True)
    with IndexedDatasetWriter(tmp_path / "ours", vocab, "f" * 16) as w:
        for ids, lengths in docs:
            w.add_document(ids, lengths)
        w.finalize()
    m, theirs = _megatron_documents(tmp_path / "ours")
    assert m.index.dtype == dtype and len(theirs) == len(docs)
    assert all(t.tolist() == ids.tolist() for t, (ids, _) in zip(theirs, docs))
    # the files Megatron's builder writes for the same documents (its dtype rule included)
    builder = mcore.IndexedDatasetBuilder(
        str(tmp_path / "mc.bin"), dtype=mcore.DType.optimal_dtype(vocab)
    )
    for ids, lengths in docs:
        builder.add_document(torch.from_numpy(ids), lengths)
    builder.finalize(str(tmp_path / "mc.idx"))
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"mc{ext}").read_bytes()
    facts = json.loads((tmp_path / f"ours{SIDECAR}").read_text())
    assert facts["vocab_size"] == vocab and facts["tokenizer_fingerprint"] == "f" * 16
    ds = IndexedDataset(tmp_path / "ours")
    assert ds.vocab_size == vocab and ds.tokenizer_fingerprint == "f" * 16


@pytest.fixture
def megatron_files(tmp_path):
    """Megatron's files (no sidecar): three uint16 documents of 5, 3 and 7 tokens."""
    prefix = str(tmp_path / "d")
    builder = mcore.IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for n in (5, 3, 7):
        builder.add_document(torch.arange(n) + 1, [n])
    builder.finalize(prefix + ".idx")
    return prefix


def _patch(prefix, **fields):
    raw = bytearray(Path(prefix + ".idx").read_bytes())
    names = ["magic", "version", "code", "seqs", "docs"]
    values = dict(zip(names, HEADER.unpack_from(raw)))
    values.update(fields)
    raw[: HEADER.size] = HEADER.pack(*(values[n] for n in names))
    Path(prefix + ".idx").write_bytes(bytes(raw))


def _rewrite(prefix, fn):
    Path(prefix + ".idx").write_bytes(fn(Path(prefix + ".idx").read_bytes()))


_BODY = HEADER.size  # lengths int32[3] at 34, pointers int64[3] at 46, document indices at 70


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda p: _rewrite(p, lambda r: r[:-8]), "truncated or corrupt"),
        (lambda p: _rewrite(p, lambda r: r[:20]), "truncated Megatron-LM index"),
        (lambda p: _patch(p, version=2), "Megatron-LM index of version 2"),
        (lambda p: _patch(p, code=6), "holds float64 values"),
        (lambda p: _patch(p, code=7), "holds float32 values"),
        (lambda p: _patch(p, code=9), "unknown token dtype code 9"),
        (lambda p: _patch(p, code=4), "pointers"),  # int32 would misread uint16 tokens
        (lambda p: _rewrite(p, lambda r: r + bytes(3)), "multimodal"),
        (
            lambda p: _rewrite(p, lambda r: r[:70] + struct.pack("<4q", 0, 2, 1, 3)),
            "document indices",
        ),
        (
            lambda p: _rewrite(p, lambda r: r[:46] + struct.pack("<3q", 0, 12, 16) + r[70:]),
            "pointers",
        ),
        (lambda p: open(p + ".bin", "ab").write(b"\0\0"), "does not match"),
        (lambda p: Path(p + SIDECAR).write_text("{oops"), "not megalite's description"),
        (
            lambda p: Path(p + SIDECAR).write_text(
                json.dumps({"vocab_size": 9, "documents": 2, "tokens": 15})
            ),
            "belongs to other data",
        ),
    ],
)
def test_bad_megatron_index_is_one_line(megatron_files, corrupt, message):
    IndexedDataset(megatron_files)  # intact: reads
    corrupt(megatron_files)
    with pytest.raises(MegaliteError, match=message) as e:
        IndexedDataset(megatron_files)
    assert "\n" not in str(e.value) and megatron_files in str(e.value)


def test_check_vocab_without_and_with_a_sidecar(megatron_files, tmp_path):
    ds = IndexedDataset(megatron_files)  # Megatron's: vocabulary unknown
    ds.check_vocab(50_257, "gpt2")  # fits uint16, ids 1..7 inside: fine
    with pytest.raises(MegaliteError, match=r"stores uint16 tokens \(ids up to 65535\)") as e:
        ds.check_vocab(100_000, "big.json")  # a 100k vocabulary cannot be stored as uint16
    assert "\n" not in str(e.value) and "big.json" in str(e.value)
    with pytest.raises(MegaliteError, match="holds token id 7, outside the 6 ids of small"):
        ds.check_vocab(6, "small")
    with IndexedDatasetWriter(tmp_path / "s", 1000, "a" * 16) as w:
        w.add_document([1, 2, 3])
        w.finalize()
    ds = IndexedDataset(tmp_path / "s")
    ds.check_vocab(1000, "same", "a" * 16)
    ds.check_vocab(1000, "unknown fingerprint")  # a caller without one: the vocabulary decides
    with pytest.raises(MegaliteError, match="1000-piece vocabulary but other has 1001"):
        ds.check_vocab(1001, "other", "a" * 16)
    with pytest.raises(MegaliteError, match="another tokenizer than other"):
        ds.check_vocab(1000, "other", "b" * 16)


def test_writer_refuses_lengths_that_do_not_fit(tmp_path):
    with pytest.raises(ValueError, match="do not fit"):
        with IndexedDatasetWriter(tmp_path / "d", 10) as w:
            w.add_document([1, 2, 3], [1, 1])
    assert list(tmp_path.iterdir()) == []
