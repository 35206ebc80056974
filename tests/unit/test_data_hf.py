"""Hugging Face tokenizers, Parquet, gzip and Zstandard inputs, the checkpoint's tokenizer file,
TensorBoard."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megalite.checkpoint import format as fmt
from megalite.checkpoint import writing
from megalite.config import Config
from megalite.config_read import parse_args
from megalite.data import corpus
from megalite.data.encode_docs import build_indexed_dataset
from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.tokenizer import HFTokenizer, Tokenizer, load_tokenizer, tokenizer_kind
from megalite.errors import MegaliteError
from megalite.training.logger import Logger
from tests.e2e.conftest import train_byte_bpe

pytest.importorskip("tokenizers")
REPO = Path(__file__).resolve().parents[2]
# Indentation, CRLF, NUL, sentencepiece's meta symbol, a literal special token, non-ASCII and
# an emoji (4 UTF-8 bytes): byte-level BPE must give every one of them back.
ODD_TEXT = "  indented\n\ttabbed\r\n trailing  \n\nünïcödé 漢字 \x00 ▁x 12345 <|endoftext|> 🙂\n"


@pytest.fixture(scope="module")
def docs():
    """About 60 kB of real source in 12 documents, plus one of awkward characters."""
    files = corpus.stdlib_files(max_bytes=60_000)
    return [f.read_text(encoding="utf-8") for f in files if f.stat().st_size][:12] + [ODD_TEXT]


@pytest.fixture(scope="module")
def hf_dir(docs, tmp_path_factory):
    """A directory holding a 400-token byte-level BPE tokenizer.json."""
    d = tmp_path_factory.mktemp("hf")
    train_byte_bpe(docs, d, 400)
    return d


def test_round_trip_is_byte_exact(hf_dir, docs):
    tok = load_tokenizer(hf_dir)
    assert isinstance(tok, HFTokenizer) and tok.kind == "huggingface"
    assert tok.model_path == str(hf_dir / "tokenizer.json")  # the file a checkpoint copies
    assert tok.vocab_size == 400
    assert tok.eos_id == tok.bos_id == tok.pad_id == 0  # GPT-2's <|endoftext|>, no pad token
    assert tok.unk_id == -1  # byte-level: nothing is unknown
    assert tok.special_tokens == {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
    encoded = [tok.encode(d) for d in docs]
    for doc, ids in zip(docs, encoded):
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == doc
    # the literal special token in a document is text, not the end-of-document id
    assert tok.eos_id not in encoded[-1]
    # parallel and one-thread batches give the single encodes
    assert tok.encode_batch(docs, num_threads=1) == encoded == tok.encode_batch(docs)
    # a learned vocabulary, not bytes only
    assert len(encoded[0]) < 0.7 * len(docs[0].encode())


def test_kind_from_path_and_megatron_names(hf_dir, tmp_path):
    assert tokenizer_kind(hf_dir) == tokenizer_kind(hf_dir / "tokenizer.json") == "huggingface"
    assert tokenizer_kind(tmp_path / "m.model") == "sentencepiece"  # need not exist yet
    assert tokenizer_kind("x", "HuggingFaceTokenizer") == "huggingface"
    assert tokenizer_kind("x", "GPTSentencePieceTokenizer") == "sentencepiece"
    # a tokenizer.json under another name, with its type given
    (tmp_path / "tok.bin").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    assert load_tokenizer(tmp_path / "tok.bin", "huggingface").vocab_size == 400


@pytest.mark.parametrize(
    "path, kind, message",
    [
        ("vocab.txt", None, "cannot tell which kind of tokenizer"),
        ("missing", None, "does not exist"),
        ("missing.json", None, "does not exist"),
        ("empty_dir", None, "holds no tokenizer.json"),
        ("vocab.txt", "wordpiece", "unknown tokenizer type 'wordpiece'"),
        ("vocab.txt", "huggingface", "is not a Hugging Face tokenizer.json"),
        ("hf/tokenizer.json", "sentencepiece", "is not a sentencepiece model"),
        ("hf", "sentencepiece", "is a directory"),
    ],
)
def test_bad_tokenizer_paths(hf_dir, tmp_path, path, kind, message):
    (tmp_path / "vocab.txt").write_text("a\nb\n")
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "hf").symlink_to(hf_dir)
    with pytest.raises(MegaliteError, match=message):
        load_tokenizer(tmp_path / path, kind)


def test_tokenizer_without_eos_and_unknown_type_flag(tmp_path):
    from tokenizers import Tokenizer as HF
    from tokenizers import models

    HF(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(tmp_path / "t.json"))
    with pytest.raises(MegaliteError, match="has no end-of-sequence token"):
        build_indexed_dataset(["a b"], tmp_path / "t.json", tmp_path / "o", progress=False)
    assert not list(tmp_path.glob("o.*"))
    with pytest.raises(MegaliteError, match="invalid choice: 'wordpiece'"):
        parse_args(["--tokenizer-type", "wordpiece"])
    assert parse_args(["--tokenizer-type", "HuggingFaceTokenizer"]).data.tokenizer_type == (
        "HuggingFaceTokenizer"
    )


def test_missing_tokenizers_package_is_one_clear_error(hf_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import raises ImportError
    with pytest.raises(MegaliteError, match=r"need the tokenizers package; pip install tokenizers"):
        load_tokenizer(hf_dir)


def _preprocess(*args, cwd):
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / "preprocess_data.py"), *args, "--quiet"],
        cwd=cwd, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_parquet_and_gzip_give_the_jsonl_dataset(hf_dir, docs, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"content": d, "n": i} for i, d in enumerate(docs)]
    lines = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "d.jsonl").write_text(lines)
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    # two row groups: batches cross a group boundary
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet", row_group_size=5)
    out = {}
    for name, workers in (("d.jsonl", "1"), ("d.jsonl.gz", "2"), ("d.parquet", "1")):
        r = _preprocess("--input", name, "--json-key", "content", "--output-prefix", name + ".o",
                        "--tokenizer-model", str(hf_dir), "--workers", workers, cwd=tmp_path)  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert r.stderr.count("\n") == 1  # the summary line only: no progress off a terminal
        out[name] = [(tmp_path / f"{name}.o{ext}").read_bytes() for ext in (".bin", ".idx")]
    assert out["d.jsonl"] == out["d.jsonl.gz"] == out["d.parquet"]
    tok, ds = load_tokenizer(hf_dir), IndexedDataset(tmp_path / "d.jsonl.o")
    assert [tok.decode(ds.document(i)[:-1]) for i in range(len(ds))] == docs
    assert all(ds.document(i)[-1] == tok.eos_id for i in range(len(ds)))
    assert ds.document(0).dtype == np.uint16


def test_zstd_gives_the_plain_files_dataset(hf_dir, docs, tmp_path):
    """The Pile's and SlimPajama's .jsonl.zst, read as it streams: byte-identical .bin/.idx to
    the plain .jsonl, in megalite's preprocessing and Megatron's (--json-keys --append-eod)."""
    zstd = pytest.importorskip("zstandard")
    lines = "".join(json.dumps({"text": d, "n": i}) + "\n" for i, d in enumerate(docs))
    cut = len(lines) // 3
    (tmp_path / "d.jsonl").write_text(lines)
    c = zstd.ZstdCompressor(level=3)  # two frames, as `zstd -c a b` writes: both are read
    (tmp_path / "d.jsonl.zst").write_bytes(
        c.compress(lines[:cut].encode()) + c.compress(lines[cut:].encode())
    )
    for extra, outs in (
        ([], [".o"]),
        (["--json-keys", "text", "--append-eod"], [".o_text_document"]),
    ):
        got = {}
        for name in ("d.jsonl", "d.jsonl.zst"):
            r = _preprocess("--input", name, "--output-prefix", name + ".o", *extra,
                            "--tokenizer-model", str(hf_dir), "--workers", "1", cwd=tmp_path)  # fmt: skip
            assert r.returncode == 0, r.stderr
            got[name] = [
                (tmp_path / f"{name}{o}{e}").read_bytes() for o in outs for e in (".bin", ".idx")
            ]
        assert got["d.jsonl"] == got["d.jsonl.zst"] and len(got["d.jsonl"][0]) > 1000
    tok, ds = load_tokenizer(hf_dir), IndexedDataset(tmp_path / "d.jsonl.zst.o")
    assert [tok.decode(ds.document(i)[:-1]) for i in range(len(ds))] == docs


def test_bad_zstd_inputs(tmp_path, monkeypatch):
    zstd = pytest.importorskip("zstandard")
    whole = zstd.ZstdCompressor().compress(b'{"text": "a"}\n' * 500)
    (tmp_path / "cut.jsonl.zst").write_bytes(whole[:-8])  # a cut download ends inside a frame
    (tmp_path / "junk.jsonl.zst").write_text('{"text": "not zstd"}\n')
    for name, message in (("cut.jsonl.zst", "ends inside a frame"), ("junk.jsonl.zst", "frame")):
        with pytest.raises(
            MegaliteError, match=f"{name} is not a complete Zstandard file.*{message}"
        ):
            list(corpus.iter_documents([str(tmp_path / name)]))
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(MegaliteError, match="needs the zstandard package; pip install zstandard"):
        list(corpus.iter_documents([str(tmp_path / "cut.jsonl.zst")]))


def test_bad_parquet_and_gzip_inputs(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "other.parquet")
    (tmp_path / "junk.parquet").write_text("not parquet")
    (tmp_path / "bad.jsonl.gz").write_text("not gzip")
    cases = [("ints.parquet", "column 'text' holds int64, not text"),
             ("other.parquet", "has no column 'text' (its columns: body)"),
             ("junk.parquet", "is not a readable Parquet file"),
             ("bad.jsonl.gz", "is not a complete gzip file")]  # fmt: skip
    for name, message in cases:
        with pytest.raises(MegaliteError, match=message.replace("(", r"\(").replace(")", r"\)")):
            list(corpus.iter_documents([str(tmp_path / name)]))
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(MegaliteError, match="needs the pyarrow package; pip install pyarrow"):
        list(corpus.iter_documents([str(tmp_path / "other.parquet")]))


def test_preprocess_refuses_training_a_hf_tokenizer(tmp_path):
    (tmp_path / "t.txt").write_text("text")
    r = _preprocess("--input", "t.txt", "--output-prefix", "o", "--train-tokenizer",
                    "--vocab-size", "300", "--tokenizer-type", "huggingface", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "--train-tokenizer trains a sentencepiece model" in r.stderr


def test_checkpoint_stores_the_tokenizer_under_its_kind(hf_dir, docs, tmp_path):
    (tmp_path / "t.txt").write_text("".join(docs[:6]))
    sp = Tokenizer.train([str(tmp_path / "t.txt")], tmp_path / "sp", 400)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    # a tokenizer.json under any name is stored as tokenizer.json: the content decides
    (tmp_path / "renamed").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    files = writing.copy_tokenizer(tmp_path / "renamed", ckpt)
    assert list(files) == ["tokenizer.json"] and fmt.stored_tokenizer(files) == "tokenizer.json"
    assert files["tokenizer.json"]["sha256"] == fmt.sha256_file(hf_dir / "tokenizer.json")
    files = writing.copy_tokenizer(sp, ckpt)
    assert list(files) == ["tokenizer.model"] and fmt.stored_tokenizer(files) == "tokenizer.model"
    assert fmt.stored_tokenizer({"model.safetensors": {}}) is None
    # both load back by their stored names
    assert load_tokenizer(ckpt / "tokenizer.json").encode(docs[0]) == load_tokenizer(hf_dir).encode(
        docs[0]
    )
    assert load_tokenizer(ckpt / "tokenizer.model").kind == "sentencepiece"


def test_tensorboard_logs_the_wandb_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = Config()
    cfg.logging.wandb_mode, cfg.logging.tensorboard_dir = "disabled", str(tmp_path / "tb")
    log = Logger(cfg, enabled=True)
    rows = [{"iteration": i, "loss": 5.0 / i, "mfu": None, "skipped": False,
             "comm": {"tp": {"bytes": 100 * i, "seconds": 0.5}}} for i in (1, 2, 3)]  # fmt: skip
    for row in rows:
        log.write(row)
    log.finish()
    acc = EventAccumulator(str(tmp_path / "tb")).Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "iteration", "skipped", "comm/tp_bytes", "comm/tp_seconds"} <= tags
    assert "mfu" not in tags  # unknown values are left out, as for W&B
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == [1, 2, 3]
    assert np.allclose([e.value for e in loss], [r["loss"] for r in rows], rtol=1e-6)
    assert [e.value for e in acc.Scalars("comm/tp_bytes")] == [100, 200, 300]


def test_tensorboard_missing_is_one_clear_error(monkeypatch):
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tensorboard" else find(name, *a),
    )
    cfg = Config()
    cfg.logging.wandb_mode, cfg.logging.tensorboard_dir = "disabled", "tb"
    # every rank refuses, not only the one that would write
    for enabled in (True, False):
        with pytest.raises(MegaliteError, match="needs the tensorboard package; pip install"):
            Logger(cfg, enabled=enabled)


def test_builtin_corpus_with_a_hf_tokenizer(hf_dir, tmp_path):
    from megalite.data.gpt_dataset import prepare_builtin

    prefix, model = prepare_builtin(tmp_path, 512, str(hf_dir), "huggingface", 50_000, 1)
    assert Path(model).name == "tokenizer.json"  # kept under its kind: load_tokenizer infers it
    tok, ds = load_tokenizer(model), IndexedDataset(prefix)
    docs = [f.read_text(encoding="utf-8") for f in corpus.stdlib_files(50_000)]
    assert [tok.decode(ds.document(i)) for i in range(len(ds))] == [d for d in docs if d]
    again = prepare_builtin(tmp_path, 512, str(hf_dir / "tokenizer.json"), max_bytes=50_000)
    assert again == (prefix, model)  # the directory and its file are one tokenizer: cached
