"""GPT training samples from indexed datasets, in Megatron-LM's order, and the entry point.

The order is megatron-core's (`megalite.data.sample_order` has the algorithm): for the same data
prefixes, weights, seed, sequence length and split, sample i of a split is token for token the
sample Megatron's GPTDataset/BlendedDataset give, so global batch i (samples [i*G, (i+1)*G))
matches a Megatron run's. A sample is seq_length + 1 consecutive tokens of the split's shuffled
documents (EOS ends each document), crossing document boundaries.

Splits (`--split 98,2,0`) are by sequences (a megalite document is one sequence): bookends of
the cumulative shares rounded to whole sequences, as Megatron does; a split with a share that
rounds to no sequence takes one from the largest (Megatron cannot use such a split at all).
`--train-data-path/--valid-data-path/--test-data-path` give each split its own prefixes (whole
datasets, no --split).

Each split is sized for the run, as in Megatron: train_iters * G training samples,
(train_iters // eval_interval + 1) * eval_iters * G validation samples (eval_iters * G with
--eval-interval 0) and eval_iters * G test samples; a dataset holds whole epochs, at least that.

Blending (`--data-path 0.7 a 0.3 b`): each part builds ceil(size * w) samples (plus 0.5%) and
the blend interleaves them by Megatron's greedy rule, so every prefix keeps the proportions.
Without weights (`--data-path a b`) each part is one epoch and weighs its size.
"""

import os
import shutil
import sys
import time
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path

import numpy as np

from megalite.data import corpus, index_cache
from megalite.data import sample_order as order
from megalite.data.encode_docs import build_indexed_dataset
from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.splits import SPLIT_NAMES, Blend, split_blends, split_sequences, split_sizes
from megalite.data.tokenizer import HFTokenizer, Tokenizer, load_tokenizer
from megalite.errors import MegaliteError

PROGRESS_S = 10.0  # seconds between progress lines of a long index build
INDEX_CACHE = "megalite_indices"  # the default cache's directory, beside the data


@dataclass(frozen=True)
class Sequences:
    """What the order reads of an indexed dataset (either format): each sequence's length and
    token offset in `tokens`. Megatron's GPTDataset works on sequences, not documents (a
    megalite document is one sequence; a Megatron one may hold several, e.g. sentences)."""

    lengths: np.ndarray  # (num_sequences,) int32
    offsets: np.ndarray  # (num_sequences,) int64, into tokens
    tokens: np.ndarray  # the whole token stream (memory-mapped)

    @classmethod
    def of(cls, indexed: IndexedDataset) -> "Sequences":
        lengths = np.asarray(indexed.sequence_lengths, dtype=np.int32)
        return cls(lengths, np.asarray(indexed.sequence_offsets, np.int64), indexed.tokens)


class GPTDataset:
    """Samples of the sequences [start, stop) of `seqs` in Megatron's order (sample_order),
    at least `num_samples` of them (None: one epoch), arrays cached under `cache_dir`."""

    def __init__(
        self,
        seqs: Sequences,
        start: int,
        stop: int,
        seq_length: int,
        seed: int,
        num_samples: int | None = None,
        cache_dir: str | None = None,
        name: str = "gpt",
    ):
        self.seqs, self.seq_length = seqs, seq_length
        indices = np.arange(start, stop, dtype=np.int32)
        key = {
            "kind": "gpt",
            "sequences": [start, stop, index_cache.fingerprint(seqs.lengths[start:stop])],
            "num_samples": num_samples,
            "seq_length": seq_length,
            "seed": seed,
        }

        def build(directory):
            start = time.monotonic()
            built = order.gpt_indices(seqs.lengths, indices, num_samples, seq_length, seed)
            for array, shape, dtype, blocks in built:
                if array == "sample_index":
                    blocks = _progress(blocks, shape[0] - 1, name, start)
                index_cache.save_blocks(directory, array, shape, dtype, blocks)
            if time.monotonic() - start > PROGRESS_S:
                print(f"megalite: built the {name} sample order in {directory.parent} in "
                      f"{time.monotonic() - start:.0f} s", file=sys.stderr)  # fmt: skip

        arrays = index_cache.cached(cache_dir, name, key, build)
        self.document_index = arrays["document_index"]
        self.sample_index, self.shuffle_index = arrays["sample_index"], arrays["shuffle_index"]

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range [0, {len(self)})")
        j = int(self.shuffle_index[i])
        pieces = order.sample_pieces(self.document_index, self.sample_index, self.seqs.lengths, j)
        tok, offs = self.seqs.tokens, self.seqs.offsets
        parts = [tok[offs[s] + a : offs[s] + b] for s, a, b in pieces]
        return np.concatenate(parts).astype(np.int64)  # (seq_length + 1,)


def _progress(blocks, samples: int, name: str, start: float):
    """`blocks` passed through, with a line on stderr every PROGRESS_S seconds (a log file sees
    a long build move: 10^9 samples take minutes)."""
    done, last = 0, start
    for b in blocks:
        yield b
        done += len(b)
        if time.monotonic() - last > PROGRESS_S:
            last = time.monotonic()
            print(f"megalite: {name} sample index {min(done, samples) / samples:.0%} "
                  f"({min(done, samples):,} of {samples:,} samples, {last - start:.0f} s)",
                  file=sys.stderr)  # fmt: skip


