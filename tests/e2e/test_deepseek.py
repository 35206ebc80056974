"""DeepSeek-V3 (multi-head latent attention with low-rank q and yarn's mscale, two multi-token
prediction modules) trains with the single-process loss at every step (fp32, relative
difference <= 1e-4) at tp2*pp2*dp2 (ZeRO-1, sequence parallel), at pp2*vpp2 (the MTP modules
on the last virtual chunk, the embedding tied across stages) and at pp2*dp2 (ZeRO-3)."""

import pytest

from tests.e2e.conftest import TINY, pretrain

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 5
DEEPSEEK = ["--flavour", "deepseek_v3", "--q-lora-rank", "12", "--kv-lora-rank", "10",
            "--qk-head-dim", "6", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8",
            "--rope-scaling", "yarn", "--rope-scaling-factor", "2",
            "--rope-original-max-position-embeddings", "16", "--yarn-mscale", "1",
            "--yarn-mscale-all-dim", "0.7", "--mtp-num-layers", "2",
            "--mtp-loss-scaling-factor", "0.3"]  # fmt: skip
LAYOUTS = {
    "tp2-pp2-dp2": (8, ["--tp", "2", "--pp", "2", "--sequence-parallel", "--zero-stage", "1"]),
    "pp2-vpp2": (2, ["--pp", "2", "--vpp", "2"]),
    "pp2-dp2-zero3": (4, ["--pp", "2", "--zero-stage", "3"]),
}


def test_sharded_training_matches_one_process(tiny_data, tmp_path):
    prefix, tok = tiny_data
    args = [*TINY, "--data-path", prefix, "--tokenizer-model", tok, "--train-iters", str(STEPS),
            *DEEPSEEK]  # fmt: skip
    one, _ = pretrain(1, args, tmp_path)
    baseline = [r["loss"] for r in one]
    assert len(baseline) == STEPS and baseline[-1] < baseline[0]  # it learns
    for name, (world, layout) in LAYOUTS.items():
        rows, _ = pretrain(world, [*args, *layout], tmp_path)
        losses = [r["loss"] for r in rows]
        assert len(losses) == STEPS, name
        for step, (a, b) in enumerate(zip(losses, baseline), 1):
            assert abs(a - b) <= 1e-4 * abs(b), f"{name} step {step}: {a} vs one process {b}"


MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16",
       "--moe-shared-expert-intermediate-size", "16", "--moe-router-score-function", "sigmoid",
       "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "1e-2",
       "--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
       "--moe-router-topk-scaling-factor", "2.5", "--moe-dense-layers", "0"]  # fmt: skip


def test_with_experts_trains_at_tp2_pp2_dp2_ep2_like_one_process(tiny_data, tmp_path):
    """MLA, DeepSeek-V3's MoE from layer 1 on (the MTP modules' layers too) and MTP; also with
    the experts split over etp 2 inside ep 2."""
    prefix, tok = tiny_data
    args = [*TINY, "--data-path", prefix, "--tokenizer-model", tok, "--train-iters", str(STEPS),
            *DEEPSEEK, *MOE]  # fmt: skip
    one, _ = pretrain(1, args, tmp_path)
    baseline = [r["loss"] for r in one]
    assert len(baseline) == STEPS and baseline[-1] < baseline[0]
    layouts = {
        "tp2-pp2-ep2-sp": (8, ["--tp", "2", "--pp", "2", "--ep", "2", "--sequence-parallel"]),
        # expert tensor parallelism: each expert's width over 2 ranks, beside tp2 attention
        "tp2-ep2-etp2": (4, ["--tp", "2", "--ep", "2", "--expert-tensor-parallel-size", "2"]),
    }
    for name, (world, layout) in layouts.items():
        rows, _ = pretrain(world, [*args, *layout], tmp_path)
        losses = [r["loss"] for r in rows]
        assert len(losses) == STEPS, name
        for step, (a, b) in enumerate(zip(losses, baseline), 1):
            assert abs(a - b) <= 1e-4 * abs(b), f"{name} step {step}: {a} vs one process {b}"
