"""Hang reports: one rank of a tp2 pp2 dp2 run stops (SIGSTOP) at a chosen action; the seven
others time out, each writes hang-rank<N>.json, and tools/diagnose_hang.py names the stopped
rank and that action.

The eight ranks run launch.main (what pretrain_gpt.py runs) in forkserver processes with
torch preloaded, rendezvousing like torchrun's workers, which keeps the wall time small."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from megalite.pipeline.actions import F
from megalite.pipeline.schedules import get_schedule
from megalite.testing import CONTEXT
from tests.e2e.conftest import ROOT, TINY

# The collective timeout is what ends the survivors: 30 s, so that a loaded machine's slow
# start (eight ranks on two cores) never looks like the stall; no tight limit on the test.
pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(900)]

WORLD, VICTIM, ITERATION = 8, 5, 2  # rank 5: tp 1, dp 0, pipeline stage 1 (order tp-dp-pp)


def _rank(rank, port, argv, stall_at):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    from megalite.errors import run_main
    from megalite.training import build, launch

    if rank == VICTIM:
        real = build.run_schedule  # the step's schedule runs in RankParts.run

        def stalling(*args, observe, **kw):
            def watch(i, a):
                observe(i, a)
                if (observe.__self__.iteration, i) == (ITERATION, stall_at):
                    # the sends already posted complete in gloo's thread, which the stop would
                    # freeze too: on a loaded machine the peer's receive could come after it
                    time.sleep(1.0)
                    os.kill(os.getpid(), signal.SIGSTOP)  # stopped before running action i

            return real(*args, observe=watch, **kw)

        build.run_schedule = stalling
    run_main(launch.main, argv)


def test_hang_report_names_the_stalled_rank_and_action(tiny_data, tmp_path):
    prefix, model = tiny_data
    # stage 1's forward of micro-batch 2 (1F1B, 4 micro-batches per step at dp 2)
    actions = get_schedule("1f1b", 2, 1, 4, 1)
    stall_at = next(i for i, a in enumerate(actions) if a.kind == F and a.mb == 2)
    reports = tmp_path / "hang"
    argv = [*TINY, "--data-path", prefix, "--tokenizer-model", model, "--tp", "2", "--pp", "2",
            "--train-iters", "5", "--distributed-timeout-minutes", "0.5",
            "--metrics-file", str(tmp_path / "m.jsonl"), "--hang-report-dir", str(reports)]  # fmt: skip
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [CONTEXT.Process(target=_rank, args=(r, port, argv, stall_at)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        for r, p in enumerate(procs):
            if r != VICTIM:
                p.join(600)
        survivors = [p.exitcode for r, p in enumerate(procs) if r != VICTIM]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    assert survivors == [2] * (WORLD - 1), survivors  # each stopped with the one-line error
    written = sorted(int(p.name[9:14]) for p in reports.glob("hang-rank*.json"))
    assert written == [r for r in range(WORLD) if r != VICTIM]
    peer = json.loads((reports / "hang-rank00004.json").read_text())  # its TP peer
    assert peer["iteration"] == ITERATION and peer["action"]["index"] == stall_at
    assert peer["entered"]["tp"][0] > 0
    out = subprocess.run([sys.executable, "tools/diagnose_hang.py", str(reports)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.startswith(f"rank {VICTIM} (tp 1, dp 0, pp 1) is the rank the others wait on"), text
    assert f"action {stall_at} (F of chunk 0, micro-batch 2) of iteration {ITERATION}" in text, text
    assert "tp collective #" in text and len(text.strip().splitlines()) == 1, text
