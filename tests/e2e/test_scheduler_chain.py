"""A scheduler's stop is a clean exit: SIGTERM to every process of a job step (what SLURM's
`--signal=TERM@T` or a preemption does) makes megalite-run save and exit 0, so
`sbatch --dependency=afterok` fires, and the next submission resumes exactly."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from megalite.checkpoint import format as fmt
from tests.e2e.conftest import ROOT, TINY

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def _launch(args, metrics):
    cmd = [sys.executable, "-m", "megalite.cli.run", "--standalone", "--nproc_per_node", "2",
           "pretrain_gpt.py", *args, "--metrics-file", str(metrics)]  # fmt: skip
    log = open(f"{metrics}.log", "w")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True,  # a task's process group, as srun starts it
                            env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip


def _signal_step(launcher: subprocess.Popen, sig=signal.SIGTERM):
    """SLURM signals every process of a step (its proctrack plugin): the launcher's process
    group and torchrun's workers, which run in sessions of their own."""
    workers = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True)
    os.killpg(launcher.pid, sig)
    for pid in map(int, workers.stdout.split()):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _losses(metrics) -> dict[int, float]:
    rows = [json.loads(line) for line in open(metrics).read().splitlines()]
    return {r["iteration"]: r["loss"] for r in rows}


def test_sigterm_to_the_step_exits_0_and_the_next_submission_resumes(tiny_data, tmp_path):
    prefix, model = tiny_data
    save = tmp_path / "run"
    args = [*TINY, "--data-path", prefix, "--tokenizer-model", model, "--tp", "2",
            "--train-iters", "400", "--save", str(save)]  # fmt: skip
    first = tmp_path / "first.jsonl"
    proc = _launch(args, first)
    try:
        deadline = time.monotonic() + 180
        while not (first.exists() and len(first.read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, open(f"{first}.log").read()
            time.sleep(0.1)
        _signal_step(proc)
        rc = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = open(f"{first}.log").read()
    assert rc == 0, log[-3000:]  # plain torchrun exits 1 here (SignalException)
    assert "received SIGTERM" in log and "stopped cleanly" in log, log[-3000:]
    stopped = max(_losses(first))
    assert fmt.Checkpoint(save).iteration == stopped < 400

    # the chained submission: the same script; it resumes and runs two more steps
    stop = ["--exit-interval", str(stopped + 2)]
    second = tmp_path / "second.jsonl"
    proc = _launch([*args, *stop], second)
    assert proc.wait(timeout=180) == 0, open(f"{second}.log").read()[-3000:]
    ref = tmp_path / "ref.jsonl"
    proc = _launch([*args[:-2], "--save", str(tmp_path / "ref"), *stop], ref)
    assert proc.wait(timeout=300) == 0, open(f"{ref}.log").read()[-3000:]
    resumed, want = _losses(second), _losses(ref)
    assert sorted(resumed) == [stopped + 1, stopped + 2]
    assert [resumed[i] for i in sorted(resumed)] == [want[stopped + 1], want[stopped + 2]]
