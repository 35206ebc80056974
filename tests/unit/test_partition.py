import pytest

from megalite.errors import MegaliteError
from megalite.pipeline.partition import (
    chunk_has_embedding,
    chunk_has_head,
    chunk_layers,
    rank_chunks,
    stage_of,
    virtual_stage,
)


def test_interleaved_blocks_follow_megatron():
    # pp=2, vpp=2, 8 layers: virtual stages 0..3 of 2 layers; chunk c of rank r is stage c*pp+r
    assert list(chunk_layers(8, 2, 2, rank=0, chunk=0)) == [0, 1]
    assert list(chunk_layers(8, 2, 2, rank=1, chunk=0)) == [2, 3]
    assert list(chunk_layers(8, 2, 2, rank=0, chunk=1)) == [4, 5]
    assert list(chunk_layers(8, 2, 2, rank=1, chunk=1)) == [6, 7]


@pytest.mark.parametrize("pp,vpp", [(1, 1), (2, 1), (4, 1), (2, 2), (4, 3), (3, 4)])
def test_every_layer_once_embedding_first_head_last(pp, vpp):
    n = 2 * pp * vpp
    layers = [i for r in range(pp) for c in range(vpp) for i in chunk_layers(n, pp, vpp, r, c)]
    assert sorted(layers) == list(range(n))
    emb = [(r, c) for r in range(pp) for c in range(vpp) if chunk_has_embedding(pp, vpp, r, c)]
    head = [(r, c) for r in range(pp) for c in range(vpp) if chunk_has_head(pp, vpp, r, c)]
    assert emb == [(0, 0)] and head == [(pp - 1, vpp - 1)]
    for vs in range(pp * vpp):
        assert virtual_stage(pp, *stage_of(pp, vs)) == vs
    kw = rank_chunks(n, pp, vpp, 0)
    assert len(kw) == vpp and kw[0]["has_embedding"] and kw[0]["layers"] == range(0, 2)


def test_indivisible_layers_is_a_clear_error():
    with pytest.raises(MegaliteError, match="num_layers=6 is not divisible by pp\\*vpp=2\\*2"):
        chunk_layers(6, 2, 2, 0, 0)
