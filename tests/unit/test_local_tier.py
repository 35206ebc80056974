"""The local tier's pure parts: where copies go, which iteration a restart agrees on, and that a
corrupt or partial copy is never offered."""

import json
from types import SimpleNamespace

import pytest

from megalite.checkpoint import format as fmt
from megalite.checkpoint.local_restore import choose, survey
from megalite.checkpoint.local_tier import PART, check, clique, copies, rank_dir, replica_dir
from megalite.errors import MegaliteError


def test_replication_groups_are_jump_apart_and_fit_the_world():
    # Megatron's groups: in each block of jump * factor ranks, {i, i + J, ...}
    assert clique(1, 2, 4) == [1, 5] and clique(5, 2, 4) == [1, 5]
    assert clique(9, 3, 4) == [1, 5, 9] and clique(14, 3, 4) == [14, 18, 22]
    assert clique(3, 1, 4) == [3]
    for world, factor, jump in [(16, 2, 4), (24, 3, 4), (8, 2, 1)]:
        groups = {tuple(clique(r, factor, jump)) for r in range(world)}
        assert sorted(r for g in groups for r in g) == list(range(world))  # a partition
        assert all(len({r // jump for r in g}) == factor for g in groups)  # distinct "nodes"
    assert copies(8, 2, 4) == 2 and copies(4, 2, 4) == 1  # node 0 alone: no copies left
    assert copies(16, 3, 4) == 2 and copies(24, 3, 4) == 3


def _cfg(**kw):
    base = dict(non_persistent_save_interval=2, non_persistent_ckpt_type="local",
                non_persistent_local_ckpt_dir="/tmp/x", replication=True,
                replication_factor=2, replication_jump=4)  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize(
    "kw,words",
    [
        ({"non_persistent_ckpt_type": None}, "--non-persistent-ckpt-type local"),
        ({"non_persistent_local_ckpt_dir": None}, "--non-persistent-local-ckpt-dir"),
        ({"replication_factor": 0}, ">= 1"),
    ],
)
def test_impossible_flags_fail_with_one_line(kw, words):
    with pytest.raises(MegaliteError, match=words):
        check(_cfg(**kw), 8)
    check(_cfg(), 8)
    check(_cfg(non_persistent_save_interval=0, non_persistent_ckpt_type=None), 8)


def test_choose_the_newest_complete_iteration_above_the_persistent_one():
    # holders 0..3; a save at world 4 (owners 0..3)
    node0 = [(6, 0, 4), (6, 1, 4), (6, 2, 4), (6, 3, 4), (4, 0, 4), (4, 1, 4)]
    node1 = [(4, 2, 4), (4, 3, 4), (6, 2, 4)]
    got = choose([node0[:3], node0[3:], node1, []], persistent=3)
    assert got[0] == 6 and got[1] == 4 and got[2][2] == [0, 2]
    # owner 3's copy of 6 lost: 4 is the newest complete one
    assert choose([node0[:3], node0[4:], node1, []], persistent=3)[0] == 4
    # the persistent tier is as new: it wins (no fetch)
    assert choose([node0[:3], node0[4:], node1, []], persistent=4) is None
    # a save by a larger world needs all of its owners, wherever they are now
    assert choose([[(8, o, 8) for o in range(7)]], persistent=-1) is None
    assert choose([[(8, o, 8) for o in range(8)]], persistent=-1)[:2] == (8, 8)


def _part(folder, owner, iteration, world=2, payload=b"x" * 100):
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(payload)
    files = {"model.safetensors": {"sha256": fmt.sha256_file(folder / "model.safetensors"),
                                   "bytes": len(payload)}}  # fmt: skip
    (folder / PART).write_text(json.dumps({"rank": owner, "world": world, "files": files}))


def test_survey_offers_only_whole_copies(tmp_path):
    _part(rank_dir(tmp_path, 0) / "iter_0000004", 0, 4)
    _part(rank_dir(tmp_path, 0) / "iter_0000002", 0, 2)
    _part(replica_dir(tmp_path, 0, 1) / "iter_0000004", 1, 4)
    _part(rank_dir(tmp_path, 3) / "iter_0000004", 3, 4, world=4)  # a rank of a larger world
    # a flipped byte, a truncated file, a missing part.json, a half-written (.tmp) dir
    _part(replica_dir(tmp_path, 0, 5) / "iter_0000004", 5, 4, world=8)
    bad = replica_dir(tmp_path, 0, 5) / "iter_0000004" / "model.safetensors"
    bad.write_bytes(b"x" * 99 + b"y")
    _part(replica_dir(tmp_path, 0, 6) / "iter_0000004", 6, 4, world=8)
    (replica_dir(tmp_path, 0, 6) / "iter_0000004" / "model.safetensors").write_bytes(b"x")
    (replica_dir(tmp_path, 0, 7) / "iter_0000004").mkdir(parents=True)
    _part(rank_dir(tmp_path, 0) / ".iter_0000006.tmp", 0, 6)
    records, where, corrupt = survey(tmp_path, newer_than=2)
    assert sorted(records) == [(4, 0, 2), (4, 1, 2), (4, 3, 4)] and corrupt == 3
    assert where[(4, 1)] == replica_dir(tmp_path, 0, 1) / "iter_0000004"
    assert (2, 0, 2) in survey(tmp_path, newer_than=-1)[0]
    # the node's ranks share its folders, whoever wrote them: two local ranks, one each
    first, second = survey(tmp_path, 2, 0, 2)[0], survey(tmp_path, 2, 1, 2)[0]
    assert sorted(first) == [(4, 0, 2), (4, 1, 2)] and second == [(4, 3, 4)]
