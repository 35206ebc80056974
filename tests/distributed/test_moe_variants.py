"""The new MoE architectures train with the real Trainer like one process, in one spawn of 8
ranks: Qwen3-MoE (QK-norm, head_dim 16, a dense layer by --moe-dense-layers) and gpt-oss's model
(attention sinks, alternating sliding/full layers, biased router and experts, clamped SwiGLU) at
the full layout tp2·pp2·dp2 with ep2 (Qwen3-MoE sequence parallel at ZeRO-1; gpt-oss without
SP), a DeepSeek-V3-style router (sigmoid scores, the auxiliary-loss-free expert bias moved after
every step, node-limited groups, a scaling factor, a shared expert, the first layer dense) at
ep2·tp2 (experts over TP, dp 4) and ep2·pp2 (the dense first layer and an MoE one on stage 0,
the expert bias update over both stages), and a dense gpt-oss at cp2·tp2·dp2 (its sinks and
alternating windows through ring attention). 5 steps each, losses within 1e-4 of the single
process per step and final parameters (expert biases included) within 1e-4 (fp32).
"""

import functools

import pytest

from megalite.parallel.groups import single_process_groups
from megalite.testing import spawn
from tests.distributed.test_moe_training import config, params, trainer

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
STEPS = 5
MODELS = {  # name: ModelConfig fields over test_moe_training's tiny llama with 4 experts
    "qwen3-moe": {"flavour": "qwen3", "kv_channels": 16, "moe_dense_layers": [1]},
    "deepseek": {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                 "moe_router_bias_update_rate": 1e-2, "moe_router_num_groups": 2,
                 "moe_router_group_topk": 1, "moe_router_topk_scaling_factor": 2.5,
                 "moe_shared_expert_intermediate_size": 32, "moe_dense_layers": [0],
                 "num_layers": 4},
    "gpt-oss": {"flavour": "gpt_oss", "swiglu_limit": 1.0, "sliding_window": 4,
                "window_attn_skip_freq": 2},  # attention sinks too
    # dense (MoE does not run with cp): the sinks and alternating windows at cp2 (ring)
    "gpt-oss-dense": {"flavour": "gpt_oss", "sliding_window": 4, "window_attn_skip_freq": 2,
                      "num_experts": None},
}  # fmt: skip


def model_config(name: str, **parallel):
    cfg = config(**parallel)
    for k, v in MODELS[name].items():
        setattr(cfg.model, k, v)
    return cfg


@functools.cache
def single(name: str, steps: int):
    tr = trainer(model_config(name), 1, single_process_groups())
    init = {n: p.clone() for n, (p, _) in params(tr).items()}
    losses = [tr.train_step()["loss"] for _ in range(steps)]
    final = {n: p for n, (p, _) in params(tr).items()}
    # it trains: every parameter moved (8 small steps on fresh batches need not lower the loss)
    moved = min((final[n] - init[n]).abs().max().item() for n in final)
    return losses, final, moved


FULL = {"tp": 2, "pp": 2, "ep": 2}
RUNS = [  # (model, layout, parallel flags, steps), all at 8 ranks
    ("deepseek", "ep2 tp2 dp4", {"tp": 2, "ep": 2}, STEPS),
    ("deepseek", "ep2 pp2 dp4", {"pp": 2, "ep": 2}, STEPS),
    # the full layout: dp 2 beside tp2 and pp2, the experts over ep2 (edp 2); Qwen3-MoE
    # sequence parallel at ZeRO-1, gpt-oss without (the routed tokens' own split over TP)
    ("qwen3-moe", "ep2 tp2 pp2 dp2 sp zero1", {**FULL, "sequence_parallel": True, "zero_stage": 1},
     STEPS),
    ("gpt-oss", "ep2 tp2 pp2 dp2", FULL, STEPS),
    ("gpt-oss-dense", "cp2 tp2 dp2", {"tp": 2, "cp": 2}, STEPS),  # sinks through ring attention
]  # fmt: skip


def _run(rank, world):
    out = {}
    for name, layout, flags, steps in RUNS:
        tr = trainer(model_config(name, **flags), world)
        losses = [tr.train_step()["loss"] for _ in range(steps)]
        out[name, layout] = losses, params(tr)
    return out


def test_moe_variants_train_like_one_process():
    results = spawn(_run, 8, timeout=900)
    for name, layout, _, steps in RUNS:
        ref_losses, ref_params, moved = single(name, steps)
        assert moved > 1e-5, (name, moved)
        key = name, layout
        losses = next(r[key][0] for r in results if r[key][0][0] is not None)  # last stage's
        assert len(losses) == steps, key
        for step, (a, b) in enumerate(zip(losses, ref_losses), 1):
            assert abs(a - b) <= 1e-4 * abs(b), f"{key} step {step}: {a} vs one process {b}"
        for r in results:
            for n, (p, region) in r[key][1].items():
                full = ref_params[n][tuple(slice(lo, hi) for lo, hi in region)]
                if full.numel():
                    assert (p[: full.shape[0]] - full).abs().max() <= 1e-4, (key, n)
