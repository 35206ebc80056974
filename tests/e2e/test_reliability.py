"""Determinism and secrets: the same seed and layout replay bit for bit; the W&B key never leaks."""

import os

import pytest

from tests.e2e.conftest import TINY, pretrain

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_same_seed_same_layout_is_bitwise_identical(tiny_data, tmp_path):
    prefix, model = tiny_data
    args = [
        *TINY,
        "--data-path",
        prefix,
        "--tokenizer-model",
        model,
        "--train-iters",
        "6",
        "--tp",
        "2",
        "--pp",
        "2",
    ]
    a, _ = pretrain(4, args, tmp_path)
    b, _ = pretrain(4, args, tmp_path)
    assert [(r["loss"], r["grad_norm"]) for r in a] == [(r["loss"], r["grad_norm"]) for r in b]
    c, _ = pretrain(4, [*args, "--seed", "7"], tmp_path)
    assert [r["loss"] for r in c] != [r["loss"] for r in a]  # the seed matters


def test_wandb_key_never_written(tiny_data, tmp_path, monkeypatch):
    secret = "0123456789abcdef" * 2 + "deadbeef"
    monkeypatch.setenv("WANDB_API_KEY", secret)
    prefix, model = tiny_data
    args = [*TINY, "--data-path", prefix, "--tokenizer-model", model, "--train-iters", "2", "--wandb-mode", "offline",
            "--wandb-dir", str(tmp_path / "wb"), "--save", str(tmp_path / "ckpt")]  # fmt: skip
    _, r = pretrain(1, args, tmp_path)
    assert secret not in r.stdout + r.stderr
    for root, _, files in os.walk(tmp_path):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                assert secret.encode() not in fh.read(), os.path.join(root, f)
