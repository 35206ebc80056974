"""The checkpoint format without processes: regions, shard assembly, and refusing bad input."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from megalite.checkpoint import format as fmt
from megalite.checkpoint import writing
from megalite.checkpoint.format import Checkpoint
from megalite.checkpoint.regions import flat_blocks, piece_blocks
from megalite.errors import MegaliteError
from megalite.model.gpt import VOCAB_TENSORS
from megalite.parallel import specs


def local_region(name, shape, dim, rank, size, vocab):
    """(global shape, region) of rank `rank`'s parameter of local `shape`, as its ParamSpec
    computes them."""
    vocab_dim = 0 if name in VOCAB_TENSORS else None
    p = specs.mark(nn.Parameter(torch.empty(shape)), split_dim=dim, split_size=size,
                   vocab_dim=vocab_dim)  # fmt: skip
    holder = nn.Module()
    holder.register_parameter("w", p)
    specs.name_parameters(holder, vocab)
    s = specs.spec_of(p)
    return list(s.shape), s.region(rank)


def test_local_region_splits_and_unpads():
    # a column-parallel weight (out, in) split along out over tp=2
    assert local_region("layers.0.mlp.up.weight", (64, 32), 0, 1, 2, 500) == (
        [128, 32],
        [(64, 128), (0, 32)],
    )
    # row-parallel: along in
    assert local_region("layers.0.mlp.down.weight", (32, 64), 1, 0, 2, 500)[1] == [(0, 32), (0, 64)]
    # replicated
    assert local_region("final_norm.weight", (32,), None, 1, 2, 500) == ([32], [(0, 32)])
    # vocabulary 500 padded to 512 over tp=2: rank 1 holds rows 256..512, of which 256..500 real
    assert local_region("embedding.word.weight", (256, 32), 0, 1, 2, 500) == (
        [500, 32],
        [(256, 500), (0, 32)],
    )
    # a rank whose whole slice is padding holds an empty region
    assert local_region("output.weight", (128, 8), 0, 1, 2, 100)[1][0] == (100, 100)


def _write_tp_shards(d: Path, full: torch.Tensor, dim: int, tp: int, name="w") -> dict:
    parts_e, files = [], {}
    glob = list(full.shape)
    for r, piece in enumerate(full.chunk(tp, dim)):
        region = [(0, s) for s in glob]
        lo = r * piece.shape[dim]
        region[dim] = (lo, lo + piece.shape[dim])
        e, f = writing.write_shard(d, f"s{r}.safetensors", {name: (piece, region, glob)})
        parts_e.append(e)
        files.update(f)
    index = {"format": fmt.FORMAT, "tensors": writing.merge_entries(parts_e), "files": files}
    (d / fmt.INDEX).write_text(json.dumps(index))
    return index


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_read_assembles_any_region_from_shards(tmp_path, dtype):
    full = torch.randn(12, 10).to(dtype)
    _write_tp_shards(tmp_path, full, 0, tp=3)  # rows 0-4, 4-8, 8-12 in three files
    ck = Checkpoint(tmp_path)
    assert ck.shape("w") == [12, 10]
    assert torch.equal(ck.read("w"), full)
    for region in ([(2, 10), (0, 10)], [(3, 5), (4, 9)], [(0, 6), (0, 10)], [(11, 12), (0, 1)]):
        (a, b), (c, e) = region
        assert torch.equal(ck.read("w", region), full[a:b, c:e]), region
    ck.verify()


def test_resolve_follows_latest(tmp_path):
    it = tmp_path / "iter_0000004"
    it.mkdir()
    _write_tp_shards(it, torch.ones(4, 2), 0, 2)
    writing.write_atomic(tmp_path / fmt.LATEST, it.name)
    assert fmt.resolve(tmp_path) == it and fmt.resolve(it) == it
    assert Checkpoint(tmp_path).dir == it


def test_missing_and_empty_directories(tmp_path):
    with pytest.raises(MegaliteError, match="does not exist"):
        Checkpoint(tmp_path / "nope")
    with pytest.raises(MegaliteError, match="holds no checkpoint"):
        Checkpoint(tmp_path)


def test_altered_shard_fails_checksum_naming_the_file(tmp_path):
    _write_tp_shards(tmp_path, torch.randn(8, 4), 0, 2)
    path = tmp_path / "s1.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # flip bits inside the tensor data: same size, different content
    path.write_bytes(bytes(data))
    ck = Checkpoint(tmp_path)
    ck.verify(["s0.safetensors"])
    with pytest.raises(MegaliteError, match=r"s1\.safetensors fails its sha256"):
        ck.verify()


def test_truncated_shard_is_named(tmp_path):
    _write_tp_shards(tmp_path, torch.randn(8, 4), 0, 2)
    path = tmp_path / "s0.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(MegaliteError, match=r"s0\.safetensors has \d+ bytes.*truncated"):
        Checkpoint(tmp_path).verify()


@pytest.mark.parametrize(
    "bad", ["../outside.safetensors", "/etc/passwd", "sub/x.safetensors", ".."]
)
def test_index_paths_cannot_escape(tmp_path, bad):
    index = _write_tp_shards(tmp_path, torch.randn(4, 4), 0, 2)
    index["tensors"]["w"]["shards"][0]["file"] = bad
    index["files"][bad] = {"sha256": "0", "bytes": 1}
    (tmp_path / fmt.INDEX).write_text(json.dumps(index))
    with pytest.raises(MegaliteError, match="not a plain file name"):
        Checkpoint(tmp_path)


def test_latest_cannot_escape(tmp_path):
    (tmp_path / fmt.LATEST).write_text("../elsewhere")
    with pytest.raises(MegaliteError, match="not a plain file name"):
        fmt.resolve(tmp_path)


def test_not_an_index(tmp_path):
    (tmp_path / fmt.INDEX).write_text("{not json")
    with pytest.raises(MegaliteError, match="not readable JSON"):
        Checkpoint(tmp_path)
    (tmp_path / fmt.INDEX).write_text(json.dumps({"format": "torch-pickle"}))
    with pytest.raises(MegaliteError, match="is not a megalite-checkpoint/1 index"):
        Checkpoint(tmp_path)
    (tmp_path / fmt.INDEX).write_text(json.dumps({"format": fmt.FORMAT, "tensors": {}}))
    with pytest.raises(MegaliteError, match="is malformed"):
        Checkpoint(tmp_path)


def test_incomplete_coverage_is_an_error(tmp_path):
    index = _write_tp_shards(tmp_path, torch.randn(8, 4), 0, 2)
    index["tensors"]["w"]["shards"].pop()  # only rows 0..4 remain
    (tmp_path / fmt.INDEX).write_text(json.dumps(index))
    ck = Checkpoint(tmp_path)
    assert ck.read("w", [(0, 4), (0, 4)]).shape == (4, 4)
    with pytest.raises(MegaliteError, match="lacks part of tensor w"):
        ck.read("w")


@pytest.mark.parametrize("shape", [(6,), (5, 7), (1, 9), (4, 1), (3, 4, 5), (2, 3, 2, 2)])
def test_a_flat_range_is_stored_as_blocks_in_order(shape):
    """Every flat range of a tensor (a ZeRO shard's part of a parameter) is the concatenation
    of its blocks, each a rectangle starting where the block says, at most 2·ndim−1 of them."""
    t = torch.arange(math.prod(shape)).view(shape)
    for lo in range(t.numel()):
        for hi in range(lo + 1, t.numel() + 1):
            blocks = flat_blocks(shape, lo, hi)
            parts = [t[tuple(slice(a, b) for a, b in reg)].reshape(-1) for _, reg in blocks]
            assert [int(p[0]) for p in parts] == [start for start, _ in blocks]
            assert torch.cat(parts).tolist() == list(range(lo, hi))
            assert len(blocks) <= 2 * len(shape) - 1


def test_padding_rows_are_left_out_of_the_blocks():
    """A shard's part of a vocabulary-padded tensor (TP rank 1 of 10 real rows over 2 x 6)
    keeps only the real rows, at their global place."""
    spec = SimpleNamespace(region=lambda: [(6, 10), (0, 3)])  # 4 real rows of the local 6
    got = piece_blocks(spec, (6, 3), 5, 16)  # from row 1 col 2 into the padding
    assert got == [(0, 1, [(7, 8), (2, 3)]), (1, 7, [(8, 10), (0, 3)])]


@pytest.mark.parametrize("dim, parts", [(1, 2), (1, 1), (2, 1)])
def test_expert_slices_cut_over_etp_map_to_the_whole_tensor(dim, parts):
    """An expert tensor split over ep (dim 0) and cut over etp (a gated fc1's gate and up rows:
    two parts): every flat range of each rank's local tensor (a ZeRO shard's part) maps to
    blocks of the global tensor holding exactly those elements, and together the ranks' local
    tensors cover it once."""
    full = torch.arange(4 * 8 * 6, dtype=torch.float64).view(4, 8, 6)
    covered = torch.zeros_like(full)
    for ep in range(2):
        for etp in range(2):
            local = [2, 8, 6]
            local[dim] //= 2
            p = nn.Parameter(torch.empty(local))
            specs.mark(p, split_dim=0, split_axis="ep", split_size=2, split_index=ep,
                       cut=specs.Cut(dim, 2, etp, parts))  # fmt: skip
            holder = nn.Module()
            holder.register_parameter("w", p)
            specs.name_parameters(holder)
            s = specs.spec_of(p)
            assert s.shape == (4, 8, 6)
            mine = s.local(full).reshape(-1)
            for lo, hi in [(0, mine.numel()), (5, 41), (13, 14), (30, mine.numel())]:
                for a, b, region in piece_blocks(s, s.local_shape, lo, hi):
                    block = full[tuple(slice(x, y) for x, y in region)]
                    assert torch.equal(block.reshape(-1), mine[lo + a : lo + b]), (lo, hi, region)
                    if (lo, hi) == (0, mine.numel()):
                        covered[tuple(slice(x, y) for x, y in region)] += 1
    assert torch.equal(covered, torch.ones_like(full))
