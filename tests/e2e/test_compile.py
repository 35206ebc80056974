"""pretrain_gpt.py --compile at tp2*pp2 with a zero-bubble schedule (zb-h1: the split I/W
backward through compiled layers): the eager run's losses within fp32 round-off, per step.
(cp2, ZeRO-3 over dp2, tp+sp and MoE are checked layer-level in distributed/test_compile.py.)
Four ranks, not eight: every rank compiles its graphs itself, at once, and a dp copy compiles
the same graphs again; the inductor cache (TORCHINDUCTOR_CACHE_DIR, shared by every test) keeps
them for the next run."""

import pytest

from tests.e2e.conftest import TINY, pretrain

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(1800)]
STEPS, TOL = 3, 1e-5
LAYOUT = ["--tp", "2", "--pp", "2", "--pp-schedule", "zb-h1"]


def test_compiled_tp2_pp2_zbh1_matches_eager(tiny_data, tmp_path):
    prefix, model = tiny_data
    args = [*TINY, "--data-path", prefix, "--tokenizer-model", model, "--train-iters", str(STEPS),
            *LAYOUT]  # fmt: skip
    eager, _ = pretrain(4, args, tmp_path, timeout=900)
    compiled, _ = pretrain(4, [*args, "--compile"], tmp_path, timeout=900)
    assert len(compiled) == len(eager) == STEPS
    for step, (a, b) in enumerate(zip(compiled, eager)):
        assert abs(a["loss"] - b["loss"]) <= TOL, f"step {step}: {a['loss']} vs eager {b['loss']}"
        assert abs(a["grad_norm"] - b["grad_norm"]) <= TOL * max(1.0, b["grad_norm"])
