"""The restart's agreement at 16,384 ranks in the fake world (torch's fake process group, one
process per role): every rank enters the same collectives whatever it holds (its own copy and
a replica, nothing, only a corrupt copy), one all-gather over the world, and the choice over
16,384 ranks' records is computed on every rank; the bytes it gathers are counted."""

import json
import multiprocessing as mp
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest

from megalite.checkpoint import format as fmt
from megalite.checkpoint.local_restore import choose
from megalite.checkpoint.local_tier import PART, rank_dir, replica_dir

pytestmark = pytest.mark.distributed

WORLD = 16384


def _part(folder, owner, payload=b"x" * 64):
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(payload)
    files = {"model.safetensors": {"sha256": fmt.sha256_file(folder / "model.safetensors"),
                                   "bytes": len(payload)}}  # fmt: skip
    (folder / PART).write_text(json.dumps({"rank": owner, "world": WORLD, "files": files}))


def _roles(roles: dict, root: str, out: str):
    """Each role in turn in this one process: the fake world, its agreement, recorded."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megalite.checkpoint.local_restore import Restart
    from megalite.parallel import comm
    from megalite.training.fake_world import Recorder

    reports = {}
    for rank, holds in roles.items():
        here = Path(root) / str(rank)  # each role's node-local disk
        if holds in ("own+replica", "own"):
            _part(rank_dir(here, rank) / "iter_0000008", rank)
        if holds == "own+replica":
            _part(replica_dir(here, rank, (rank + 8) % WORLD) / "iter_0000008", (rank + 8) % WORLD)
        if holds == "corrupt":
            _part(rank_dir(here, rank) / "iter_0000008", rank)
            (rank_dir(here, rank) / "iter_0000008" / "model.safetensors").write_bytes(b"y" * 64)
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
        world = comm.Group("world", list(range(WORLD)), rank, dist.group.WORLD)
        groups = SimpleNamespace(rank=rank, topo=SimpleNamespace(world_size=WORLD), world=world,
                                 device=torch.device("cpu"))  # fmt: skip
        cfg = SimpleNamespace(checkpoint=SimpleNamespace(non_persistent_local_ckpt_dir=str(here)))
        with Recorder(WORLD) as rec:
            r = Restart(cfg, groups, None).agree()
        # what this rank's all-gather sends: its records to 16,383 peers
        reports[rank] = (dict(rec.calls), r.choice, r.line, world.ledger.bytes["world"])
        dist.destroy_process_group()
    with open(out, "wb") as fh:
        pickle.dump(reports, fh)


def test_agreement_at_16384_ranks_enters_the_same_collectives(tmp_path):
    roles = {0: "own+replica", 1: "nothing", 5: "corrupt", WORLD - 1: "own"}
    p = mp.get_context("spawn").Process(
        target=_roles, args=(roles, str(tmp_path / "local"), str(tmp_path / "reports"))
    )
    p.start()
    p.join(300)
    assert p.exitcode == 0
    with open(tmp_path / "reports", "rb") as fh:
        reports = pickle.load(fh)
    calls = {rank: rep[0] for rank, rep in reports.items()}
    world = tuple(range(WORLD))
    assert all(set(c) == {world} for c in calls.values()), {r: list(c) for r, c in calls.items()}
    seqs = {tuple(c[world]) for c in calls.values()}
    assert seqs == {(("all_gather_object", (), "object"),)}, seqs  # one all-gather, everywhere
    # (the fake group hands every rank copies of its own records: no iteration is complete)
    assert all(rep[1] is None for rep in reports.values())
    assert "corrupt or partial local copies skipped" in (reports[5][2] or ""), reports[5][2]
    # a rank sends its few records to 16,383 peers: a few MB, however large the model
    assert all(0 < rep[3] < 100 * WORLD for rep in reports.values()), [
        r[3] for r in reports.values()
    ]


def test_the_choice_over_16384_ranks_records():
    """Two copies of every part (groups of ranks 8 apart), node 1 (ranks 8-15) lost: iteration
    8 is complete through the replicas; one part's both copies lost: the older iteration."""
    holders = [[] for _ in range(WORLD)]
    for r in range(WORLD):
        peer = r + 8 if (r // 8) % 2 == 0 else r - 8
        for it in (6, 8):
            holders[r].append((it, r, WORLD))
            holders[peer].append((it, r, WORLD))
    lost = [[] if 8 <= h < 16 else recs for h, recs in enumerate(holders)]
    it, world, who = choose(lost, persistent=4)
    assert (it, world) == (8, WORLD) and who[9] == [1] and who[0] == [0]
    worse = [[x for x in recs if not (x[0] == 8 and x[1] == 3)] for recs in lost]
    assert choose(worse, persistent=4)[0] == 6
    assert choose(worse, persistent=6) is None
    # what each rank gathers: 16,384 small lists of records
    assert len(pickle.dumps(lost)) < 64 * 4 * WORLD
