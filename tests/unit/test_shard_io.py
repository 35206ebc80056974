"""A trainer's shard written by shard_io: the same file and index entries as writing.write_shard,
whatever the ranges it is handed to the disk in."""

import pytest
import torch

from megalite.checkpoint import format as fmt
from megalite.checkpoint import shard_io, writing


def test_the_same_bytes_entries_and_checksum_as_write_shard(tmp_path, monkeypatch):
    monkeypatch.setattr(shard_io, "CHUNK", 1000)  # many ranges, a tensor cut across them
    tensors = {
        "w": (torch.randn(300, 7), [(0, 300), (0, 7)], [600, 7]),
        "v#1": (torch.arange(9), [(3, 12)], [12]),
        "h": (torch.ones(5, dtype=torch.bfloat16), [(0, 5)], [5]),
        "pad": (torch.zeros(0, 4), [(10, 10), (0, 4)], [10, 4]),  # all padding: left out
    }
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    want = writing.write_shard(tmp_path / "a", "s.safetensors", tensors)
    got = shard_io.write_shard(tmp_path / "b", "s.safetensors", tensors)
    assert got == want
    assert (tmp_path / "a/s.safetensors").read_bytes() == (
        tmp_path / "b/s.safetensors"
    ).read_bytes()
    ckpt_read = fmt.Checkpoint.__new__(fmt.Checkpoint)  # read back through the format's reader
    ckpt_read.dir, ckpt_read.tensors, ckpt_read._open = tmp_path / "b", got[0], {}
    assert torch.equal(ckpt_read.read("w", [(0, 300), (0, 7)]), tensors["w"][0])


def test_a_failed_write_raises_after_the_hashing_thread_ends(tmp_path):
    with pytest.raises(OSError):
        shard_io.write_shard(tmp_path / "missing", "s.safetensors",
                             {"w": (torch.ones(4), [(0, 4)], [4])})  # fmt: skip
