"""FP8 training at tp2·pp2·dp2 with sequence parallelism, and at cp2, gives one process's FP8
loss curve for 20 steps (fp32 master weights) within the fp32 layouts' 1e-4: amaxes are reduced
over the groups that shard each tensor (cp shards the tokens), and delayed scaling's over the
ranks holding the same layers.

The layouts' fp32 sums differ in their last bits, and where such a difference meets an FP8
rounding boundary one element rounds the other way (a 2^-4 relative step for e4m3); the curves
stay within about 1e-5 of each other (docs/fp8.md, "Every layout quantises like one process",
has the figures). Without the amax reductions the first step already differs
(tests/distributed/test_fp8.py)."""

import pytest

from tests.e2e.conftest import TINY, pretrain

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 20
FP8_TOL = 1e-4
LAYOUTS = {"tp2·pp2·dp2": (8, ["--tp", "2", "--pp", "2", "--sequence-parallel"]),
           "cp2": (2, ["--cp", "2"])}  # fmt: skip


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fp8_layouts_match_one_process(recipe, tiny_data, tmp_path, one_process_curve):
    prefix, model = tiny_data
    args = [*TINY, "--data-path", prefix, "--tokenizer-model", model, "--train-iters", str(STEPS),
            "--fp8-format", "hybrid", "--fp8-recipe", recipe, "--fp8-amax-history-len", "4"]  # fmt: skip
    one, _ = pretrain(1, args, tmp_path)
    base = [r["loss"] for r in one]
    assert len(base) == STEPS and base[-1] < base[0] - 0.5  # it learns
    assert len(one_process_curve) == STEPS and one_process_curve != base  # no FP8: another curve
    for layout, (nproc, flags) in LAYOUTS.items():
        many, _ = pretrain(nproc, [*args, *flags], tmp_path)
        assert len(many) == STEPS
        for step, (a, b) in enumerate(zip([r["loss"] for r in many], base), 1):
            assert abs(a - b) <= FP8_TOL * abs(b), f"fp8 {recipe} {layout} step {step}: {a} vs {b}"
