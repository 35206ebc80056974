"""The metrics file has the documented fields, and W&B offline holds the logged losses."""

import glob
import json

import pytest

from tests.e2e.conftest import TINY, pretrain

REQUIRED = ["iteration", "loss", "grad_norm", "lr", "tokens_per_s", "step_time_s", "mfu", "bubble_measured",
            "bubble_theory", "comm_bytes", "optimizer_state_bytes", "peak_memory_bytes"]  # fmt: skip


@pytest.mark.slow
def test_metrics_file_and_wandb_offline(tiny_data, tmp_path):
    prefix, model = tiny_data
    args = [*TINY, "--data-path", prefix, "--tokenizer-model", model, "--train-iters", "4", "--eval-interval", "2",
            "--wandb-mode", "offline", "--wandb-dir", str(tmp_path / "wb")]  # fmt: skip
    rows, r = pretrain(1, args, tmp_path)
    assert [row["iteration"] for row in rows] == [1, 2, 3, 4]
    for row in rows:
        assert set(REQUIRED) <= set(row), set(REQUIRED) - set(row)
        assert row["mfu"] is None  # CPU: no known peak, never a guess
        assert row["tokens_per_s"] > 0 and row["optimizer_state_bytes"] > 0
    assert "eval_loss" in rows[1] and "eval_loss" in rows[3] and "eval_loss" not in rows[0]
    assert "iter 4/4" in r.stdout and "loss" in r.stdout
    runs = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1
    raw = open(runs[0], "rb").read()  # the run log holds each logged value as JSON text
    for row in rows:
        assert json.dumps(row["loss"]).encode() in raw