class BlendedDataset:
    """`size` samples of `datasets` mixed by (normalised) weights: Megatron's blending indices."""

    def __init__(self, datasets: list, weights: list[float], size: int, cache_dir=None, name=""):
        self.datasets = datasets
        self.weights = order.normalise(weights)
        key = {"kind": "blend", "weights": self.weights, "size": size}  # all the arrays depend on

        def build(directory):  # a block at a time: the arrays are only ever whole in the files
            blocks = order.blending_blocks(self.weights, size)
            names, dtypes = ("dataset_index", "dataset_sample_index"), (np.int16, np.int64)
            index_cache.save_block_pairs(directory, names, size, dtypes, blocks)

        arrays = index_cache.cached(cache_dir, name or "blend", key, build)
        self.dataset_index = arrays["dataset_index"]
        self.sample_index = arrays["dataset_sample_index"]
        counts = np.bincount(self.dataset_index, minlength=len(datasets))
        for k, (n, d) in enumerate(zip(counts, datasets)):
            if n > len(d):  # the 0.5% surplus did not cover the greedy rule's rounding
                raise MegaliteError(
                    f"the blend takes {n} samples from dataset {k}, which has {len(d)}; give it "
                    "more data or a smaller weight"
                )

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.datasets[self.dataset_index[i]][int(self.sample_index[i])]


@dataclass
class Datasets:
    """What the trainer needs; a split is None when its share of --split is 0 or it has no
    --*-data-path of its own (`train` only with --eval-only)."""

    train: GPTDataset | BlendedDataset | None
    valid: GPTDataset | BlendedDataset | None
    tokenizer: Tokenizer | HFTokenizer
    test: GPTDataset | BlendedDataset | None = None


def build_datasets(cfg, vocab_from: str = "--vocab-size") -> Datasets:
    """Train/valid(/test) datasets and the tokenizer for a `megalite.config.Config`.

    With no data path, the built-in corpus is prepared once under `cfg.data.data_cache_dir`
    (safe when every rank calls this at the same time). The sample-order arrays are built once
    into --data-cache-path, else `default_cache`, and memory-mapped from there. cfg is not
    changed: the model's vocabulary is the tokenizer's unless --vocab-size says more
    (`RunShape.with_vocab`). `vocab_from`: where a given vocabulary size came from (a flag, a
    YAML file's field, a checkpoint), for the message when the tokenizer does not fit in it.
    """
    d, m, t = cfg.data, cfg.model, cfg.training
    blends, fractions = split_blends(d, t.eval_only)
    tokenizer = None
    if d.tokenizer_model or d.vocab_file or d.merge_file:
        tokenizer = load_tokenizer(d.tokenizer_model, d.tokenizer_type, d.vocab_file, d.merge_file)
        _check_vocab(tokenizer.vocab_size, m, tokenizer.model_path, vocab_from)
    elif any(b and b.prefixes for b in blends):
        raise MegaliteError(
            "--data-path needs the tokenizer its datasets were made with; pass --tokenizer-model"
        )
    else:
        # Checked before the (slow, first-time) build: a trained model has exactly this size.
        builtin = "trained for the built-in corpus"
        _check_vocab(d.tokenizer_vocab_size, m, builtin, vocab_from,
                     " (or lower --tokenizer-vocab-size)")  # fmt: skip
    if not any(b and b.prefixes for b in blends):
        # A given tokenizer by its file (GPT-2's BPE from --vocab-file/--merge-file included).
        given = (tokenizer.model_path, None) if tokenizer else (None, None)
        prefix, model = prepare_builtin(d.data_cache_dir, d.tokenizer_vocab_size, *given)
        blends = [b and Blend([prefix], None) for b in blends]
        tokenizer = load_tokenizer(model)

    cache = d.data_cache_path or default_cache(next(b for b in blends if b).prefixes[0],
                                               d.data_cache_dir)  # fmt: skip
    opened = {}

    def sequences(prefix) -> Sequences:
        if prefix not in opened:
            indexed = IndexedDataset(prefix)
            indexed.check_vocab(tokenizer.vocab_size, tokenizer.model_path, tokenizer.fingerprint)
            opened[prefix] = Sequences.of(indexed)
        return opened[prefix]

    def part(s: int, prefix: str, whole: bool, num_samples: int | None) -> GPTDataset:
        seqs = sequences(prefix)
        n = len(seqs.lengths)
        start, stop = (0, n) if whole else split_sequences(n, fractions)[s]
        if int(np.sum(seqs.lengths[start:stop], dtype=np.int64)) <= m.seq_length:
            where = f"{prefix}" if whole else f"the {SPLIT_NAMES[s]} split of {prefix}"
            fix = "" if whole else "a larger share with --split (e.g. 100,0,0 for none), "
            raise MegaliteError(
                f"{where} ({stop - start} of {n} sequences) has fewer than seq_length+1="
                f"{m.seq_length + 1} tokens; give it {fix}more data or a shorter --seq-length"
            )
        return GPTDataset(seqs, start, stop, m.seq_length, t.seed, num_samples,
                          cache, f"gpt-{SPLIT_NAMES[s]}")  # fmt: skip

    def build(s: int, blend: Blend, size: int):
        """Megatron's builder: one prefix alone, weighted parts built with a surplus, or
        unweighted parts of one epoch each, blended by their sizes."""
        name = f"blend-{SPLIT_NAMES[s]}"
        if len(blend.prefixes) == 1 and (blend.weights is None or blend.whole):
            return part(s, blend.prefixes[0], blend.whole, size)
        if blend.weights is not None:
            weights = order.normalise(blend.weights)
            target, built = order.blend_sizes(weights, size)
            parts = [part(s, p, blend.whole, n) for p, n in zip(blend.prefixes, built)]
            return BlendedDataset(parts, weights, sum(target), cache, name)
        parts = [part(s, p, blend.whole, None) for p in blend.prefixes]
        lengths = [len(p) for p in parts]
        return BlendedDataset(parts, lengths, min(size, sum(lengths)), cache, name)

    sizes = split_sizes(t, cfg.model.seq_length)
    train, valid, test = (b and build(s, b, sizes[s]) for s, b in enumerate(blends))
    return Datasets(train=train, valid=valid, tokenizer=tokenizer, test=test)


