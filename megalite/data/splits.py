"""Which data each split draws from: --split shares, --data-path blends, per-split paths, and
the number of samples each split is built for (Megatron's rule)."""

import math
from dataclasses import dataclass

import numpy as np

from megalite.errors import MegaliteError
from megalite.lr_schedule import train_iters

SPLIT_NAMES = ("train", "valid", "test")


@dataclass(frozen=True)
class Blend:
    """The prefixes of one split, their weights (None: by size), and whether each is used
    whole (a per-split path) rather than cut by --split."""

    prefixes: list[str]
    weights: list[float] | None
    whole: bool = False


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


def parse_data_path(
    data_path: list[str], flag: str = "--data-path"
) -> tuple[list[float] | None, list[str]]:
    """['0.7', 'a', '0.3', 'b'] -> ([0.7, 0.3], ['a', 'b']); ['a', 'b'] -> (None, ['a', 'b']).
    `flag` names the option in errors."""

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
            f"{flag} {' '.join(data_path)} mixes weights and prefixes; give pairs like "
            "0.7 PREFIX_A 0.3 PREFIX_B, or prefixes only"
        )
    values = [number(w) for w in weights]
    for w, v in zip(weights, values):
        if v is None or not math.isfinite(v) or v <= 0:
            raise MegaliteError(f"{flag} weight {w} must be a positive number")
    return values, list(prefixes)


def split_sequences(num_sequences: int, fractions: list[float]) -> list[tuple[int, int]]:
    """Sequence ranges [start, stop) of train, valid, test: Megatron's bookends, each cumulative
    share times num_sequences rounded; a split with a share but no sequence takes one from the
    largest (when it can spare it), where Megatron would have an empty split it cannot use."""
    sizes = [round(sum(fractions[: k + 1]) * num_sequences) for k in range(3)]
    sizes = [b - a for a, b in zip([0] + sizes, sizes)]
    sizes[0] += num_sequences - sum(sizes)
    for k in range(3):
        largest = max(range(3), key=lambda j: sizes[j])
        if fractions[k] > 0 and sizes[k] == 0 and sizes[largest] > 1:
            sizes[k], sizes[largest] = 1, sizes[largest] - 1
    bounds = np.cumsum([0] + sizes).tolist()
    return [(bounds[k], bounds[k + 1]) for k in range(3)]


def split_sizes(training, seq_length: int | None = None) -> list[int]:
    """Samples each split is built for, as Megatron sizes them: train_iters * G for training,
    enough validation for every evaluation (train_iters // eval_interval + 1 of eval_iters
    batches; one with --eval-interval 0) and eval_iters batches of test."""
    g, t, iters = training.global_batch_size, training, train_iters(training, seq_length)
    evaluations = iters // t.eval_interval + 1 if t.eval_interval > 0 else 1
    return [iters * g, evaluations * t.eval_iters * g, t.eval_iters * g]


def split_blends(data, eval_only: bool) -> tuple[list[Blend | None], list[float] | None]:
    """(each split's Blend or None, the --split fractions or None) from a DataConfig: one
    --data-path cut by --split, or --train/valid/test-data-path each used whole."""
    per_split = [data.train_data_path, data.valid_data_path, data.test_data_path]
    if any(per_split):
        if data.data_path:
            raise MegaliteError(
                "give either --data-path (cut by --split) or --train-data-path/--valid-data-path"
                "/--test-data-path, not both"
            )
        need = 1 if eval_only else 0
        if not per_split[need]:
            flag = "--valid-data-path" if eval_only else "--train-data-path"
            what = "--eval-only evaluates on the validation data" if eval_only else "training"
            raise MegaliteError(f"{what} needs {flag} when the splits have their own paths")
        flags = ("--train-data-path", "--valid-data-path", "--test-data-path")
        blends = [Blend(*reversed(parse_data_path(p, f)), whole=True) if p else None
                  for p, f in zip(per_split, flags)]  # fmt: skip
        return blends, None
    fractions = parse_split(data.split, eval_only)
    weights, prefixes = parse_data_path(data.data_path) if data.data_path else (None, [])
    return [Blend(prefixes, weights) if f > 0 else None for f in fractions], fractions
