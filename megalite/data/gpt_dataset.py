"""GPT training samples from indexed datasets: splits, shuffling, blending, and the entry point.

Sample scheme (the simplest that wastes no tokens): a split's documents are one token stream
(EOS after each document), and sample j is tokens [j*seq, j*seq + seq + 1) of that stream, so
consecutive samples overlap by one token (the last label of one is the first input of the next)
and samples cross document boundaries. A split has (tokens - 1) // seq samples; the tail is
left out. Sample i of a `GPTDataset` is sample perm[i] for a fixed permutation drawn from the
seed, so any prefix of the dataset is a random subset (which blending relies on).

Splits (`--split 98,2,0`) are by documents: the first 98% of documents train, the next 2%
validate, the rest test, so no text is shared between splits. Shares are rounded to whole
documents, and a split with a non-zero share gets at least one document when there are enough.

Blending (`--data-path 0.7 a 0.3 b`, Megatron style): an epoch of the blend has as many
samples as its parts together, and the share of dataset k is its normalised weight; a part
given more than it holds repeats (in its own shuffled order), one given less contributes a
random subset. The parts are interleaved evenly, so every prefix of the blend keeps the
proportions to within two samples per dataset. Without weights (`--data-path a b`) each dataset
weighs its size: one epoch is every sample once.
"""

import fcntl
import math
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path

import numpy as np

from megalite.data import corpus
from megalite.data.indexed_dataset import IndexedDataset, build_indexed_dataset
from megalite.data.tokenizer import HFTokenizer, Tokenizer, load_tokenizer
from megalite.errors import MegaliteError

SPLIT_NAMES = ("train", "valid", "test")


class GPTDataset:
    """The samples of documents [doc_start, doc_stop) of an indexed dataset, shuffled by seed."""

    def __init__(
        self, indexed: IndexedDataset, doc_start: int, doc_stop: int, seq_length: int, seed
    ):
        self.indexed, self.seq_length = indexed, seq_length
        self.start = int(indexed.doc_offsets[doc_start])
        num_tokens = int(indexed.doc_offsets[doc_stop]) - self.start
        self.num_samples = max(0, (num_tokens - 1) // seq_length)
        self.perm = np.random.default_rng(seed).permutation(self.num_samples)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range [0, {self.num_samples})")
        s = self.start + int(self.perm[i]) * self.seq_length
        return np.asarray(self.indexed.tokens[s : s + self.seq_length + 1], dtype=np.int64)


class BlendedDataset:
    """Datasets mixed by weight; see the module docstring for the epoch and its proportions."""

    def __init__(self, datasets: list, weights: list[float]):
        self.datasets = datasets
        sizes = [len(d) for d in datasets]
        total = sum(sizes)
        w = np.asarray(weights, dtype=np.float64) / sum(weights)
        # Largest-remainder rounding: the counts add up to exactly `total`.
        exact = w * total
        counts = np.floor(exact).astype(np.int64)
        counts[np.argsort(-(exact - counts), kind="stable")[: total - counts.sum()]] += 1
        self.counts = counts
        # Place the j-th of dataset k's n_k samples at time (j + 0.5) / n_k and sort by time:
        # an even interleave computed without a Python loop over the samples.
        ks = np.repeat(np.arange(len(datasets)), counts)
        js = np.concatenate([np.arange(n) for n in counts])
        order = np.lexsort((ks, (js + 0.5) / counts[ks]))
        self.dataset_index, self.sample_index = ks[order], js[order]

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int) -> np.ndarray:
        ds = self.datasets[self.dataset_index[i]]
        return ds[int(self.sample_index[i]) % len(ds)]


@dataclass
class Datasets:
    """What the trainer needs; a split is None when its share of --split is 0 (`train` only
    with --eval-only)."""

    train: GPTDataset | BlendedDataset | None
    valid: GPTDataset | BlendedDataset | None
    tokenizer: Tokenizer | HFTokenizer
    test: GPTDataset | BlendedDataset | None = None


def parse_split(split: str, eval_only: bool = False) -> list[float]:
    """'98,2,0' (or '98/2/0', or fewer values) -> three fractions summing to 1. Training needs
    a training share; --eval-only (`eval_only`) needs none, only a validation share."""
    try:
        parts = [float(x) for x in split.replace("/", ",").split(",")]
    except ValueError:
        parts = []
    if not 1 <= len(parts) <= 3 or any(not math.isfinite(p) or p < 0 for p in parts):
        raise MegaliteError(
            f"--split {split!r} must be up to three non-negative numbers like 98,2,0"
        )
    parts += [0.0] * (3 - len(parts))
    if eval_only and parts[1] <= 0:
        raise MegaliteError(
            f"--eval-only evaluates on the validation split, but --split {split!r} gives it no "
            "data; make the second share > 0 (e.g. 0,100,0)"
        )
    if not eval_only and parts[0] <= 0:
        raise MegaliteError(f"--split {split!r} gives training no data; make the first share > 0")
    return [p / sum(parts) for p in parts]


def parse_data_path(data_path: list[str]) -> tuple[list[float] | None, list[str]]:
    """['0.7', 'a', '0.3', 'b'] -> ([0.7, 0.3], ['a', 'b']); ['a', 'b'] -> (None, ['a', 'b'])."""

    def number(s):
        try:
            return float(s)
        except ValueError:
            return None

    if number(data_path[0]) is None:
        return None, list(data_path)
    weights, prefixes = data_path[0::2], data_path[1::2]
    if len(data_path) % 2 or any(number(p) is not None for p in prefixes):
        raise MegaliteError(
            f"--data-path {' '.join(data_path)} mixes weights and prefixes; give pairs like "
            "0.7 PREFIX_A 0.3 PREFIX_B, or prefixes only"
        )
    values = [number(w) for w in weights]
    for w, v in zip(weights, values):
        if v is None or not math.isfinite(v) or v <= 0:
            raise MegaliteError(f"--data-path weight {w} must be a positive number")
    return values, list(prefixes)