def default_cache(prefix: str, run_cache: str) -> str:
    """Where the indices are cached without --data-cache-path: beside the data (as Megatron
    does), or under --data-cache-dir (the run's directory by default) when that cannot be
    written. Every rank of a node finds the same place, so one builds and the others wait for
    it and memory-map its files (index_cache.build_once)."""
    beside = Path(prefix).parent / INDEX_CACHE
    probe = beside if beside.is_dir() else beside.parent
    return str(beside if os.access(probe, os.W_OK) else Path(run_cache) / INDEX_CACHE)


def _check_vocab(tokenizer_vocab: int, model_cfg, what: str, source: str, also: str = "") -> None:
    if model_cfg.vocab_size is not None and model_cfg.vocab_size < tokenizer_vocab:
        raise MegaliteError(
            f"tokenizer {what} has {tokenizer_vocab} pieces but {source} is "
            f"{model_cfg.vocab_size}; raise {source} to at least {tokenizer_vocab} or omit "
            f"it{also}"
        )


def prepare_builtin(
    cache_dir: str | os.PathLike,
    vocab_size: int,
    tokenizer_model: str | None = None,
    tokenizer_type: str | None = None,
    max_bytes: int | None = None,
    threads: int | None = None,
) -> tuple[str, str]:
    """The built-in corpus as (dataset prefix, tokenizer file), built once in `cache_dir`.

    `tokenizer_model` (with `tokenizer_type`, as `load_tokenizer` takes them) tokenizes it;
    without one a sentencepiece model of `vocab_size` pieces is trained on it. The returned
    tokenizer file is tokenizer.model or tokenizer.json, so `load_tokenizer` infers its kind.

    Each build goes to a temporary directory renamed into place when complete, under an
    exclusive file lock: concurrent callers wait for the first one and then reuse its result.
    The cache key names the Python version, corpus size and tokenizer, so changing any of them
    builds a new entry beside the old.
    """
    max_bytes = max_bytes or corpus.MAX_CORPUS_BYTES
    tok_key, tok_name = f"sp{vocab_size}", Tokenizer.file_name
    v = sys.version_info
    stem = f"stdlib-py{v.major}.{v.minor}-c{corpus.CORPUS_VERSION}-{max_bytes >> 10}k-"
    if tokenizer_model:
        given = load_tokenizer(tokenizer_model, tokenizer_type)  # checked before any build
        tokenizer_model, tok_name = given.model_path, given.file_name  # a directory's file
        digest = sha256(Path(tokenizer_model).read_bytes()).hexdigest()
        tok_key = "tok-" + digest[:12]
        # the tokenizer trained here before (a restart given its checkpoint's copy): that entry
        trained = Path(cache_dir) / f"{stem}sp{given.vocab_size}"
        if (trained / tok_name).is_file() and (trained / "data.idx").is_file():
            if sha256((trained / tok_name).read_bytes()).hexdigest() == digest:
                return str(trained / "data"), str(trained / tok_name)
    key = stem + tok_key
    final = Path(cache_dir) / key
    prefix, model = str(final / "data"), str(final / tok_name)

    def fill(tmp: Path):
        print(f"megalite: preparing the built-in corpus in {final} (once)", file=sys.stderr)
        jsonl = corpus.build_corpus(tmp, max_bytes)
        if tokenizer_model:
            shutil.copyfile(tokenizer_model, tmp / tok_name)
        else:
            Tokenizer.train([str(jsonl)], tmp / "tokenizer", vocab_size)
        build_indexed_dataset(
            corpus.iter_documents([str(jsonl)]),
            tmp / tok_name,
            tmp / "data",
            threads=threads or min(4, os.cpu_count() or 1),
        )

    index_cache.build_once(final, fill, "--data-cache-dir")
    return prefix, model
