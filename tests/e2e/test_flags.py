"""Flags whose arithmetic differs from the reference path: the loss is finite and falls (and,
for the Triton kernels, stays within fp32 rounding of the torch references)."""

import math
import subprocess
import sys

import pytest

from tests.e2e.conftest import ROOT, TINY, pretrain

pytestmark = [pytest.mark.slow]


def _losses(tiny_data, tmp_path, nproc, *flags, steps=12):
    prefix, model = tiny_data
    args = [*TINY, "--data-path", prefix, "--tokenizer-model", model, "--train-iters", str(steps),
            *flags]  # fmt: skip
    rows, _ = pretrain(nproc, args, tmp_path)
    assert len(rows) == steps
    return [r["loss"] for r in rows], rows


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_learns(precision, tiny_data, tmp_path):
    # (fp16 from Megatron's initial scale 2^32 skips ~15 steps backing off: start nearer)
    scale = ["--initial-loss-scale", "65536"] if precision == "fp16" else []
    losses, rows = _losses(tiny_data, tmp_path, 1, "--precision", precision, *scale)
    assert all(math.isfinite(x) for x in losses)
    assert min(losses[-3:]) < losses[0] - 0.3, losses
    if precision == "fp16":  # dynamic loss scaling at work
        assert rows[-1]["loss_scale"] > 1


def test_triton_kernels_in_the_trainer(tiny_data, tmp_path):
    """--kernels triton under the interpreter (fp32): every fused kernel in the model."""
    small = ["--num-layers", "2", "--seq-length", "16", "--global-batch-size", "2"]
    ours, _ = _losses(tiny_data, tmp_path, 1, "--kernels", "triton", *small, steps=3)
    ref, _ = _losses(tiny_data, tmp_path, 1, "--kernels", "torch", *small, steps=3)
    for a, b in zip(ours, ref):
        assert abs(a - b) <= 1e-3 * abs(b), (ours, ref)


def test_a_v_schedule_infers_its_vpp():
    """`--pp-schedule zbv` without --vpp runs vpp=2 and says so; `--vpp 3` stays refused."""
    shape = ["--pp", "2", "--pp-schedule", "zbv", *TINY, "--dry-run"]
    r = subprocess.run([sys.executable, "pretrain_gpt.py", *shape], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "vpp=2 inferred: the zbv schedule runs 2 chunks per rank" in r.stderr
    assert "pp=2 dp=1 vpp=2" in r.stdout
    r = subprocess.run([sys.executable, "pretrain_gpt.py", *shape, "--vpp", "3", "--num-layers", "12"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode != 0
    assert "the zbv schedule runs two chunks per rank in a V: --vpp 2, not 3" in r.stderr
