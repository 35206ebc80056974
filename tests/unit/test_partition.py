import pytest

from megalite.errors import MegaliteError
from megalite.pipeline.actions import v_placement
from megalite.pipeline.partition import Partition, parse_layout, rank_chunks


def test_interleaved_blocks_follow_megatron():
    # pp=2, vpp=2, 8 layers: virtual stages 0..3 of 2 layers; chunk c of rank r is stage c*pp+r
    part = Partition.even(8, 2, 2)
    assert [list(part.layers(r, c)) for r, c in [(0, 0), (1, 0), (0, 1), (1, 1)]] == [
        [0, 1], [2, 3], [4, 5], [6, 7]]  # fmt: skip


def _check_cover(part: Partition):
    pp, vpp = part.pp, part.vpp
    layers = [i for r in range(pp) for c in range(vpp) for i in part.layers(r, c)]
    assert sorted(layers) == list(range(part.num_layers))
    chunks = {(r, c): kw for r in range(pp) for c, kw in enumerate(part.rank_chunks(r))}
    emb = [rc for rc, kw in chunks.items() if kw["has_embedding"]]
    head = [rc for rc, kw in chunks.items() if kw["has_head"]]
    assert emb == [part.stage_of(0)] and head == [part.stage_of(pp * vpp - 1)]
    for vs in range(pp * vpp):
        assert part.virtual_stage(*part.stage_of(vs)) == vs
        r, c = part.stage_of(vs)  # the layers run in pipeline order
        assert len(part.layers(r, c)) == part.counts[vs]


@pytest.mark.parametrize("pp,vpp", [(1, 1), (2, 1), (4, 1), (2, 2), (4, 3), (3, 4)])
def test_every_layer_once_embedding_first_head_last(pp, vpp):
    _check_cover(Partition.even(2 * pp * vpp, pp, vpp))
    _check_cover(Partition.even(2 * pp * 2, pp, 2, v_placement))
    kw = rank_chunks(2 * pp * vpp, pp, vpp, 0)
    assert len(kw) == vpp and kw[0]["has_embedding"] and kw[0]["layers"] == range(0, 2)


def test_first_and_last_stage_flags_follow_megatron():
    # Llama 3 405B: 126 layers on pp16, the first and last rank one layer short of 8 each
    part = Partition.from_flags(126, 16, first=7, last=7)
    assert part.counts == (7,) + (8,) * 14 + (7,)
    _check_cover(part)
    # with vpp each rank's layers split over its chunks; virtual stage c*pp + r is rank r's chunk c
    part = Partition.from_flags(10, 2, 2, first=4, last=6)
    assert part.counts == (2, 3, 2, 3) and part.rank_layers(0) == 4
    assert Partition.from_flags(5, 2, last=1).counts == (4, 1)


def test_embedding_and_loss_counted_as_layers():
    part = Partition.from_flags(14, 4, embedding=True, loss=True)  # 16 "layers" over 4 stages
    assert part.counts == (3, 4, 4, 3)
    part = Partition.from_flags(7, 2, 2, embedding=True)
    assert part.counts == (1, 2, 2, 2)
    _check_cover(part)


def test_layout_string_of_megatrons_deepseek_example():
    # DeepSeek-V3 (61 layers + 1 MTP) on pp16 vpp2 (Megatron's docs); megalite runs MTP with L
    # (its string is "Et*3|(tt|)*29,m|L"; here the MTP stage is empty and m moves to L's stage)
    text = "Et*3|(tt|)*29,|mL"
    counts = parse_layout(text, 32, 61, mtp_layers=1)
    assert counts == [3] + [2] * 29 + [0, 0] and sum(counts) == 61
    part = Partition.from_flags(61, 16, 2, layout=text, mtp_layers=1)
    assert part.layers(0, 0) == range(0, 3) and part.layers(0, 1) == range(33, 35)
    assert part.rank_chunks(15)[1]["has_head"] and part.layers(15, 1) == range(61, 61)
    assert str(Partition.from_flags(4, 2, layout="Et|tttL")) == "1|3"
    assert parse_layout("E|(t|)*2,L", 4, 2) == [0, 1, 1, 0]


@pytest.mark.parametrize("kw,message", [
    (dict(layout="Et|tt"), "must end with L"),
    (dict(layout="Etttt|L|L"), "3 stages; pp\\*vpp is 2"),
    (dict(layout="tE|tttL"), "must open with E"),
    (dict(layout="Et|ttL"), "places 3 transformer layers; the model has 4"),
    (dict(layout="Et|ttxL"), "has \\['x'\\]"),
    (dict(layout="Ettm|ttL"), "MTP layers"),
    (dict(layout="Et|tttL", first=1), "spells out every stage"),
    (dict(first=5), "leaves -1 layers"),
    (dict(first=1, last=1), "2 layers, which do not split evenly over the other 0"),
    (dict(first=1, embedding=True), "use one of them"),
    (dict(embedding=True), "5\\) is not divisible by pp\\*vpp=2\\*1"),
], ids=lambda v: str(v)[:24])  # fmt: skip
def test_uneven_stages_that_do_not_add_up_are_one_sentence(kw, message):
    with pytest.raises(MegaliteError, match=message):
        Partition.from_flags(4, 2, **kw)


def test_a_rank_holding_nothing_is_refused_a_stage_of_0_layers_is_not():
    Partition.from_flags(4, 2, 2, layout="E|tt|tt|L").check_every_rank_holds_something()
    with pytest.raises(MegaliteError, match="pipeline rank 1 would hold no layer"):
        Partition.from_flags(4, 3, layout="Ett||ttL").check_every_rank_holds_something()


def test_indivisible_layers_is_a_clear_error():
    with pytest.raises(MegaliteError, match="num_layers=6 is not divisible by pp\\*vpp=2\\*2"):
        Partition.even(6, 2, 2)
    with pytest.raises(MegaliteError, match="pipeline rank 0 would hold 3 layers, not divisible"):
        Partition.from_flags(8, 2, 2, first=3, last=5)
