"""Megatron-LM's sample order as pure functions over index arrays (no files, no torch).

megalite draws its samples in the order megatron-core's GPTDataset and BlendedDataset do, so a
run moved from Megatron sees the same tokens at every step. Written from the algorithm:

* A split exposes the sequences `indices` (a contiguous range of the indexed dataset). A
  dataset asked for `num_samples` samples of `seq_length + 1` tokens takes as many epochs of
  those sequences as the samples need (`num_epochs`).
* The document index is the epochs' sequence ids, shuffled by `numpy.random.RandomState(seed)`.
  When the last epoch would contribute fewer than 80% of an epoch's samples, it is shuffled on
  its own (`separate_last_epoch`), so the few samples drawn from it are not biased to the
  documents that the whole-run shuffle happened to put last.
* The documents of the document index, one after another, form a token stream; sample j is
  stream tokens [j*seq, j*seq + seq + 1) (consecutive samples share one token, the last label
  of one is the first input of the next; the tail short of a sample is dropped). The sample
  index holds each sample boundary as (position in the document index, token offset).
* The shuffle index permutes the samples with the same RandomState, drawn after the document
  index; with a separate last epoch, the samples of the earlier epochs and those that need the
  last epoch are shuffled apart.
* A blend of datasets with (normalised) weights puts sample i on the dataset furthest behind its
  share (`blending_indices`), each dataset's samples taken in its own order.
"""

import math

import numpy as np

LAST_EPOCH_SHARE = 0.80  # below this share of an epoch, the last epoch is shuffled apart
BLEND_SURPLUS = 0.005  # Megatron's mid_level_dataset_surplus: the parts of a blend build 0.5% more


def samples_in(num_tokens: int, seq_length: int) -> int:
    """Samples of seq_length + 1 tokens (sharing one token) in a stream of num_tokens."""
    return max(0, (num_tokens - 1) // seq_length)


def num_epochs(tokens_per_epoch: int, num_samples: int | None, seq_length: int) -> int:
    """Epochs of the exposed sequences needed for num_samples samples (None: one epoch)."""
    if num_samples is None:
        return 1
    needed = num_samples * seq_length + 1
    return max(1, -(-needed // tokens_per_epoch))  # ceil


def separate_last_epoch(
    tokens_per_epoch: int, epochs: int, num_samples: int | None, seq_length: int
) -> bool:
    """Whether the last epoch is shuffled on its own: it gives < 80% of an epoch's samples."""
    if epochs == 1:
        return False
    before_last = samples_in((epochs - 1) * tokens_per_epoch, seq_length)
    per_epoch = samples_in(tokens_per_epoch, seq_length)
    return num_samples - before_last < int(LAST_EPOCH_SHARE * per_epoch)


def document_index(
    indices: np.ndarray, epochs: int, separate_last: bool, rs: np.random.RandomState
) -> np.ndarray:
    """The sequence ids of `epochs` epochs of `indices`, shuffled (int32)."""
    if separate_last and epochs > 1:
        first = document_index(indices, epochs - 1, False, rs)
        return np.concatenate([first, document_index(indices, 1, False, rs)])
    out = np.tile(np.asarray(indices, dtype=np.int32), epochs)
    rs.shuffle(out)
    return out


def sample_index(
    lengths: np.ndarray, doc_index: np.ndarray, seq_length: int, num_samples: int
) -> np.ndarray:
    """(num_samples + 1, 2) int32 (int64 when needed): sample boundary k is stream token k*seq as (position in
    doc_index, offset in that document). A boundary at a document's first token is written as
    that document at offset 0; empty documents never hold one."""
    ends = np.cumsum(lengths[doc_index], dtype=np.int64)  # stream end of each document
    bounds = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    pos = np.searchsorted(ends, bounds, side="right")  # the document holding token `bound`
    starts = ends[pos] - lengths[doc_index[pos]]
    out = np.stack([pos, bounds - starts], axis=1)
    small = max(len(doc_index), int(lengths.max())) <= np.iinfo(np.int32).max
    return out.astype(np.int32) if small else out  # half the memory when the values fit


def shuffle_index(num_first: int, total: int, rs: np.random.RandomState) -> np.ndarray:
    """[0, num_first) shuffled, then [num_first, total) shuffled on its own."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_first, dtype=dtype)
    rs.shuffle(first)
    if num_first == total:
        return first
    last = np.arange(num_first, total, dtype=dtype)
    rs.shuffle(last)
    return np.concatenate([first, last])


def build_gpt_indices(
    lengths: np.ndarray, indices: np.ndarray, num_samples: int | None, seq_length: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document index, sample index, shuffle index) of a split exposing sequences `indices`
    (`lengths`: every sequence's length in tokens) asked for num_samples samples (None: one
    epoch). The dataset holds len(sample index) - 1 >= num_samples samples: whole epochs."""
    tokens_per_epoch = int(np.sum(lengths[indices], dtype=np.int64))
    if tokens_per_epoch <= seq_length:
        raise ValueError(f"{tokens_per_epoch} tokens hold no sample of {seq_length + 1}")
    epochs = num_epochs(tokens_per_epoch, num_samples, seq_length)
    separate = separate_last_epoch(tokens_per_epoch, epochs, num_samples, seq_length)
    rs = np.random.RandomState(seed)
    doc_index = document_index(indices, epochs, separate, rs)
    total = samples_in(epochs * tokens_per_epoch, seq_length)
    samples = sample_index(lengths, doc_index, seq_length, total)
    first = samples_in((epochs - 1) * tokens_per_epoch, seq_length) if separate else total
    return doc_index, samples, shuffle_index(first, total, rs)


def sample_pieces(
    doc_index: np.ndarray, samples: np.ndarray, lengths: np.ndarray, j: int
) -> list[tuple[int, int, int]]:
    """Sample j (an unshuffled id) as (sequence id, start, stop) token ranges, seq + 1 tokens."""
    (p0, o0), (p1, o1) = samples[j], samples[j + 1]
    pieces = []
    for p in range(int(p0), int(p1) + 1):
        seq_id = int(doc_index[p])
        start = int(o0) if p == p0 else 0
        stop = int(o1) + 1 if p == p1 else int(lengths[seq_id])  # +1: the shared last token
        pieces.append((seq_id, start, stop))
    return pieces


def blend_sizes(weights: list[float], size: int) -> tuple[list[int], list[int]]:
    """(samples each part gives the blend, samples each part builds) for a blend of `size`
    with normalised weights: ceil(size * w), and that plus the surplus, rounded up."""
    target = [math.ceil(size * w) for w in weights]
    return target, [math.ceil(t * (1 + BLEND_SURPLUS)) for t in target]


def normalise(weights) -> list[float]:
    w = np.asarray(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def blending_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset of each blend sample int16, that dataset's sample id int64): sample i goes to
    the dataset whose count lags its share w * max(i, 1) most (the first such on a tie)."""
    dataset = np.empty(size, dtype=np.int16)
    local = np.empty(size, dtype=np.int64)
    counts = [0] * len(weights)
    w = [float(x) for x in weights]
    ks = range(len(w))
    for i in range(size):
        x = float(max(i, 1))
        best, best_error = 0, w[0] * x - counts[0]
        for k in ks:
            error = w[k] * x - counts[k]
            if error > best_error:
                best, best_error = k, error
        dataset[i], local[i] = best, counts[best]
        counts[best] += 1
    return dataset, local
