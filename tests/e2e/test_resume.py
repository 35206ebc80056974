"""Resuming pretrain_gpt.py from checkpoints: exact at the same layout, the same loss curve at
others, a clean stop on SIGTERM, --eval-only, and bad checkpoints refused with one line.

One uninterrupted run (tp=2 pp=2 dp=2, ZeRO 1, 4 steps, a checkpoint at step 2) is the
reference; the other runs resume from its step-2 checkpoint.
"""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from megalite.checkpoint import format as fmt
from tests.e2e.conftest import ROOT, TINY, pretrain

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 4
# The LR schedule depends on --train-iters through the decay length: fix it.
COMMON = [*TINY, "--train-iters", str(STEPS), "--lr-decay-iters", str(STEPS)]
REF_LAYOUT = ["--tp", "2", "--pp", "2", "--zero-stage", "1"]


def _args(tiny_data, *extra):
    prefix, model = tiny_data
    return [*COMMON, "--data-path", prefix, "--tokenizer-model", model, *extra]


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    """(run dir with iter_2 and iter_4, per-step losses) of the uninterrupted run."""
    tmp = tmp_path_factory.mktemp("reference")
    rows, _ = pretrain(
        8, _args(tiny_data, *REF_LAYOUT, "--save", str(tmp / "run"), "--save-interval", "2"), tmp
    )
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    assert sorted(p.name for p in (tmp / "run").iterdir()) == [
        "iter_0000002",
        "iter_0000004",
        "latest",
    ]
    return tmp / "run", [r["loss"] for r in rows]


def _tensors(path) -> dict:
    ck = fmt.Checkpoint(path)
    ck.verify()
    return {n: ck.read(n) for n in ck.tensors}


def test_exact_resume_same_layout(reference, tiny_data, tmp_path):
    run, losses = reference
    # A restarted job: --save holds the step-2 checkpoint and `latest`, no --load.
    save = tmp_path / "run"
    save.mkdir()
    shutil.copytree(run / "iter_0000002", save / "iter_0000002")
    (save / "latest").write_text("iter_0000002")
    rows, r = pretrain(8, _args(tiny_data, *REF_LAYOUT, "--save", str(save)), tmp_path)
    assert "loaded checkpoint" in r.stdout
    assert [x["iteration"] for x in rows] == [3, 4]
    assert [x["loss"] for x in rows] == losses[2:]  # bitwise
    ours, theirs = _tensors(save / "iter_0000004"), _tensors(run / "iter_0000004")
    assert ours.keys() == theirs.keys() and any(n.startswith("optimizer.exp_avg.") for n in ours)
    for n in ours:
        assert torch.equal(ours[n], theirs[n]), n
    a, b = fmt.Checkpoint(save).index, fmt.Checkpoint(run).index
    assert a["consumed_samples"] == b["consumed_samples"] == STEPS * 8
    assert a["optimizer"] == b["optimizer"] and a["rng"] == b["rng"]


@pytest.mark.parametrize(
    "nproc,layout",
    [(1, ["--tp", "1"]), (8, ["--tp", "4", "--pp", "2", "--vpp", "2"]),
     (2, ["--zero-stage", "3"])],
    ids=["tp1-pp1-dp1", "tp4-pp2-vpp2", "dp2-zero3"],
)  # fmt: skip
def test_resume_at_another_layout(reference, tiny_data, tmp_path, nproc, layout):
    run, losses = reference
    rows, _ = pretrain(
        nproc, _args(tiny_data, *layout, "--load", str(run / "iter_0000002")), tmp_path
    )
    assert [x["iteration"] for x in rows] == [3, 4]
    for step, (a, b) in zip((3, 4), zip([x["loss"] for x in rows], losses[2:])):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {step}: {a} vs uninterrupted {b}"


def test_zero3_checkpoint_resumes_at_stage1_and_dp1(tiny_data, tmp_path):
    """A ZeRO-3 run (dp=2, parameters sharded) saves the same topology-free checkpoint: it
    resumes at ZeRO-1 and in one process with its own loss curve."""
    rows, _ = pretrain(2, _args(tiny_data, "--zero-stage", "3", "--save", str(tmp_path / "run"),
                                "--save-interval", "2"), tmp_path)  # fmt: skip
    losses = [r["loss"] for r in rows]
    whole = sum(t.numel() * 4 for t in _weights(tmp_path / "run"))  # fp32 bytes of the model
    assert whole <= 2 * rows[0]["param_bytes"] < 1.05 * whole  # half each, plus bucket padding
    for nproc, layout in ((2, ["--zero-stage", "1"]), (1, [])):
        load = ["--load", str(tmp_path / "run" / "iter_0000002")]
        resumed, _ = pretrain(nproc, _args(tiny_data, *layout, *load), tmp_path)
        assert [x["iteration"] for x in resumed] == [3, 4]
        for step, (a, b) in zip((3, 4), zip([x["loss"] for x in resumed], losses[2:])):
            assert abs(a - b) <= 1e-4 * abs(b), f"{layout} step {step}: {a} vs zero3 {b}"


