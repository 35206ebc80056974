"""Tokenizer, indexed dataset files and tools/preprocess_data.py."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megalite.data import corpus
from megalite.data.encode_docs import build_indexed_dataset
from megalite.data.indexed_dataset import (
    HEADER,
    MEGALITE,
    IndexedDataset,
    IndexedDatasetWriter,
)
from megalite.data.tokenizer import Tokenizer
from megalite.errors import MegaliteError

REPO = Path(__file__).resolve().parents[2]
ODD_TEXT = "  indented\n\ttabbed\r\n trailing  \n\nünïcödé 漢字 \x00 ▁x 12345\n"


@pytest.fixture(scope="module")
def docs():
    """About 60 kB of real source in 12 documents, plus one of awkward characters."""
    files = corpus.stdlib_files(max_bytes=60_000)
    return [f.read_text(encoding="utf-8") for f in files if f.stat().st_size][:12] + [ODD_TEXT]


@pytest.fixture(scope="module")
def tok(docs, tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    (d / "train.txt").write_text("".join(docs), encoding="utf-8")
    return Tokenizer(Tokenizer.train([str(d / "train.txt")], d / "t", vocab_size=400))


def test_tokenizer_round_trips_and_has_specials(tok, docs):
    assert tok.vocab_size == 400
    assert len({tok.bos_id, tok.eos_id, tok.pad_id}) == 3 and min(tok.eos_id, tok.pad_id) >= 0
    for doc in docs:
        ids = tok.encode(doc)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == doc
    # the vocabulary is learned, not bytes only: common code tokenizes shorter than UTF-8
    assert len(tok.encode(docs[0])) < 0.7 * len(docs[0].encode())


def test_tokenizer_bad_model(tmp_path):
    with pytest.raises(MegaliteError, match="does not exist"):
        Tokenizer(tmp_path / "missing.model")
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(MegaliteError, match="not a sentencepiece model"):
        Tokenizer(tmp_path / "junk.model")


def test_tokenizer_vocab_too_large_for_input(tmp_path):
    (tmp_path / "t.txt").write_text("tiny text\n" * 20)
    with pytest.raises(MegaliteError, match="more than this input supports"):
        Tokenizer.train([str(tmp_path / "t.txt")], tmp_path / "t", vocab_size=5000)
    with pytest.raises(MegaliteError, match="too small"):
        Tokenizer.train([str(tmp_path / "t.txt")], tmp_path / "t", vocab_size=100)
    assert list(tmp_path.iterdir()) == [tmp_path / "t.txt"]


@pytest.mark.parametrize("workers, threads", [(1, 1), (2, 1), (1, 2)])
def test_build_round_trips_per_document(tok, docs, tmp_path, workers, threads):
    prefix = tmp_path / "d"
    stats = build_indexed_dataset(docs, tok.model_path, prefix, workers, False, threads)
    ds = IndexedDataset(tmp_path / "d")
    assert len(ds) == stats["documents"] == len(docs)
    assert ds.num_tokens == stats["tokens"] and ds.dtype == np.uint16
    for i, doc in enumerate(docs):
        ids = ds.document(i)
        assert ids[-1] == tok.eos_id
        assert tok.decode(ids[:-1]) == doc


def test_large_vocab_uses_int32(tmp_path):
    with IndexedDatasetWriter(tmp_path / "d", vocab_size=100_000) as w:
        w.add_document([0, 70_000, 99_999])
        w.add_document([])
        w.add_document([5])
        w.finalize()
    ds = IndexedDataset(tmp_path / "d")
    assert ds.dtype == np.int32 and ds.num_docs == 3
    assert ds.document(0).tolist() == [0, 70_000, 99_999]
    assert ds.document(1).tolist() == [] and ds.document(2).tolist() == [5]


@pytest.fixture
def written(tmp_path):
    """Data in megalite's first format (Megatron's: tests/unit/test_megatron_index.py)."""
    prefix = str(tmp_path / "d")
    with IndexedDatasetWriter(prefix, vocab_size=1000, index_format=MEGALITE) as w:
        for n in (5, 3, 7):
            w.add_document(np.arange(n))
        w.finalize()
    return prefix


def _patch_header(prefix, **fields):
    raw = bytearray(Path(prefix + ".idx").read_bytes())
    names = ["magic", "version", "code", "vocab", "docs", "tokens"]
    values = dict(zip(names, HEADER.unpack_from(raw)))
    values.update(fields)
    raw[: HEADER.size] = HEADER.pack(*(values[n] for n in names))
    Path(prefix + ".idx").write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda p: os.remove(p + ".bin"), "is missing beside"),
        (lambda p: os.remove(p + ".idx"), "does not exist"),
        (lambda p: Path(p + ".idx").write_bytes(b"hello"), "not a megalite index"),
        (lambda p: Path(p + ".idx").write_bytes(b"MMIDIDX\x00\x00" + bytes(40)), "Megatron-LM"),
        (lambda p: _patch_header(p, version=7), "format version 7"),
        (lambda p: _patch_header(p, code=9), "unknown token dtype"),
        (lambda p: _patch_header(p, docs=4), "truncated or corrupt"),
        (lambda p: _patch_header(p, tokens=16), "does not match"),
        (lambda p: _patch_header(p, code=2), "does not match"),  # int32 would misread uint16
        (lambda p: open(p + ".bin", "ab").write(b"\0\0"), "does not match"),
        (lambda p: Path(p + ".idx").write_bytes(Path(p + ".idx").read_bytes()[:-8]), "truncated"),
        (
            lambda p: Path(p + ".idx").write_bytes(
                Path(p + ".idx").read_bytes()[: HEADER.size + 8] + struct.pack("<3q", 9, 2, 15)
            ),
            "corrupt document offsets",
        ),
    ],
)
def test_corrupt_files_are_clear_errors(written, corrupt, message):
    IndexedDataset(written)  # intact: reads
    corrupt(written)
    with pytest.raises(MegaliteError, match=message):
        IndexedDataset(written)


def test_writer_leaves_nothing_on_error(tmp_path):
    with pytest.raises(MegaliteError, match="no documents"):
        with IndexedDatasetWriter(tmp_path / "d", vocab_size=10) as w:
            w.finalize()
    with pytest.raises(ValueError):
        with IndexedDatasetWriter(tmp_path / "e", vocab_size=10) as w:
            w.add_document([10])
    assert list(tmp_path.iterdir()) == []


def _preprocess(*args, cwd):
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / "preprocess_data.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_preprocess_end_to_end(docs, tmp_path):
    (tmp_path / "in").mkdir()
    for i, doc in enumerate(docs[:4]):
        (tmp_path / "in" / f"{i:02d}.py").write_text(doc, encoding="utf-8")
    with open(tmp_path / "more.jsonl", "w") as fh:
        for doc in docs[4:]:
            fh.write(json.dumps({"body": doc, "id": 1}) + "\n")
    r = _preprocess(
        "--input",
        "in",
        "more.jsonl",
        "--json-key",
        "body",
        "--output-prefix",
        "out/p",
        "--train-tokenizer",
        "--vocab-size",
        "400",
        "--workers",
        "2",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert f"{len(docs)} documents" in r.stderr and "tokens/s" in r.stderr
    tok = Tokenizer(tmp_path / "out" / "p.model")
    ds = IndexedDataset(tmp_path / "out" / "p")
    assert [tok.decode(ds.document(i)[:-1]) for i in range(len(ds))] == docs
    # reuse the tokenizer: same tokens
    r = _preprocess(
        "--input",
        "in",
        "more.jsonl",
        "--json-key",
        "body",
        "--output-prefix",
        "again",
        "--tokenizer-model",
        "out/p.model",
        "--workers",
        "1",
        "--quiet",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert Path(tmp_path / "again.bin").read_bytes() == Path(tmp_path / "out/p.bin").read_bytes()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--input", "missing.txt", "--train-tokenizer", "--vocab-size", "300"], "does not exist"),
        (["--input", "empty.txt", "--train-tokenizer", "--vocab-size", "300"], "hold no text"),
        (["--input", "bad.jsonl", "--train-tokenizer", "--vocab-size", "300"], "not valid JSON"),
        (["--input", "empty.txt", "--train-tokenizer"], "needs --vocab-size"),
        (["--input", "empty.txt", "--tokenizer-model", "nope.model"], "does not exist"),
    ],
)
def test_preprocess_bad_input_is_one_line(tmp_path, args, message):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{oops\n')
    r = _preprocess(*args, "--output-prefix", "o", cwd=tmp_path)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megalite: error:") and message in lines[0]
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "o.bin").exists() and not (tmp_path / "o.idx").exists()


def test_preprocess_bad_input_found_by_a_worker_pool(tok, tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n' * 3 + "{oops\n")
    args = ["--input", "bad.jsonl", "--tokenizer-model", tok.model_path, "--workers", "2"]
    r = _preprocess(*args, "--output-prefix", "o", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "megalite: error: bad.jsonl line 4 is not valid JSON; JSONL inputs hold one object per line"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # no partial output
