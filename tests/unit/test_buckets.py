"""The flat bucket layout every gradient buffer and the planner share (parallel/buckets.py)."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from megalite.parallel.buckets import (
    Bucket,
    Packer,
    ParamRange,
    bucket_layout,
    grad_dtype,
    trainable,
)
from megalite.parallel.buffers import place


def test_packer_pads_each_bucket():
    pack = Packer(pad=8)
    pack.close([("a", 3), ("b", 2)])
    pack.close([("c", 8)])
    pack.close([("d", 1)])
    assert pack.out == [
        (0, 8, [("a", 0, 3), ("b", 3, 2)]),  # 5 elements padded to 8
        (8, 16, [("c", 8, 8)]),  # already a multiple: no padding
        (16, 24, [("d", 16, 1)]),
    ]


def test_layout_reverses_closes_and_keeps_chunks_apart():
    chunks = [
        [("c0.a", 4, False), ("c0.b", 4, False), ("c0.c", 4, False)],
        [("c1.a", 2, False), ("c1.big", 6, True), ("c1.z", 2, False)],
    ]
    layout = bucket_layout(chunks, bucket_numel=8, pad=4)
    names = [[n for n, _, _ in ranges] for _, _, ranges in layout]
    # reversed within a chunk (backward's order); a bucket closes once it holds 8 elements
    # and never spans chunks; an `alone` parameter gets a bucket of its own
    assert names == [["c0.c", "c0.b"], ["c0.a"], ["c1.z"], ["c1.big"], ["c1.a"]]
    assert [(s, e) for s, e, _ in layout] == [(0, 8), (8, 12), (12, 16), (16, 24), (24, 28)]
    offsets = {n: o for _, _, ranges in layout for n, o, _ in ranges}
    assert offsets == {"c0.c": 0, "c0.b": 4, "c0.a": 8, "c1.z": 12, "c1.big": 16, "c1.a": 24}
    assert bucket_layout([], 8, 4) == []


def test_trainable_keeps_one_dtype_and_unique_names():
    a, b = nn.Linear(2, 3), nn.Linear(3, 1)
    b.bias.requires_grad_(False)  # frozen: not held
    named, dtype = trainable([nn.ModuleDict({"x": a}), nn.ModuleDict({"y": b})])
    assert [[n for n, _ in c] for c in named] == [["x.weight", "x.bias"], ["y.weight"]]
    assert dtype == torch.float32
    named, _ = trainable([nn.ModuleDict({"x": a})], select=lambda n, p: n.endswith("weight"))
    assert [n for n, _ in named[0]] == ["x.weight"]
    with pytest.raises(ValueError, match="names repeat across chunks"):
        trainable([a, nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="share one dtype"):
        trainable([nn.ModuleDict({"x": a}), nn.ModuleDict({"y": nn.Linear(2, 2).double()})])


def test_param_range_overlap_and_shard():
    p = nn.Parameter(torch.zeros(2, 5))  # 10 elements at flat offset 6 of bucket [0, 20)
    b = Bucket(0, 20, [p], shard_start=10, shard_end=20)  # this rank's shard: [10, 20)
    r = ParamRange("w", p, 6, b)
    assert r.overlap(0, 20) == (6, 16, 0, 10)
    assert r.overlap(10, 12) == (10, 12, 4, 6)
    assert r.overlap(16, 20) is None and r.overlap(0, 6) is None
    assert r.shard_slice() == (0, 6, 4, 10)  # flat 10..16 is the shard's 0..6
    b = Bucket(0, 20, [p], shard_start=16, shard_end=20)
    assert ParamRange("w", p, 6, b).shard_slice() is None
    assert b.numel == 20


def test_place_fixes_this_ranks_shard_and_counted_piece_for_good():
    """Rank 1 of a shard group of 2, copy 1 of 2: its half of [0, 16), the second quarter of
    that counted; the reduced gradient lands in the tensor asked for its shard. Once placed a
    bucket never changes: the step's state is the reducer's (reducers.Reduction)."""
    p = nn.Parameter(torch.zeros(12))
    shard, copies = SimpleNamespace(rank=1, size=2), SimpleNamespace(rank=1, size=2)
    asked = []
    grads = lambda lo, hi: asked.append((lo, hi)) or torch.zeros(hi - lo)  # noqa: E731
    b = place(0, 16, [p], 1, shard, copies, True, grads)
    assert (b.chunk, b.dp_start, b.shard_start, b.shard_end, b.counted) == (1, 8, 8, 16, (12, 16))
    assert asked == [(8, 16)] and b.shard_grad.numel() == 8 and b.used == 12
    whole = place(0, 16, [p], 0, shard, copies, False, grads)  # state not sharded
    assert (whole.shard_start, whole.shard_end, whole.counted) == (0, 16, (12, 16))
    for field in ("shard_start", "counted", "shard_grad"):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(b, field, None)


def test_gradients_accumulate_in_fp32_below_fp32():
    assert grad_dtype(torch.bfloat16) == grad_dtype(torch.float16) == torch.float32
    assert grad_dtype(torch.float32) == torch.float32
    assert grad_dtype(torch.float64) == torch.float64
