"""--async-save: the background write gives the synchronous save's files byte for byte, holds
the state of the step that saved it while training goes on, surfaces its errors on every rank
at the next save, and a crash during it resumes from the previous checkpoint, losing nothing."""

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megalite.checkpoint import format as fmt
from megalite.checkpoint import shard_io
from megalite.errors import MegaliteError
from megalite.testing import CONTEXT, spawn, tiny_config, tiny_trainer

pytestmark = pytest.mark.distributed


def _trainer(save, tp=1, async_save=True, iters=6):
    cfg = tiny_config()
    t, c = cfg.training, cfg.checkpoint
    t.train_iters, t.log_interval = iters, 100
    cfg.parallel.tp, cfg.optimizer.zero_stage = tp, 1
    c.save, c.save_interval, c.keep_checkpoints, c.async_save = str(save), 2, 5, async_save
    return tiny_trainer(cfg, samples=64)


def _files(d: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _same_files_and_errors(rank, world, root):
    root = Path(root)
    tr = _trainer(root / "run", tp=2)  # tp2 dp2, ZeRO-1: four writers, no DP gather
    ck = tr.checkpointer
    for _ in range(2):
        tr.train_step(log=False)
    state = tr.state()
    ck._save_sync(state)
    if rank == 0:
        (root / "run" / "iter_0000002").rename(root / "sync")
        (root / "run" / "latest").unlink()
    dist.barrier()
    real, go = shard_io.write_shard, threading.Event()
    shard_io.write_shard = lambda *a: (go.wait(), real(*a))[1]  # written only after the next step
    tr.groups.ledger.reset()
    ck._save_async(state)
    traffic = dict(tr.groups.ledger.bytes)  # the foreground's collectives
    tr.train_step(log=False)  # the parameters and moments change before the files are written
    go.set()
    ck.wait()
    shard_io.write_shard = real
    same = None
    if rank == 0:
        same = _files(root / "sync") == _files(root / "run" / "iter_0000002")
    # a writer's disk fills up in the background: the next save stops every rank, same line

    def full(d, name, tensors):
        real(d, name, tensors)
        raise OSError(28, "No space left on device")

    shard_io.write_shard = full if rank == 1 else real
    ck._save_async(tr.state())  # iteration 3
    error = None
    try:
        ck.save(tr.state())  # the next save first waits for the one in flight
    except MegaliteError as e:
        error = str(e)
    shard_io.write_shard = real
    return same, error, traffic


def test_async_save_equals_sync_and_errors_reach_every_rank(tmp_path):
    results = spawn(_same_files_and_errors, 4, str(tmp_path))
    assert results[0][0] is True  # every file, index.json included, byte for byte
    for _, _, traffic in results:  # no DP gather: each rank writes the shard it holds
        assert list(traffic) == ["world"], traffic  # the index entries and RNG states
    for _, error, _ in results:
        assert error and "No space left on device" in error, error
        assert "previous checkpoints are intact" in error, error
    run = tmp_path / "run"
    assert sorted(p.name for p in run.iterdir()) == ["iter_0000002", "latest"]
    fmt.Checkpoint(run).verify()


# ---- a crash during the background write ----------------------------------------------------------


def _train(rank, world, save):
    tr = _trainer(save)
    tr.resume()
    tr.train()
    tr.opt.wait_params()
    return [p.detach().clone() for c in tr.chunks for p in c.parameters()]


def _killed(save, rendezvous, marker):
    """Train with --async-save; the background write of iteration 4 stalls half way (a slow
    disk) and the parent kills the process there."""
    torch.set_num_threads(1)  # as megalite/testing.py: the same arithmetic as the reference run
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1)
    real = shard_io.write_shard

    def slow(d, name, tensors):
        if d.name == ".iter_0000004.tmp":
            (d / name).write_bytes(b"half a file")
            Path(marker).touch()
            time.sleep(600)
        return real(d, name, tensors)

    shard_io.write_shard = slow
    _trainer(save).train()


def test_kill_during_background_write_resumes_from_the_previous_checkpoint(tmp_path):
    want = spawn(_train, 1, str(tmp_path / "ref"))[0]
    save, marker = tmp_path / "crash", tmp_path / "writing"
    proc = CONTEXT.Process(target=_killed, args=(str(save), str(tmp_path / "rdv"), str(marker)))
    proc.start()
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.is_alive() and time.monotonic() < deadline, "the save never started"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)  # mid-write; training may have gone on meanwhile
    finally:
        proc.join(30)
    assert (save / "latest").read_text() == "iter_0000002"  # untouched by the half-written save
    assert (save / ".iter_0000004.tmp").is_dir()
    got = spawn(_train, 1, str(save))[0]  # resumes from iteration 2
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    assert (save / "latest").read_text() == "iter_0000006"
    assert not (save / ".iter_0000004.tmp").exists()
