"""tools/merge_datasets.py: shards merged as Megatron-LM's tool merges them, byte for byte (its
oracle: megatron-core's IndexedDatasetBuilder.add_index, which that tool calls on each shard in
sorted order), streamed a block at a time, megalite's .idx.json merged, bad input one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megalite.data import merge_shards
from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from megalite.errors import MegaliteError

REPO = Path(__file__).resolve().parents[2]


def _shards(d: Path, names=("b", "a", "c10", "c9"), vocab=1000, fingerprint="fp", seed=0):
    """Shards of documents of 0-3 sequences (Megatron's sentences; empty documents too)."""
    rng = np.random.default_rng(seed)
    d.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):
        with IndexedDatasetWriter(d / name, vocab, fingerprint) as w:
            for _ in range(1 + 40 * i):
                lengths = [int(x) for x in rng.integers(0, 30, int(rng.integers(0, 4)))]
                w.add_document(rng.integers(0, vocab, sum(lengths)), lengths)
            w.finalize()


def _megatron_merge(d: Path, out: Path, multimodal=False):
    """What Megatron-LM's tools/merge_datasets.py does: add_index of each prefix, sorted."""
    idx = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    prefixes = sorted({p.name[: -len(".idx")] for p in d.glob("*.idx")})
    first = idx.IndexedDataset(str(d / prefixes[0]), multimodal=multimodal)
    builder = idx.IndexedDatasetBuilder(
        str(out) + ".bin", dtype=first.index.dtype, multimodal=multimodal
    )
    for p in prefixes:
        builder.add_index(str(d / p))
    builder.finalize(str(out) + ".idx")


def _files(prefix: Path):
    return [Path(str(prefix) + ext).read_bytes() for ext in (".bin", ".idx")]


def test_merge_equals_megatrons_byte_for_byte(tmp_path, monkeypatch):
    _shards(tmp_path / "in")
    _megatron_merge(tmp_path / "in", tmp_path / "megatron")
    # the tool, as a Megatron user runs it
    r = subprocess.run(
        [sys.executable, str(REPO / "tools" / "merge_datasets.py"), "--input", "in",
         "--output-prefix", "out/merged"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "4 shards, 244 documents" in r.stderr and r.stderr.count("\n") == 1
    assert _files(tmp_path / "out" / "merged") == _files(tmp_path / "megatron")
    # in blocks of 7 entries: every block boundary of the streaming falls inside a shard
    monkeypatch.setattr(merge_shards, "BLOCK", 7)
    merge_shards.merge(tmp_path / "in", str(tmp_path / "small"))
    assert _files(tmp_path / "small") == _files(tmp_path / "megatron")
    # megalite reads it, with the shards' tokenizer facts, documents in order
    ds = IndexedDataset(tmp_path / "small")
    assert (ds.vocab_size, ds.tokenizer_fingerprint) == (1000, "fp")
    parts = [IndexedDataset(tmp_path / "in" / n) for n in ("a", "b", "c10", "c9")]
    docs = [p.document(i) for p in parts for i in range(len(p))]
    assert len(ds) == len(docs) and all(
        np.array_equal(ds.document(i), x) for i, x in enumerate(docs)
    )


def test_multimodal_shards_keep_their_modes(tmp_path):
    idx = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    torch = pytest.importorskip("torch")
    (tmp_path / "in").mkdir()
    rng = np.random.default_rng(1)
    for name, n in (("x", 5), ("y", 9)):
        b = idx.IndexedDatasetBuilder(str(tmp_path / "in" / name) + ".bin", np.int32, True)
        for _ in range(n):
            b.add_item(
                torch.tensor(rng.integers(0, 99, int(rng.integers(1, 9)))), int(rng.integers(0, 3))
            )
            b.end_document()
        b.finalize(str(tmp_path / "in" / name) + ".idx")
    _megatron_merge(tmp_path / "in", tmp_path / "megatron", multimodal=True)
    merge_shards.merge(tmp_path / "in", str(tmp_path / "out"), multimodal=True)
    assert _files(tmp_path / "out") == _files(tmp_path / "megatron")
    with pytest.raises(
        MegaliteError, match="has sequence modes: a multimodal index, pass --multimodal"
    ):
        merge_shards.merge(tmp_path / "in", str(tmp_path / "out"))


def test_sidecars_merge_or_refuse(tmp_path):
    _shards(tmp_path / "same", names=("a", "b"))
    _shards(tmp_path / "other", names=("a",), fingerprint="fp")
    _shards(tmp_path / "other", names=("b",), fingerprint="fp2")
    with pytest.raises(MegaliteError, match="tokenized with different tokenizers"):
        merge_shards.merge(tmp_path / "other", str(tmp_path / "o"))
    # a shard of Megatron's (no .idx.json): the merge reads the same, its tokenizer unknown
    os.remove(tmp_path / "same" / "b.idx.json")
    stats = merge_shards.merge(tmp_path / "same", str(tmp_path / "o"))
    assert "b has no .idx.json" in stats["sidecar"] and not (tmp_path / "o.idx.json").exists()
    assert IndexedDataset(tmp_path / "o").vocab_size is None
    # a stale .idx.json is refused, not merged into wrong counts
    facts = json.loads((tmp_path / "same" / "a.idx.json").read_text())
    (tmp_path / "same" / "a.idx.json").write_text(json.dumps(facts | {"documents": 99}))
    with pytest.raises(MegaliteError, match="a.idx.json does not describe"):
        merge_shards.merge(tmp_path / "same", str(tmp_path / "o"))


def test_bad_inputs_are_one_line(tmp_path):
    _shards(tmp_path / "dtypes", names=("a",))
    _shards(tmp_path / "dtypes", names=("b",), vocab=70000)  # int32 tokens
    _shards(tmp_path / "stray", names=("a",))
    (tmp_path / "stray" / "notes.txt").write_text("x")
    _shards(tmp_path / "cut", names=("a", "b"))
    with open(tmp_path / "cut" / "b.bin", "r+b") as fh:
        fh.truncate(10)
    (tmp_path / "empty").mkdir()
    cases = [("dtypes", "holds int32 tokens but .*a holds uint16"),
             ("stray", "notes.txt has no notes.idx beside it"),
             ("cut", "b.bin is 10 bytes but .*b.idx describes"),
             ("empty", "holds no .bin/.idx pair"),
             ("missing", "is not a directory")]  # fmt: skip
    for d, message in cases:
        with pytest.raises(MegaliteError, match=message):
            merge_shards.merge(tmp_path / d, str(tmp_path / "o"))
    with pytest.raises(MegaliteError, match="is one of the shards"):
        merge_shards.merge(tmp_path / "cut", str(tmp_path / "cut" / "a"))
    assert sorted(p.name for p in tmp_path.glob("o*")) == []  # nothing half written
