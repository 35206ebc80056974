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
  share (`blending_indices`, its loop in C: blend_native), each dataset's samples taken in its
  own order.
"""

import math
import mmap
import sys
from typing import NamedTuple

import numpy as np

from megalite.data import blend_native

LAST_EPOCH_SHARE = 0.80  # below this share of an epoch, the last epoch is shuffled apart
BLEND_SURPLUS = 0.005  # Megatron's mid_level_dataset_surplus: the parts of a blend build 0.5% more
BLOCK = 1 << 18  # rows per sample-index block: 2 MB int64 temporaries, cache-sized


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
    """The sequence ids of `epochs` epochs of `indices`, shuffled (int32). Filled and shuffled in
    place (a separate last epoch is a view shuffled after the others): the result is the only
    allocation, where tiling and concatenating would hold it two or three times."""
    n = len(indices)
    out = np.empty(epochs * n, dtype=np.int32)
    out.reshape(epochs, n)[:] = indices
    start = 0
    for size in document_shuffles(n, epochs, separate_last):
        rs.shuffle(out[start : start + size])  # a view's shuffle draws what the copy's would
        start += size
    return out


def document_shuffles(n: int, epochs: int, separate_last: bool) -> list[int]:
    """The sizes of the document index's shuffles, in order: all epochs, or all but the last
    and then the last on its own."""
    return [(epochs - 1) * n, n] if separate_last and epochs > 1 else [epochs * n]


def sample_index_dtype(lengths: np.ndarray, doc_index: np.ndarray) -> np.dtype:
    """int32 when every position and offset fits (Megatron's rule), else int64."""
    small = max(len(doc_index), int(lengths.max())) <= np.iinfo(np.int32).max
    return np.dtype(np.int32 if small else np.int64)


def sample_index_blocks(
    lengths: np.ndarray, doc_index: np.ndarray, seq_length: int, num_samples: int, block=None
):
    """The sample index (see `sample_index`) as consecutive blocks of at most `block` rows, built
    from `block` documents at a time: memory stays a few blocks whatever the sizes, so a caller
    can write each block out and never hold the whole index.

    Boundary k is stream token k*seq. With `ends` the stream end of each document of the block,
    c[p] = ceil(ends[p] / seq) counts the boundaries before document p's end, so document p holds
    boundaries [c[p-1], c[p]) (none when it is empty): positions are a `repeat` of the document
    ids by those counts, offsets k*seq minus the document's start."""
    block = block or BLOCK
    dtype = sample_index_dtype(lengths, doc_index)
    want = num_samples + 1  # boundaries 0..num_samples
    done, before = 0, 0  # boundaries given so far; stream tokens before document `a`
    for a in range(0, len(doc_index), block):
        if done == want:
            break
        sizes = lengths[doc_index[a : a + block]].astype(np.int64)  # (n,)
        ends = np.cumsum(sizes)
        ends += before
        c = np.minimum((ends + (seq_length - 1)) // seq_length, want)  # (n,)
        starts, stop = ends - sizes, int(c[-1])
        for k0 in range(done, stop, block):
            k1 = min(k0 + block, stop)
            p0 = int(np.searchsorted(c, k0, side="right"))  # the document holding boundary k0
            p1 = int(np.searchsorted(c, k1 - 1, side="right"))
            counts = np.diff(np.clip(c[p0 : p1 + 1], k0, k1), prepend=k0)
            pos = np.repeat(np.arange(p0, p1 + 1), counts)  # (k1 - k0,) within the block
            out = np.empty((k1 - k0, 2), dtype)
            out[:, 0] = pos + a
            out[:, 1] = np.arange(k0, k1, dtype=np.int64) * seq_length - starts[pos]
            yield out
        done, before = stop, int(ends[-1])
    if done != want:
        raise ValueError(f"the documents hold {done - 1} samples, not {num_samples}")


def sample_index(
    lengths: np.ndarray, doc_index: np.ndarray, seq_length: int, num_samples: int
) -> np.ndarray:
    """(num_samples + 1, 2) int32 (int64 when needed): sample boundary k is stream token k*seq
    as (position in doc_index, offset in that document). A boundary at a document's first token
    is written as that document at offset 0; empty documents never hold one."""
    return np.concatenate(list(sample_index_blocks(lengths, doc_index, seq_length, num_samples)))


def shuffle_index(num_first: int, total: int, rs: np.random.RandomState) -> np.ndarray:
    """[0, num_first) shuffled, then [num_first, total) shuffled on its own (in place: views of
    one array, no concatenation)."""
    out = np.arange(total, dtype=shuffle_index_dtype(total))
    rs.shuffle(out[:num_first])
    if num_first < total:
        rs.shuffle(out[num_first:])
    return out


def shuffle_index_dtype(total: int) -> np.dtype:
    return np.dtype(np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64)


class Plan(NamedTuple):
    """How a split's indices are sized: epochs, whether the last is shuffled apart, the samples
    of all epochs (`total`) and of those shuffled together (`first`)."""

    epochs: int
    separate_last: bool
    total: int
    first: int


def plan(tokens_per_epoch: int, num_samples: int | None, seq_length: int) -> Plan:
    """The Plan of a split of `tokens_per_epoch` tokens asked for num_samples samples (None: one
    epoch). The dataset holds `total` >= num_samples samples: whole epochs."""
    if tokens_per_epoch <= seq_length:
        raise ValueError(f"{tokens_per_epoch} tokens hold no sample of {seq_length + 1}")
    epochs = num_epochs(tokens_per_epoch, num_samples, seq_length)
    separate = separate_last_epoch(tokens_per_epoch, epochs, num_samples, seq_length)
    total = samples_in(epochs * tokens_per_epoch, seq_length)
    first = samples_in((epochs - 1) * tokens_per_epoch, seq_length) if separate else total
    return Plan(epochs, separate, total, first)


def gpt_indices(
    lengths: np.ndarray, indices: np.ndarray, num_samples: int | None, seq_length: int, seed: int
):
    """The document, sample and shuffle indices of a split exposing sequences `indices`
    (`lengths`: every sequence's length in tokens) asked for num_samples samples (None: one
    epoch), one after another as (name, shape, dtype, blocks): `blocks` are consecutive pieces of
    the array, to be consumed before the next item is asked for. A consumer that writes each
    block out holds the document index and a few sample-index blocks, then the shuffle index
    alone: the peak is about the larger of the two int32 arrays.

    Both shuffles draw from one RandomState(seed), the document index's first, as Megatron's do.
    One after the other, in this thread: numpy's legacy shuffle holds the GIL, so a second
    thread would wait, and a second process (its generator advanced past the document
    shuffles' draws) took more CPU and more time on two loaded cores, the two shuffles
    contending for memory (tried at 10^8 samples: 26-31 s against 17-25 s)."""
    p = plan(int(np.sum(lengths[indices], dtype=np.int64)), num_samples, seq_length)
    rs = np.random.RandomState(seed)
    doc_index = document_index(indices, p.epochs, p.separate_last, rs)
    yield "document_index", doc_index.shape, doc_index.dtype, [doc_index]
    dtype = sample_index_dtype(lengths, doc_index)
    blocks = sample_index_blocks(lengths, doc_index, seq_length, p.total)
    del doc_index  # the blocks keep it until they are read
    yield "sample_index", (p.total + 1, 2), dtype, blocks
    del blocks
    out = shuffle_index(p.first, p.total, rs)
    yield "shuffle_index", out.shape, out.dtype, [out]


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
    the dataset whose count lags its share w * max(i, 1) most (the first such on a tie), in
    IEEE double as megatron-core's helper computes it. Each pick depends on every count before
    it, so no numpy expression gives it: the loop is C (blend_native), a few ns a sample;
    without a C compiler, Python (0.4-0.8 µs a sample), said once."""
    ds, local = _populated(size, np.int16), _populated(size, np.int64)
    _blend_into(np.asarray(weights, dtype=np.float64), np.zeros(len(weights)), 0, ds, local)
    return ds, local


def _populated(size: int, dtype) -> np.ndarray:
    """np.empty, its pages mapped at once (MAP_POPULATE) where the OS can: one call instead of a
    page fault for every 4 KiB written, 3-5x less time to make 1 GB of fresh memory here."""
    nbytes = size * np.dtype(dtype).itemsize
    flags = getattr(mmap, "MAP_POPULATE", 0)
    if not flags or nbytes < 1 << 20:
        return np.empty(size, dtype=dtype)
    try:
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | flags)
    except OSError:
        return np.empty(size, dtype=dtype)
    return np.frombuffer(buf, dtype=dtype)  # the array keeps the mapping; unmapped with it


def blending_blocks(weights: list[float], size: int, block: int = 1 << 20):
    """blending_indices as consecutive (dataset, sample id) blocks of `block` samples: the
    whole arrays are never in memory."""
    w, counts = np.asarray(weights, dtype=np.float64), np.zeros(len(weights))
    for start in range(0, size, block):
        n = min(block, size - start)
        ds, local = np.empty(n, dtype=np.int16), np.empty(n, dtype=np.int64)
        _blend_into(w, counts, start, ds, local)
        yield ds, local


def _blend_into(w: np.ndarray, counts: np.ndarray, start: int, ds, local) -> None:
    """Samples [start, start + len(ds)) of the blend into ds and local; `counts` (float64, each
    dataset's samples before `start`) advanced past them."""
    fn, why = blend_native.load()
    if fn is not None:
        blend_native.blend_into(fn, w, counts, start, ds, local)
        return
    if len(ds) >= SLOW_NOTICE and not _told:
        _told.append(why)
        print(f"megalite: {why}: the blend index is built by a Python loop (~0.5 µs a sample, "
              "seconds per million); install a C compiler (or set CC) for the compiled one",
              file=sys.stderr)  # fmt: skip
    c, wl = [int(x) for x in counts], w.tolist()
    ks = range(len(wl))
    for j in range(len(ds)):
        x = float(max(start + j, 1))
        best, best_error = 0, wl[0] * x - c[0]
        for k in ks:
            error = wl[k] * x - c[k]
            if error > best_error:
                best, best_error = k, error
        ds[j], local[j] = best, c[best]
        c[best] += 1
    counts[:] = c


SLOW_NOTICE = 1 << 20  # samples from which the Python loop's slowness is worth a line
_told: list = []
