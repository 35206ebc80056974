"""Faults: non-finite steps are skipped then stop the run; a stalled or killed rank makes the
others exit within the timeout, naming what they waited on; saved checkpoints stay intact."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from megalite.checkpoint import format as fmt
from megalite.config_read import parse_args
from megalite.errors import MegaliteError
from megalite.shape import validate
from megalite.testing import spawn
from megalite.training import launch
from megalite.training.trainer import Trainer
from tests.e2e.conftest import ROOT, TINY

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def _poisoned_run(rank, world, prefix, model, save):
    cfg = parse_args([*TINY, "--data-path", prefix, "--tokenizer-model", model, "--train-iters", "20",
                      "--max-skipped-steps", "2", "--save", save, "--save-interval", "2"])  # fmt: skip
    shape = validate(cfg, world)
    trainer = Trainer(cfg, shape, launch.setup(shape))
    head = next(c for c in trainer.chunks if c.has_head)
    forward = head.forward

    def poisoned(x, labels=None):  # rank 1's loss turns NaN from step 5 on
        out = forward(x, labels)
        return out * float("nan") if rank == 1 and trainer.iteration >= 4 else out

    head.forward = poisoned
    params, step = {}, trainer.train_step

    def recorded_step(log=True):
        metrics = step(log)
        trainer.opt.wait_params()
        params[trainer.iteration] = [
            p.detach().clone() for c in trainer.chunks for p in c.parameters()
        ]
        return metrics

    trainer.train_step = recorded_step
    with pytest.raises(MegaliteError) as e:
        trainer.train()
    return str(e.value), trainer.iteration, trainer.skipped_total, params


def test_nan_steps_are_skipped_then_stop(tiny_data, tmp_path):
    prefix, model = tiny_data
    results = spawn(_poisoned_run, 2, prefix, model, str(tmp_path / "ckpt"))
    for message, iteration, skipped, params in results:
        assert "3 steps in a row had a non-finite loss or gradient" in message
        assert iteration == 7 and skipped == 3  # steps 5, 6, 7 skipped on both ranks, then stop
        assert not all(torch.equal(a, b) for a, b in zip(params[3], params[4]))  # good steps update
        for it in (5, 6):  # (step 7 raises before it is recorded)
            assert all(
                torch.equal(a, b) for a, b in zip(params[4], params[it])
            )  # skipped: untouched
    latest = fmt.resolve(str(tmp_path / "ckpt"))
    fmt.Checkpoint(latest).verify()  # the last checkpoint written is whole and loadable


def _workers(torchrun: subprocess.Popen) -> dict[int, int]:
    """RANK -> pid of torchrun's worker processes."""
    out = subprocess.run(
        ["pgrep", "-P", str(torchrun.pid)], capture_output=True, text=True
    ).stdout.split()
    ranks = {}
    for pid in map(int, out):
        env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        rank = next((int(v.split(b"=")[1]) for v in env if v.startswith(b"RANK=")), None)
        if rank is not None:
            ranks[rank] = pid
    return ranks


@pytest.mark.parametrize("fault", ["stall", "kill"])
def test_a_lost_rank_makes_the_others_exit_naming_it(fault, tiny_data, tmp_path):
    prefix, model = tiny_data
    metrics = tmp_path / "metrics.jsonl"
    # torchrun stops a dead worker's node-mates within --monitor-interval (0.1 s); the ranks of
    # other nodes see only the lost peer. A long interval lets this node's survivor play them.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--monitor-interval", "10",
           "pretrain_gpt.py", *TINY, "--data-path", prefix, "--tokenizer-model", model, "--pp", "2",
           "--train-iters", "100000", "--distributed-timeout-minutes", "0.1", "--metrics-file", str(metrics)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        victim = _workers(proc)[1]
        os.kill(victim, signal.SIGSTOP if fault == "stall" else signal.SIGKILL)
        stopped = time.monotonic()
        _, err = proc.communicate(timeout=120)
        waited = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            proc.kill()
        subprocess.run(["pkill", "-KILL", "-f", str(metrics)])  # a stopped rank, if any is left
    assert proc.returncode != 0
    lines = [line for line in err.splitlines() if line.startswith("megalite: error:")]
    assert lines, err[-3000:]
    survivor = lines[0]
    assert "rank 0" in survivor and "died or stalled" in survivor, survivor
    assert "stage 1 (rank 1)" in survivor or "pipeline stage 0" in survivor, survivor
    assert waited < 60  # the timeout is 6 s; torchrun's teardown adds a little
    assert json.loads(metrics.read_text().splitlines()[0])["iteration"] == 1


CRASH = ["--hidden-size", "256", "--train-iters", "8", "--save-interval", "2", "--keep-checkpoints", "8",
         "--tp", "2"]  # fmt: skip


def _torchrun(args, metrics, restarts=0):
    """torchrun in the background, its output in a file beside the metrics (a pipe could fill up)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--max-restarts", str(restarts), "pretrain_gpt.py", *args, "--metrics-file", str(metrics)]  # fmt: skip
    log = open(f"{metrics}.log", "w")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip


def _tensors(run_dir):
    from safetensors.torch import load_file

    final = fmt.resolve(str(run_dir))
    out = {}
    for f in sorted(os.listdir(final)):
        if f.endswith(".safetensors"):
            out.update({f"{f}:{k}": v for k, v in load_file(os.path.join(final, f)).items()})
    return final, out


@pytest.mark.parametrize("when", ["mid-training", "during-save"])
def test_crash_under_torchrun_resumes_bit_identically(when, tiny_data, tmp_path):
    prefix, model = tiny_data
    base = [*TINY, "--data-path", prefix, "--tokenizer-model", model, *CRASH]
    ref = _torchrun([*base, "--save", str(tmp_path / "ref")], tmp_path / "ref.jsonl")
    assert ref.wait(timeout=300) == 0, open(f"{tmp_path / 'ref.jsonl'}.log").read()[-3000:]

    save = tmp_path / "crash"
    metrics = tmp_path / "crash.jsonl"
    proc = _torchrun([*base, "--save", str(save)], metrics, restarts=1)
    try:
        deadline, killed_during_save = time.monotonic() + 240, False
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "no chance to kill a rank"
            if when == "during-save" and (save / ".iter_0000004.tmp").exists():
                os.kill(_workers(proc)[0], signal.SIGKILL)  # rank 0 writes the index and renames
                killed_during_save = not (save / "iter_0000004").exists()
                break
            if (
                when == "mid-training"
                and metrics.exists()
                and len(metrics.read_text().splitlines()) >= 3
            ):
                os.kill(_workers(proc)[1], signal.SIGKILL)
                break
            time.sleep(0.002)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, open(f"{metrics}.log").read()[-3000:]
    iterations = [json.loads(line)["iteration"] for line in metrics.read_text().splitlines()]
    # the restarted group resumed from the latest whole checkpoint, not from scratch; the rows
    # of the iterations it ran again replaced the dead group's: one row per iteration
    (resumed,) = re.findall(
        r"loaded checkpoint \S+ \(iteration (\d+)", open(f"{metrics}.log").read()
    )
    assert int(resumed) in (2, 4) and iterations == list(range(1, 9)), (resumed, iterations)
    if when == "during-save" and killed_during_save:
        assert int(resumed) == 2, resumed  # the half-written iteration 4 was ignored
    final_ref, want = _tensors(tmp_path / "ref")
    final, got = _tensors(save)
    assert os.path.basename(final) == os.path.basename(final_ref) == "iter_0000008"
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
