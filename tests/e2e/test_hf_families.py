"""Qwen3 (QK-norm, head_dim 16 != 32/4, tied embeddings) and Llama 3.x (llama3 RoPE scaling, a
large base) train at tp2*pp2*dp2 (ZeRO-1, sequence parallel), Mistral with a sliding window of 9
(of 32 tokens) at cp2*tp2*pp2, with the single-process loss at every step (fp32, relative
difference <= 1e-4)."""

import pytest

from tests.e2e.conftest import TINY, pretrain

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 6
MODELS = {
    "qwen3": ["--flavour", "qwen3", "--kv-channels", "16", "--num-query-groups", "2",
              "--no-untie-embeddings-and-output-weights"],
    "llama3": ["--flavour", "llama", "--rope-scaling", "llama3", "--rotary-base", "500000",
               "--rope-original-max-position-embeddings", "8", "--num-query-groups", "2"],
    "mistral": ["--flavour", "mistral", "--sliding-window", "9", "--num-query-groups", "2"],
}  # fmt: skip
LAYOUT = ["--tp", "2", "--pp", "2", "--sequence-parallel", "--zero-stage", "1"]
LAYOUTS = {"mistral": ["--cp", "2", "--tp", "2", "--pp", "2"]}  # context parallel, ring


@pytest.mark.parametrize("model", list(MODELS))
def test_sharded_training_matches_one_process(model, tiny_data, tmp_path):
    prefix, tok = tiny_data
    args = [*TINY, "--data-path", prefix, "--tokenizer-model", tok, "--train-iters", str(STEPS),
            *MODELS[model]]  # fmt: skip
    one, _ = pretrain(1, args, tmp_path)
    eight, _ = pretrain(8, [*args, *LAYOUTS.get(model, LAYOUT)], tmp_path)
    baseline = [r["loss"] for r in one]
    assert len(baseline) == STEPS and baseline[-1] < baseline[0]  # it learns
    losses = [r["loss"] for r in eight]
    assert len(losses) == STEPS
    for step, (a, b) in enumerate(zip(losses, baseline), 1):
        assert abs(a - b) <= 1e-4 * abs(b), f"{model} step {step}: {a} vs one process {b}"
