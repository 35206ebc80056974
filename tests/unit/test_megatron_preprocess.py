"""GPT-2's BPE from vocab.json/merges.txt, Megatron's preprocessing command line, the trainer's
tokenizer flags; transformers' GPT2Tokenizer and megatron-core's IndexedDataset as oracles."""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from megalite.config_read import parse_args
from megalite.data import corpus
from megalite.data.gpt_dataset import build_datasets
from megalite.data.tokenizer import Tokenizer, load_tokenizer
from megalite.errors import MegaliteError

pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")
with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed"
    warnings.simplefilter("ignore")
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexed
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

REPO = Path(__file__).resolve().parents[2]
ODD = "  indented\n\ttabbed\r\n trailing  \n\nünïcödé 漢字 \x00 ▁x 12345 it's we'll 🙂 ½\n"


@pytest.fixture(scope="module")
def texts():
    files = corpus.stdlib_files(max_bytes=40_000)
    return [f.read_text(encoding="utf-8") for f in files if f.stat().st_size][:8]


@pytest.fixture(scope="module")
def gpt2_files(texts, tmp_path_factory):
    """A tiny GPT-2-style vocab.json + merges.txt (byte-level BPE with <|endoftext|>)."""
    from tokenizers.implementations import ByteLevelBPETokenizer

    d = tmp_path_factory.mktemp("gpt2")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=500, special_tokens=["<|endoftext|>"])
    bpe.save_model(str(d))
    return str(d / "vocab.json"), str(d / "merges.txt")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGALITE_CACHE", str(tmp_path / "cache"))


def _oracle(gpt2_files):
    return transformers.GPT2Tokenizer(*gpt2_files)


def test_gpt2_bpe_gives_transformers_ids(gpt2_files, texts, tmp_path):
    tok = load_tokenizer(None, "GPT2BPETokenizer", *gpt2_files)
    oracle = _oracle(gpt2_files)
    text = (Path(corpus.stdlib_root()) / "textwrap.py").read_text() + ODD  # a text file
    ids = tok.encode(text)
    assert ids == oracle.encode(text) and len(ids) < 0.6 * len(text.encode())
    assert tok.decode(ids) == text
    assert tok.vocab_size == len(oracle) == 500 and tok.eos_id == oracle.eos_token_id
    # the cached tokenizer.json (what a checkpoint copies) is the same tokenizer
    copy = load_tokenizer(tok.model_path)
    assert copy.encode(text) == ids and copy.fingerprint == tok.fingerprint
    assert tok.model_path.startswith(str(tmp_path / "cache"))


@pytest.mark.parametrize(
    "args, message",
    [
        (dict(kind="GPT2BPETokenizer", merge=None), "GPT2BPETokenizer needs --merge-file"),
        (dict(kind="GPT2BPETokenizer", path="x.json"), "not --tokenizer-model"),
        (dict(kind="HuggingFaceTokenizer", path="x.json"), "--vocab-file and --merge-file make"),
        (dict(kind="GPT2BPETokenizer", vocab="merges"), "are not GPT-2's vocab.json"),
    ],
)
def test_gpt2_bpe_bad_files(gpt2_files, args, message):
    vocab, merges = gpt2_files
    files = {"vocab": vocab, "merges": merges, None: None}
    with pytest.raises(MegaliteError, match=message):
        load_tokenizer(
            args.get("path"),
            args["kind"],
            files[args.get("vocab", "vocab")],
            files[args.get("merge", "merges")],
        )


def _preprocess(*args, cwd):
    env = {**os.environ, "MEGALITE_CACHE": str(Path(cwd) / "cache")}
    cmd = [sys.executable, str(REPO / "tools" / "preprocess_data.py"), *args, "--quiet"]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120, env=env)


def _megatron_documents(prefix):
    m = MegatronIndexed(str(prefix))
    d = m.document_indices
    return m, [[m[j].tolist() for j in range(d[k], d[k + 1])] for k in range(len(d) - 1)]