def split_documents(num_docs: int, fractions: list[float]) -> list[tuple[int, int]]:
    """Document ranges [start, stop) of train, valid, test: shares rounded to whole documents,
    and a split with a share but no document takes one from the largest (when it can spare it).
    """
    sizes = [round(sum(fractions[: k + 1]) * num_docs) for k in range(3)]
    sizes = [b - a for a, b in zip([0] + sizes, sizes)]
    sizes[0] += num_docs - sum(sizes)
    for k in range(3):
        largest = max(range(3), key=lambda j: sizes[j])
        if fractions[k] > 0 and sizes[k] == 0 and sizes[largest] > 1:
            sizes[k], sizes[largest] = 1, sizes[largest] - 1
    bounds = np.cumsum([0] + sizes).tolist()
    return [(bounds[k], bounds[k + 1]) for k in range(3)]


def build_datasets(cfg) -> Datasets:
    """Train/valid(/test) datasets and the tokenizer for a `megalite.config.Config`.

    With `cfg.data.data_path` empty, the built-in corpus is prepared once under
    `cfg.data.data_cache_dir` (safe when every rank calls this at the same time). cfg is not
    changed: the model's vocabulary is the tokenizer's unless --vocab-size says more
    (`RunShape.with_vocab`).
    """
    d, m = cfg.data, cfg.model
    fractions = parse_split(d.split, cfg.training.eval_only)
    weights, prefixes = parse_data_path(d.data_path) if d.data_path else (None, [])
    if d.tokenizer_model or d.vocab_file or d.merge_file:
        tokenizer = load_tokenizer(d.tokenizer_model, d.tokenizer_type, d.vocab_file, d.merge_file)
        _check_vocab(tokenizer.vocab_size, m, tokenizer.model_path)
    elif d.data_path:
        raise MegaliteError(
            "--data-path needs the tokenizer its datasets were made with; pass --tokenizer-model"
        )
    else:
        # Checked before the (slow, first-time) build: a trained model has exactly this size.
        builtin = "trained for the built-in corpus"
        _check_vocab(d.tokenizer_vocab_size, m, builtin, " (or lower --tokenizer-vocab-size)")
    if not prefixes:
        prefix, model = prepare_builtin(
            d.data_cache_dir, d.tokenizer_vocab_size, d.tokenizer_model, d.tokenizer_type
        )
        prefixes, tokenizer = [prefix], load_tokenizer(model)

    splits = [[] for _ in SPLIT_NAMES]
    for k, prefix in enumerate(prefixes):
        indexed = IndexedDataset(prefix)
        indexed.check_vocab(tokenizer.vocab_size, tokenizer.model_path, tokenizer.fingerprint)
        for s, (start, stop) in enumerate(split_documents(len(indexed), fractions)):
            if fractions[s] == 0:
                continue
            ds = GPTDataset(indexed, start, stop, m.seq_length, seed=(cfg.training.seed, k, s))
            if len(ds) == 0:
                raise MegaliteError(
                    f"the {SPLIT_NAMES[s]} split of {prefix} ({stop - start} of {len(indexed)} "
                    f"documents) has fewer than seq_length+1={m.seq_length + 1} tokens; give it "
                    "a larger share with --split (e.g. 100,0,0 for none), more data or a shorter "
                    "--seq-length"
                )
            splits[s].append(ds)

    def combine(parts):
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0]
        return BlendedDataset(parts, weights or [len(p) for p in parts])

    train, valid, test = map(combine, splits)
    return Datasets(train=train, valid=valid, tokenizer=tokenizer, test=test)


def _check_vocab(tokenizer_vocab: int, model_cfg, what: str, also: str = "") -> None:
    if model_cfg.vocab_size is not None and model_cfg.vocab_size < tokenizer_vocab:
        raise MegaliteError(
            f"tokenizer {what} has {tokenizer_vocab} pieces but --vocab-size is "
            f"{model_cfg.vocab_size}; raise --vocab-size to at least {tokenizer_vocab} or omit "
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
    if tokenizer_model:
        given = load_tokenizer(tokenizer_model, tokenizer_type)  # checked before any build
        tokenizer_model, tok_name = given.model_path, given.file_name  # a directory's file
        tok_key = "tok-" + sha256(Path(tokenizer_model).read_bytes()).hexdigest()[:12]
    v = sys.version_info
    key = f"stdlib-py{v.major}.{v.minor}-c{corpus.CORPUS_VERSION}-{max_bytes >> 10}k-{tok_key}"
    cache = Path(cache_dir)
    final = cache / key
    prefix, model = str(final / "data"), str(final / tok_name)
    if final.is_dir():  # renamed into place only when complete: no lock needed to read it
        return prefix, model
    try:
        cache.mkdir(parents=True, exist_ok=True)
        lock = open(cache / f".{key}.lock", "w")
    except OSError as e:
        raise MegaliteError(
            f"cannot write the data cache {cache} ({e.strerror}); point --data-cache-dir at a "
            "writable directory"
        ) from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if final.is_dir():  # another process built it while we waited
            return prefix, model
        for stale in cache.glob(f".{key}.tmp*"):  # left by a process killed mid-build
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.tmp", dir=cache))
        try:
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
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return prefix, model
