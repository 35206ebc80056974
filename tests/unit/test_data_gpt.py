"""GPT samples, splits, blending, and build_datasets (data paths and the built-in corpus cache)."""

import subprocess
import sys
import time
from collections import Counter
from subprocess import PIPE

import numpy as np
import pytest

from megalite.config import Config
from megalite.data import corpus
from megalite.data.gpt_dataset import (
    BlendedDataset,
    GPTDataset,
    Sequences,
    build_datasets,
    prepare_builtin,
)
from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from megalite.data.splits import parse_data_path, parse_split, split_sequences
from megalite.data.tokenizer import Tokenizer
from megalite.errors import MegaliteError
from megalite.lr_schedule import train_iters


def model_vocab(cfg, data) -> int:
    """The model's vocabulary for these datasets (the run shape takes the tokenizer's)."""
    from megalite.shape import validate

    return validate(cfg, 1).with_vocab(data.tokenizer.vocab_size).model.vocab_size


def write(prefix, docs, vocab_size=1000):
    with IndexedDatasetWriter(prefix, vocab_size) as w:
        for d in docs:
            w.add_document(d)
        w.finalize()
    return Sequences.of(IndexedDataset(prefix))


def test_samples_are_stream_windows_crossing_documents(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 1000, rng.integers(1, 30)) for _ in range(40)]
    ds = GPTDataset(write(tmp_path / "d", docs), 0, 40, seq_length=8, seed=5)
    assert sorted(ds.document_index.tolist()) == list(range(40))  # one epoch, shuffled
    assert ds.document_index.tolist() != list(range(40))
    stream = np.concatenate([docs[k] for k in ds.document_index])  # the shuffled documents
    assert len(ds) == (len(stream) - 1) // 8
    got = sorted(tuple(ds[i]) for i in range(len(ds)))
    want = sorted(tuple(stream[j * 8 : j * 8 + 9]) for j in range(len(ds)))
    assert got == want  # every window exactly once, in a shuffled order
    assert all(ds[i].dtype == np.int64 and len(ds[i]) == 9 for i in range(len(ds)))
    assert [tuple(ds[i]) for i in range(5)] != want[:5] or len(ds) < 5
    again = GPTDataset(Sequences.of(IndexedDataset(tmp_path / "d")), 0, 40, seq_length=8, seed=5)
    assert all((ds[i] == again[i]).all() for i in range(len(ds)))  # deterministic
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_split_is_by_sequences(tmp_path):
    docs = [np.full(10, k) for k in range(50)]
    indexed = write(tmp_path / "d", docs)
    ranges = split_sequences(50, parse_split("80,10,10"))
    assert ranges == [(0, 40), (40, 45), (45, 50)]
    assert split_sequences(5, parse_split("98,2,0")) == [(0, 4), (4, 5), (5, 5)]
    assert split_sequences(1, parse_split("98,2,0")) == [(0, 1), (1, 1), (1, 1)]
    valid = GPTDataset(indexed, *ranges[1], seq_length=4, seed=0)
    seen = {int(t) for i in range(len(valid)) for t in valid[i]}
    assert seen <= set(range(40, 45))  # no training document leaks in
    assert parse_split("100") == [1.0, 0.0, 0.0] and parse_split("3/1") == [0.75, 0.25, 0.0]
    for bad in ("a,b", "1,2,3,4", "-1,2", "0,1,0"):
        with pytest.raises(MegaliteError, match="--split"):
            parse_split(bad)


def test_data_path_weights():
    assert parse_data_path(["a", "b"]) == (None, ["a", "b"])
    assert parse_data_path(["0.7", "a", "3", "b"]) == ([0.7, 3.0], ["a", "b"])
    for bad in (["0", "a"], ["-1", "a", "1", "b"], ["nan", "a"], ["1", "a", "b"], ["1", "2"]):
        with pytest.raises(MegaliteError, match="--data-path"):
            parse_data_path(bad)


class Fake:
    def __init__(self, tag, n):
        self.tag, self.n = tag, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        assert 0 <= i < self.n
        return (self.tag, i)


