"""The index build at scale: streamed to the cache in memory near the indices' own size, blocks
that agree with megatron-core's helper wherever they are cut, the default cache beside the data,
progress lines for long builds."""

import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from megalite.data import gpt_dataset
from megalite.data import sample_order as order
from megalite.data.gpt_dataset import GPTDataset, Sequences
from tests.unit.test_data_megatron_order import data, megalite_datasets, training  # noqa: F401


def sequences(lengths: np.ndarray) -> Sequences:
    """What the build reads of a dataset: the lengths (the tokens are never read by it)."""
    offsets = np.zeros(len(lengths), np.int64)
    np.cumsum(lengths[:-1], out=offsets[1:])
    return Sequences(lengths.astype(np.int32), offsets, np.zeros(0, np.uint16))


def test_build_memory_stays_near_the_index_size(tmp_path):
    # 10^7 samples: 120 MB of indices. Built in memory and saved, the sample index alone peaked
    # at ~50 bytes per sample (int64 temporaries); streamed, the peak is the larger of the
    # document and shuffle indices (a quarter of the bytes each) plus a few blocks: 0.33x here;
    # holding both at once (the build with a shuffle-index thread) peaked at 0.45x.
    lengths = np.random.default_rng(0).integers(1, 800, 200_000)
    seqs, samples, seq = sequences(lengths), 10_000_000, 16
    tracemalloc.start()
    try:
        ds = GPTDataset(seqs, 0, len(lengths), seq, 7, samples, str(tmp_path), "gpt-train")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    arrays = (ds.document_index, ds.sample_index, ds.shuffle_index)
    index_bytes = sum(a.nbytes for a in arrays)
    assert len(ds) >= samples and index_bytes > 100e6
    assert peak < 0.4 * index_bytes, f"peak {peak / 1e6:.0f} MB for {index_bytes / 1e6:.0f} MB"
    assert all(isinstance(a, np.memmap) for a in arrays)  # read from the cache's files
    # the same arrays as megatron-core's helper (the blocks joined where they were cut)
    from megatron.core.datasets import helpers

    tokens = int(lengths.sum())
    epochs = order.num_epochs(tokens, samples, seq)
    want = helpers.build_sample_idx(seqs.lengths, np.asarray(ds.document_index), seq, epochs,
                                    tokens, True, True)  # fmt: skip
    assert np.array_equal(ds.sample_index, want)


@pytest.mark.parametrize("block", [1, 3, 64])
def test_sample_index_blocks_equal_megatrons_helper(block):
    from megatron.core.datasets import helpers

    rng = np.random.default_rng(block)
    lengths = rng.integers(0, 30, 200).astype(np.int32)
    lengths[:5] = 0  # empty documents never hold a boundary
    lengths[7] = 500  # one document holding many blocks' boundaries
    doc_index = np.tile(np.arange(200, dtype=np.int32), 2)
    rng.shuffle(doc_index)
    tokens, seq = int(lengths.sum()), 7
    num_samples = order.samples_in(2 * tokens, seq)
    blocks = list(order.sample_index_blocks(lengths, doc_index, seq, num_samples, block))
    assert all(len(b) <= block for b in blocks)
    want = helpers.build_sample_idx(lengths, doc_index, seq, 2, tokens, True, True)
    assert np.array_equal(np.concatenate(blocks), want)


def test_default_cache_is_beside_the_data(data, monkeypatch, tmp_path):  # noqa: F811
    spec = dict(data_path=["a"], split="80,15,5")
    cached = megalite_datasets(data, monkeypatch, training(20), **spec)
    beside = Path(data["a"][1]).parent / gpt_dataset.INDEX_CACHE
    splits = sorted(p.name.split("-")[1] for p in beside.iterdir() if p.is_dir())
    assert splits == ["test", "train", "valid"]
    assert isinstance(cached.train.sample_index, np.memmap)
    # an unwritable data directory: under --data-cache-dir instead
    monkeypatch.setattr(gpt_dataset.os, "access", lambda path, mode: False)
    monkeypatch.chdir(tmp_path)  # --data-cache-dir is relative: the run's directory
    other = megalite_datasets(data, monkeypatch, training(20, seed=2), **spec)
    assert len(list((tmp_path / "data_cache" / gpt_dataset.INDEX_CACHE).iterdir())) >= 3
    assert len(other.train) == len(cached.train)


def test_long_builds_print_progress(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpt_dataset, "PROGRESS_S", -1.0)  # every block is "long"
    monkeypatch.setattr(order, "BLOCK", 1000)
    lengths = np.random.default_rng(1).integers(1, 50, 1000)
    GPTDataset(sequences(lengths), 0, 1000, 8, 3, 5000, str(tmp_path), "gpt-train")
    err = capsys.readouterr().err.splitlines()
    assert any("gpt-train sample index 100% (" in line for line in err), err
    assert "megalite: built the gpt-train sample order" in err[-1]
