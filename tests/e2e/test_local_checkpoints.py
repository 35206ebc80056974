"""Node-local checkpoints replicated to peers: a restart after a lost "node" resumes from the
newest local iteration (not the older persistent one) through the peers' replicas, at the
same world or a smaller one, with the uninterrupted run's losses; a corrupt copy is never
loaded (its replica, or the persistent tier, is). Four ranks, tp2: ranks 0-1 play node 0, ranks 2-3 node 1 (--replication-jump 2). The
two-agent, 8-rank version of the same: bench/checkpoint/bench_recovery.py."""

import shutil

import pytest

from tests.e2e.conftest import TINY, pretrain

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def _losses(rows) -> dict[int, float]:
    return {r["iteration"]: r["loss"] for r in rows}


def _line(r) -> str:
    return next(x for x in r.stdout.splitlines() if x.startswith("megalite: restart from"))


def _run(tmp_path, nproc, base, local, ckpt, *extra):
    args = [*base, "--save", str(ckpt), "--save-interval", "3",
            "--non-persistent-save-interval", "2", "--non-persistent-ckpt-type", "local",
            "--non-persistent-local-ckpt-dir", str(local), "--replication",
            "--replication-factor", "2", "--replication-jump", "2", *extra]  # fmt: skip
    return pretrain(nproc, args, tmp_path)


def _copy(tmp_path, name, lose_node1=True):
    """A copy of the crashed job's local and persistent tiers; node 1's local disk lost."""
    local, ckpt = tmp_path / f"local-{name}", tmp_path / f"ckpt-{name}"
    shutil.copytree(tmp_path / "local", local, symlinks=True)
    shutil.copytree(tmp_path / "ckpt", ckpt)
    for rank in (2, 3) if lose_node1 else ():
        shutil.rmtree(local / f"rank{rank:05d}")
    return local, ckpt


def _flip(shard):
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x10  # a byte of the last tensor
    shard.write_bytes(data)


def test_lost_node_restarts_from_the_local_tier(tiny_data, tmp_path):
    prefix, model = tiny_data
    base = [*TINY, "--num-layers", "2", "--data-path", prefix, "--tokenizer-model", model,
            "--tp", "2", "--train-iters", "6"]  # fmt: skip
    want = _losses(_run(tmp_path, 4, base, tmp_path / "local", tmp_path / "ckpt")[0])
    # What the disk held had the job died during step 6: persistent saves at 3 (and 6), local
    # ones at 4 (and 6); the saves of step 6 are removed.
    shutil.rmtree(tmp_path / "ckpt" / "iter_0000006")
    (tmp_path / "ckpt" / "latest").write_text("iter_0000003")
    for folder in (tmp_path / "local").glob("**/iter_0000006"):
        shutil.rmtree(folder)

    # the same world: node 1's shards come from node 0's replicas
    rows, r = _run(tmp_path, 4, base, *_copy(tmp_path, "same"))
    assert "the local tier: iteration 4 " in _line(r), _line(r)
    assert "fetched from peers" in _line(r) and " 0 fetched" not in _line(r), _line(r)
    assert _losses(rows) == {5: want[5], 6: want[6]}  # bit for bit: the same layout
    assert "locate" in rows[0]["launch"]  # the agreement is a launch phase of its own

    # node 0 alone (2 ranks: dp 2 -> 1, two micro-batches per rank -> four)
    rows, r = _run(tmp_path, 2, base, *_copy(tmp_path, "small"))
    assert "the local tier: iteration 4 " in _line(r), _line(r)
    got = _losses(rows)
    assert sorted(got) == [5, 6]
    for it in (5, 6):
        assert abs(got[it] - want[it]) <= 1e-4 * abs(want[it]), (it, got[it], want[it])

    # a flipped byte in rank 0's own copy, node 1 intact: its replica on rank 2 is taken
    local, ckpt = _copy(tmp_path, "replica", lose_node1=False)
    _flip(next((local / "rank00000" / "iter_0000004").glob("*.safetensors")))
    rows, r = _run(tmp_path, 4, base, local, ckpt)
    line = _line(r)
    assert "the local tier: iteration 4 " in line and "1 corrupt" in line, line
    assert _losses(rows) == {5: want[5], 6: want[6]}

    # the same flipped byte, and node 1 (which kept the replica) lost: no
    # complete local iteration is left, so the persistent tier's iteration 3 is taken
    local, ckpt = _copy(tmp_path, "corrupt")
    _flip(next((local / "rank00000" / "iter_0000004").glob("*.safetensors")))
    rows, r = _run(tmp_path, 4, base, local, ckpt)
    line = _line(r)
    assert "the persistent tier: iteration 3 " in line and "1 corrupt" in line, line
    assert _losses(rows) == {i: want[i] for i in (4, 5, 6)}
