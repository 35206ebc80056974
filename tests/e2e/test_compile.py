"""pretrain_gpt.py --compile at tp2*pp2*dp2 with a zero-bubble schedule (zb-h1: the split I/W
backward through compiled layers): the eager run's losses within fp32 round-off, per step.
(cp2, ZeRO-3, tp+sp and MoE are checked layer-level in distributed/test_compile.py.)"""

import pytest

from tests.e2e.conftest import TINY, pretrain

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
STEPS, TOL = 3, 1e-5
LAYOUT = ["--tp", "2", "--pp", "2", "--pp-schedule", "zb-h1"]  # dp2 from 8 ranks


def test_compiled_tp2_pp2_dp2_zbh1_matches_eager(tiny_data, tmp_path):
    prefix, model = tiny_data
    args = [*TINY, "--data-path", prefix, "--tokenizer-model", model, "--train-iters", str(STEPS),
            *LAYOUT]  # fmt: skip
    eager, _ = pretrain(8, args, tmp_path, timeout=900)
    compiled, _ = pretrain(8, [*args, "--compile"], tmp_path, timeout=900)
    assert len(compiled) == len(eager) == STEPS
    for step, (a, b) in enumerate(zip(compiled, eager)):
        assert abs(a["loss"] - b["loss"]) <= TOL, f"step {step}: {a['loss']} vs eager {b['loss']}"
        assert abs(a["grad_norm"] - b["grad_norm"]) <= TOL * max(1.0, b["grad_norm"])