def test_dp4_zero1_checkpoint_resumes_at_dp2_zero2_and_one_process(tiny_data, tmp_path):
    """dp=4 ZeRO-1: each rank writes its own quarter of the optimizer state (no file holds a
    whole moment, no element is stored twice); it resumes at dp=2 ZeRO-2 and in one process
    with the uninterrupted run's loss curve."""
    save = tmp_path / "run"
    rows, _ = pretrain(4, _args(tiny_data, "--zero-stage", "1", "--save", str(save),
                                "--save-interval", "2"), tmp_path)  # fmt: skip
    losses = [r["loss"] for r in rows]
    ck = fmt.Checkpoint(save / "iter_0000002")
    moments = [n for n in ck.names(optimizer=True) if n.startswith("optimizer.exp_avg.")]
    held = {}  # file -> elements of exp_avg it holds
    for n in moments:
        sizes = [math.prod(hi - lo for lo, hi in s["slice"]) for s in ck.tensors[n]["shards"]]
        assert sum(sizes) == math.prod(ck.shape(n)), n  # each element once
        for s, k in zip(ck.tensors[n]["shards"], sizes):
            held[s["file"]] = held.get(s["file"], 0) + k
    total = sum(math.prod(ck.shape(n)) for n in moments)
    assert len(held) == 4 and all(k < 0.3 * total for k in held.values()), (held, total)
    for nproc, layout in ((2, ["--zero-stage", "2"]), (1, [])):
        load = ["--load", str(save / "iter_0000002")]
        resumed, _ = pretrain(nproc, _args(tiny_data, *layout, *load), tmp_path)
        assert [x["iteration"] for x in resumed] == [3, 4]
        for step, (a, b) in zip((3, 4), zip([x["loss"] for x in resumed], losses[2:])):
            assert abs(a - b) <= 1e-4 * abs(b), f"{layout} step {step}: {a} vs dp4 zero1 {b}"


def _weights(run) -> list:
    ck = fmt.Checkpoint(run / "iter_0000002")
    return [ck.read(n) for n in ck.tensors if not n.startswith("optimizer.")]


def test_sigterm_saves_and_eval_only(tiny_data, tmp_path):
    """SIGTERM to torchrun mid-run: every rank stops after the same step with a checkpoint."""
    prefix, model = tiny_data
    metrics, save = tmp_path / "m.jsonl", tmp_path / "run"
    split = ["--split", "60,40,0"]  # a validation split for --eval-only
    args = [
        *TINY,
        "--data-path",
        prefix,
        "--tokenizer-model",
        model,
        "--train-iters",
        "10000",
        *split,
    ]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
           "pretrain_gpt.py", *args, "--tp", "2", "--save", str(save), "--metrics-file", str(metrics)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert "received SIGTERM" in out, out[-3000:]
    last = json.loads(metrics.read_text().splitlines()[-1])["iteration"]
    ck = fmt.Checkpoint(save)
    ck.verify()
    assert ck.iteration == last < 10000
    assert not [p for p in save.iterdir() if p.name.startswith(".")]  # no half-written leftovers

    rows, _ = pretrain(
        1, [*args, "--load", str(save), "--eval-only", "--eval-iters", "1"], tmp_path
    )
    assert len(rows) == 1 and rows[0]["iteration"] == last and rows[0]["eval_loss"] > 0


def test_eval_only_needs_no_training_split(tiny_data, tmp_path):
    """--eval-only on a held-out set: --split 0,100,0 gives training nothing, which eval-only
    does not need; a split without a validation share is refused with one line."""
    save = tmp_path / "run"
    pretrain(1, _args(tiny_data, "--train-iters", "1", "--save", str(save)), tmp_path)
    held_out = ["--load", str(save), "--eval-only", "--eval-iters", "1", "--split", "0,100,0"]
    rows, _ = pretrain(1, _args(tiny_data, *held_out), tmp_path)
    assert len(rows) == 1 and rows[0]["iteration"] == 1 and rows[0]["eval_loss"] > 0
    line = _fails(tiny_data, tmp_path, "--load", str(save), "--eval-only", "--split", "100,0,0")
    assert "--eval-only" in line and "validation split" in line and "'100,0,0'" in line


def _fails(tiny_data, tmp_path, *extra) -> str:
    rows, r = pretrain(1, _args(tiny_data, *extra), tmp_path, check=False)
    assert r.returncode == 2 and not rows, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("megalite: error: ")
    return lines[-1]


def test_bad_checkpoints_fail_with_one_line(reference, tiny_data, tmp_path):
    run, _ = reference
    assert "does not exist" in _fails(tiny_data, tmp_path, "--load", str(tmp_path / "nope"))
    bad = tmp_path / "bad"
    shutil.copytree(run / "iter_0000002", bad)
    shard = bad / "model-tp01-dp01-pp01.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x1
    shard.write_bytes(bytes(data))
    line = _fails(tiny_data, tmp_path, "--load", str(bad))
    assert "model-tp01-dp01-pp01.safetensors fails its sha256 checksum" in line
    line = _fails(tiny_data, tmp_path, "--load", str(run), "--hidden-size", "64")
    assert "has shape" in line and "[512, 32]" in line and "[512, 64]" in line