def test_megatron_command_line_gives_megatrons_files(gpt2_files, texts, tmp_path):
    lines = [{"text": t, "title": t[:40]} for t in texts[:3]]
    lines.insert(1, {"text": "", "title": "an empty text is an empty document"})
    lines.append({"text": ["Sentence one. ", "", "Sentence two."], "title": ODD})
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    vocab, merges = gpt2_files
    r = _preprocess(
        "--input", "in.jsonl", "--output-prefix", "out/p", "--json-keys", "text", "title",
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges,
        "--append-eod", "--workers", "2", cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "out/p_text_document.bin/.idx, out/p_title_document.bin/.idx" in r.stderr
    oracle = _oracle(gpt2_files)
    eod = oracle.eos_token_id
    for key in ("text", "title"):
        m, docs = _megatron_documents(tmp_path / f"out/p_{key}_document")
        assert m.index.dtype == np.uint16 and len(docs) == len(lines)
        for line, got in zip(lines, docs):
            value = line[key] if isinstance(line[key], list) else [line[key]]
            want = [oracle.encode(s) for s in value if s]
            if want:
                want[-1] = want[-1] + [eod]  # EOD closes the document's last sentence
            assert got == want
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        f"p_{k}_document{e}" for k in ("text", "title") for e in (".bin", ".idx", ".idx.json")
    ]
    # the trainer takes Megatron's tokenizer flags for the same data
    cfg = parse_args(
        ["--data-path", str(tmp_path / "out/p_text_document"), "--tokenizer-type",
         "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges, "--seq-length", "16",
         "--split", "100,0,0"]
    )  # fmt: skip
    data = build_datasets(cfg)
    assert data.tokenizer.vocab_size == 500 and len(data.train) > 0


def test_sentencepiece_without_append_eod(texts, tmp_path):
    (tmp_path / "t.txt").write_text("".join(texts))
    model = Tokenizer.train([str(tmp_path / "t.txt")], tmp_path / "sp", vocab_size=400)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    r = _preprocess(
        "--input", "in.jsonl", "--output-prefix", "o", "--json-keys", "body",
        "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(model),
        "--workers", "1", cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    tok = Tokenizer(model)
    _, docs = _megatron_documents(tmp_path / "o_body_document")
    assert docs == [[tok.encode(t)] for t in texts]  # no EOD without --append-eod


@pytest.mark.parametrize(
    "args, message",
    [
        (["--input", "in.jsonl", "--append-eod", "--split-sentences"], "--split-sentences"),
        (["--input", "in.jsonl", "--json-keys", "text", "title"], "line 2 has no field 'title'"),
        (["--input", "t.txt", "--append-eod"], "t.txt is not JSONL"),
        (["--input", "in.jsonl", "--json-keys", "a", "--json-key", "b"], "keep one of them"),
        (["--input", "in.jsonl", "--append-eod", "--train-tokenizer", "--vocab-size", "300"],
         "takes an existing tokenizer"),
    ],
)  # fmt: skip
def test_megatron_command_line_bad_input_is_one_line(gpt2_files, tmp_path, args, message):
    (tmp_path / "in.jsonl").write_text('{"text": "a", "title": "b"}\n{"text": "c"}\n')
    (tmp_path / "t.txt").write_text("plain text")
    if "--train-tokenizer" not in args:
        vocab, merges = gpt2_files
        args = [*args, "--tokenizer-type", "GPT2BPETokenizer"]
        args += ["--vocab-file", vocab, "--merge-file", merges]
    r = _preprocess(*args, "--output-prefix", "o", cwd=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and message in lines[0], r.stderr
    assert not list(tmp_path.glob("o*"))


def test_megatron_data_of_another_tokenizer_is_one_line(gpt2_files, tmp_path):
    # Megatron's own files (no sidecar: vocabulary unknown) hold ids past this 500-id vocabulary
    builder = IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16)
    builder.add_document(torch.arange(0, 700, 7), [100])
    builder.finalize(str(tmp_path / "m.idx"))
    vocab, merges = gpt2_files
    args = ["--data-path", str(tmp_path / "m"), "--vocab-file", vocab, "--merge-file", merges]
    with pytest.raises(MegaliteError, match="holds token id 693, outside the 500 ids") as e:
        build_datasets(parse_args([*args, "--seq-length", "16"]))
    assert "\n" not in str(e.value)


def test_builtin_corpus_with_gpt2_bpe_flags_uses_that_tokenizer(gpt2_files, tmp_path, monkeypatch):
    # --vocab-file/--merge-file without --data-path: the built-in corpus in GPT-2's ids, not a
    # sentencepiece model trained for it
    monkeypatch.setattr(corpus, "MAX_CORPUS_BYTES", 40_000)
    vocab, merges = gpt2_files
    cfg = parse_args(["--vocab-file", vocab, "--merge-file", merges, "--seq-length", "16",
                      "--data-cache-dir", str(tmp_path / "data")])  # fmt: skip
    data = build_datasets(cfg)
    want = load_tokenizer(None, None, vocab, merges)
    assert data.tokenizer.vocab_size == want.vocab_size == 500
    assert data.tokenizer.encode(ODD) == want.encode(ODD)
