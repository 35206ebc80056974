"""FP8 training at tp2·pp2·dp2 gives one process's FP8 loss curve (fp32 master weights,
relative difference <= 1e-4 per step for 20 steps): amaxes are reduced over the groups that
shard each tensor, and delayed scaling's over the ranks holding the same layers."""

import pytest

from tests.e2e.conftest import TINY, pretrain

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 20


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fp8_tp2_pp2_dp2_matches_one_process(recipe, tiny_data, tmp_path):
    prefix, model = tiny_data
    args = [*TINY, "--data-path", prefix, "--tokenizer-model", model, "--train-iters", str(STEPS),
            "--fp8-format", "hybrid", "--fp8-recipe", recipe, "--fp8-amax-history-len", "4"]  # fmt: skip
    one, _ = pretrain(1, args, tmp_path)
    bf, _ = pretrain(1, args[:-6], tmp_path)  # no FP8: another curve
    many, _ = pretrain(8, [*args, "--tp", "2", "--pp", "2", "--sequence-parallel"], tmp_path)
    base = [r["loss"] for r in one]
    assert len(base) == STEPS and base[-1] < base[0] - 0.5  # it learns
    assert [r["loss"] for r in bf] != base
    for step, (a, b) in enumerate(zip([r["loss"] for r in many], base), 1):
        assert abs(a - b) <= 1e-4 * abs(b), f"fp8 {recipe} step {step}: {a} vs one process {b}"
