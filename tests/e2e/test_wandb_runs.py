"""pretrain_gpt.py honours W&B's environment (WANDB_MODE=disabled writes no run), and the
checkpoint names the W&B run that a resumed job continues (issue 43)."""

import glob
import json
import os
import subprocess
import sys

import pytest

from tests.e2e.conftest import ROOT, TINY, pretrain

NO_MODE = [a for a in TINY if a not in ("--wandb-mode", "disabled")]  # W&B's env decides
NO_MODE += ["--lr-warmup-iters", "1"]  # shorter than the 2-step run's decay


@pytest.mark.slow
def test_wandb_environment_and_resumed_run(tiny_data, tmp_path, monkeypatch):
    prefix, model = tiny_data
    ckpt, wb = tmp_path / "ckpt", tmp_path / "wb"
    args = [*NO_MODE, "--data-path", prefix, "--tokenizer-model", model, "--save", str(ckpt),
            "--save-interval", "2"]  # fmt: skip
    monkeypatch.setenv("WANDB_DIR", str(wb))
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    pretrain(1, [*args, "--train-iters", "2"], tmp_path)
    (run,) = glob.glob(str(wb / "wandb" / "offline-run-*"))
    run_id = run.rsplit("-", 1)[1]
    # W&B started before the launch: its console log holds every line the run printed
    log = open(f"{run}/files/output.log").read()
    phases = ("rendezvous", "groups", "data index", "model build")
    assert "intra-op thread" in log and all(f"launch: {p}" in log for p in phases), log[:2000]

    # Resumed at 2 with W&B off in the environment: no run written, and the checkpoint at 4
    # still names the run, for the job that resumes it with W&B on (the Logger then opens it:
    # tests/unit/test_run_settings.py).
    monkeypatch.setenv("WANDB_MODE", "disabled")
    pretrain(1, [*args, "--train-iters", "4"], tmp_path)
    assert glob.glob(str(wb / "wandb" / "offline-run-*")) == [run]
    for it in (2, 4):
        index = json.loads(next(ckpt.glob(f"iter_{it:07d}/*.json")).read_text())
        assert index["run_ids"]["wandb_run_id"] == run_id


def test_wandb_online_without_credentials_is_refused_before_training(tiny_data, tmp_path):
    """One line, before any process group (no launch phase printed), not a traceback at the
    first logged step after training ran."""
    prefix, model = tiny_data
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "NETRC"}
    env.update(HOME=str(tmp_path), WANDB_DIR=str(tmp_path / "wb"), OMP_NUM_THREADS="1")
    args = [*NO_MODE, "--wandb-mode", "online", "--data-path", prefix, "--tokenizer-model", model,
            "--train-iters", "2", "--metrics-file", str(tmp_path / "m.jsonl")]  # fmt: skip
    r = subprocess.run([sys.executable, "pretrain_gpt.py", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode != 0
    assert "launch:" not in r.stdout and not (tmp_path / "m.jsonl").exists()
    (line,) = r.stderr.strip().splitlines()
    assert "--wandb-mode online needs W&B credentials" in line and "wandb login" in line
