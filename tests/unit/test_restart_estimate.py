"""The planner's estimate of a restart after a lost node (megalite/plan/restart.py)."""

import pytest

from megalite.config_read import parse_args
from megalite.plan.ranking import Cluster
from megalite.plan.restart import checkpoint_bytes, format_estimate, restart_estimate
from megalite.shape import validate


def _shape(world, *flags):
    batch = ["--micro-batch-size", "1", "--global-batch-size", "512"]
    cfg = parse_args(["--config", "configs/gpt2-124m.yaml", *batch, *flags])
    return cfg, validate(cfg, world)


def test_checkpoint_bytes_follow_the_parameters_and_the_zero_stage():
    cfg, s = _shape(16, "--tp", "2", "--zero-stage", "0")
    total, part = checkpoint_bytes(cfg, s)
    n = 124_439_808  # GPT-2 124M's parameters; bf16 weights + fp32 master and two moments
    per = 2 + 3 * 4 if cfg.training.precision == "bf16" else 4 + 2 * 4
    assert total == pytest.approx(n * per, rel=0.05)
    assert part == pytest.approx(total / 2, rel=0.01)  # ZeRO-0: dp rank 0 writes its tp half
    cfg1, s1 = _shape(16, "--tp", "2", "--zero-stage", "1")
    total1, part1 = checkpoint_bytes(cfg1, s1)
    assert total1 == pytest.approx(total) and part1 == pytest.approx(total / 16, rel=0.01)


def test_local_restart_moves_a_node_not_the_checkpoint():
    cfg, s = _shape(1024, "--tp", "2", "--zero-stage", "1")
    est = restart_estimate(cfg, s, Cluster(gpus=1024), copies=2, step_s=2.0, local_interval=50,
                           persistent_interval=1000)  # fmt: skip
    part = est["part_bytes"]
    assert est["local"]["network_bytes"] == pytest.approx(8 * part)
    assert est["local_save"]["sent_bytes"] == pytest.approx(part)
    assert est["persistent"]["storage_bytes"] == pytest.approx(est["checkpoint_bytes"])
    assert est["local"]["lost_s"] == 50.0 and est["persistent"]["lost_s"] == 1000.0
    small = restart_estimate(cfg, _shape(64, "--tp", "2", "--zero-stage", "1")[1],
                             Cluster(gpus=64))  # fmt: skip
    assert est["local"]["agree_s"] > small["local"]["agree_s"]  # the ring grows with the world
    assert "local tier" in format_estimate(est) and "persistent tier" in format_estimate(est)