@pytest.mark.parametrize("weights", [[0.7, 0.3], [1, 1, 2], [0.05, 0.9, 0.05]])
def test_blend_proportions(weights):
    total = 1000
    parts = [Fake(k, n) for k, n in enumerate([900, 1000, 800][: len(weights)])]
    blend = BlendedDataset(parts, weights, total)
    assert len(blend) == total
    share = np.asarray(weights) / sum(weights)
    # every prefix holds each dataset's share to within one sample (plus rounding)
    for prefix in (50, 333, total):
        tags = Counter(blend[i][0] for i in range(prefix))
        for k in range(len(parts)):
            assert abs(tags[k] - share[k] * prefix) <= 2, (prefix, k)
    # each part's samples are taken in its own order, from its first
    for k in range(len(parts)):
        seen = [i for (t, i) in (blend[j] for j in range(total)) if t == k]
        assert seen == list(range(len(seen)))
    with pytest.raises(
        MegaliteError, match="takes 700 samples from dataset 0, which has 600; give it more data"
    ):
        BlendedDataset([Fake(0, 600), Fake(1, 300)], [0.7, 0.3], total)


def _config(seq_length=16, **data):
    cfg = Config()
    cfg.model.seq_length = seq_length
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Two tiny datasets of real text with their tokenizer."""
    d = tmp_path_factory.mktemp("data")
    files = corpus.stdlib_files(max_bytes=80_000)
    # documents of 40 lines: enough of them for every split
    lines = "".join(f.read_text(encoding="utf-8") for f in files).splitlines(keepends=True)
    texts = ["".join(lines[k : k + 40]) for k in range(0, len(lines), 40)]
    (d / "all.txt").write_text("".join(texts))
    model = Tokenizer.train([str(d / "all.txt")], d / "tok", 400)
    tok = Tokenizer(model)
    for name, part in (("a", texts[::2]), ("b", texts[1::2])):
        write(d / name, [[*tok.encode(t), tok.eos_id] for t in part], tok.vocab_size)
    return d


def test_build_datasets_from_prefixes(prepared):
    cfg = _config(data_path=[str(prepared / "a")], tokenizer_model=str(prepared / "tok.model"))
    out = build_datasets(cfg)
    assert model_vocab(cfg, out) == out.tokenizer.vocab_size == 400
    assert len(out.train) > 10 * len(out.valid) > 0 and out.test is None
    assert out.train[0].shape == (17,) and out.train[0].dtype == np.int64
    # blended, with weights: a ~ 1/4 of the train samples
    a, b, model = str(prepared / "a"), str(prepared / "b"), str(prepared / "tok.model")
    cfg = _config(data_path=["1", a, "3", b], tokenizer_model=model, split="90,5,5")
    out = build_datasets(cfg)
    assert isinstance(out.train, BlendedDataset) and out.test is not None
    assert abs(np.mean(out.train.dataset_index == 0) - 0.25) < 0.01
    cfg = _config(data_path=[a], tokenizer_model=model, split="100,0,0")
    assert build_datasets(cfg).valid is None


TOK = dict(tokenizer_model="tok.model")


@pytest.mark.parametrize(
    "data, model_vocab, message",
    [
        (dict(data_path=["a"]), None, "pass --tokenizer-model"),
        (dict(data_path=["a"], **TOK), 399, "has 400 pieces but --vocab-size is 399"),
        (dict(data_path=["missing"], **TOK), None, "does not exist"),
        (dict(data_path=["0", "a"], **TOK), None, "positive"),
        (dict(data_path=["a"], split="999,1,0", seq_length=2000, **TOK), None, "--split"),
        (dict(), 100, "has 2048 pieces but --vocab-size is 100"),  # before building anything
    ],
)
def test_build_datasets_bad_input(prepared, tmp_path, monkeypatch, data, model_vocab, message):
    monkeypatch.chdir(prepared)
    cfg = _config(data_cache_dir=str(tmp_path / "cache"), **data)
    cfg.model.vocab_size = model_vocab
    with pytest.raises(MegaliteError, match=message):
        build_datasets(cfg)
    assert not (tmp_path / "cache").exists()


def test_dataset_of_another_tokenizer(prepared, tmp_path):
    write(tmp_path / "x", [[1, 2, 3]], vocab_size=500)
    cfg = _config(data_path=[str(tmp_path / "x")], tokenizer_model=str(prepared / "tok.model"))
    with pytest.raises(MegaliteError, match="500-piece vocabulary"):
        build_datasets(cfg)


def test_builtin_corpus_cache_is_built_once_under_concurrency(tmp_path):
    # three processes race for the same small built-in corpus: one builds, the others wait
    code = (
        "import sys; from megalite.data.gpt_dataset import prepare_builtin; "
        f"print(prepare_builtin({str(tmp_path)!r}, 512, max_bytes=100_000, threads=1))"
    )
    run = [sys.executable, "-c", code]
    procs = [subprocess.Popen(run, stdout=PIPE, stderr=PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert len({o for o, _ in outs}) == 1
    assert sum("preparing" in e for _, e in outs) == 1
    entries = [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")]
    assert len(entries) == 1 and not entries[0].startswith(".")  # no temporary left behind
    prefix, model = prepare_builtin(tmp_path, 512, max_bytes=100_000)
    ds, tok = IndexedDataset(prefix), Tokenizer(model)
    docs = [f.read_text(encoding="utf-8") for f in corpus.stdlib_files(100_000)]
    assert [tok.decode(ds.document(i)[:-1]) for i in range(len(ds))] == [d for d in docs if d]


def test_build_datasets_twice_uses_the_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "MAX_CORPUS_BYTES", 100_000)
    cfg = _config(data_cache_dir=str(tmp_path), tokenizer_vocab_size=512, split="90,10,0")
    first = build_datasets(cfg)
    assert model_vocab(cfg, first) == 512 and len(first.valid) > 0

    def no_rebuild(*a, **k):
        raise AssertionError("rebuilt the cached corpus")

    monkeypatch.setattr(corpus, "build_corpus", no_rebuild)
    cfg = _config(data_cache_dir=str(tmp_path), tokenizer_vocab_size=512, split="90,10,0")
    second = build_datasets(cfg)
    assert len(second.train) == len(first.train)
    assert all((first.train[i] == second.train[i]).all() for i in range(0, len(first.train), 7))


@pytest.mark.slow
def test_full_builtin_corpus(tmp_path):
    t = time.perf_counter()
    cfg = _config(data_cache_dir=str(tmp_path))
    cfg.model.seq_length = 128
    out = build_datasets(cfg)
    assert out.tokenizer.vocab_size == model_vocab(cfg, out) == 2048
    assert len(out.train) > 10_000 and len(out.valid) > 100
    text = out.tokenizer.decode(out.train[0])
    assert len(text) > 128  # a learned vocabulary: more than one character per token
    print(f"full built-in corpus: {time.perf_counter() - t:.1f} s")


def test_per_split_paths_flags_and_errors(prepared, tmp_path):
    from megalite.config_read import parse_args

    a, b, model = str(prepared / "a"), str(prepared / "b"), str(prepared / "tok.model")
    argv = ["--train-data-path", "0.3", a, "0.7", b, "--valid-data-path", b, "--tokenizer-model",
            model, "--data-cache-path", str(tmp_path / "idx"), "--seq-length", "16"]  # fmt: skip
    cfg = parse_args(argv)
    assert cfg.data.train_data_path == ["0.3", a, "0.7", b] and cfg.data.data_cache_path == str(
        tmp_path / "idx"
    )
    out = build_datasets(cfg)
    assert isinstance(out.train, BlendedDataset) and out.test is None
    assert (
        len(out.train)
        >= train_iters(cfg.training, cfg.model.seq_length) * cfg.training.global_batch_size
    )
    assert len(list((tmp_path / "idx").glob("gpt-train-*"))) == 2  # the cache was written
    # the valid split is all of b: its samples are b's own windows
    whole_b = GPTDataset(Sequences.of(IndexedDataset(b)), 0, len(IndexedDataset(b)), 16, 1234, 16)
    assert all(np.array_equal(out.valid[i], whole_b[i]) for i in range(len(out.valid)))
    for extra, message in (
        (["--data-path", a], "not both"),
        (["--train-data-path", "0", a], "--train-data-path weight 0"),
    ):
        with pytest.raises(MegaliteError, match=message):
            build_datasets(parse_args([*argv, *extra]))
    no_train = ["--valid-data-path", b, "--tokenizer-model", model]
    with pytest.raises(MegaliteError, match="training needs --train-data-path"):
        build_datasets(parse_args(no_train))
    eval_only = build_datasets(parse_args([*no_train, "--eval-only"]))
    assert eval_only.train is None and len(eval_only.valid) > 0
    with pytest.raises(MegaliteError, match="--eval-only .* needs --valid-data-path"):
        build_datasets(parse_args(["--train-data-path", a, "--tokenizer-model", model,
                                   "--eval-only"]))  # fmt: skip
