"""plan/compute.py: the time by shape: GEMMs by size, attention by sequence, memory-bound ops by
bytes, instead of one MFU for every layout."""

import pytest

from megalite.plan import compute, layouts
from megalite.plan.compute import GPUS, gemm_seconds
from megalite.plan.ranking import Cluster, step_parts
from tests.unit.plan_configs import big, flops

H100 = GPUS["h100"]
PEAK = 989e12


def tflops(m, n, k, gpu=H100):
    return 2 * m * n * k / gemm_seconds(gpu, gpu.peak_tflops * 1e12, m, n, k, 2) / 1e12


def test_large_gemms_reach_the_sustained_mamf_and_small_ones_less():
    big_gemm = tflops(16384, 16384, 16384)
    assert big_gemm == pytest.approx(PEAK / 1e12 * H100.mamf * compute.SUSTAINED, rel=0.05)
    # narrower and shallower: less of the peak, never more
    sizes = [tflops(8192, n, k) for n, k in ((16384, 8192), (2048, 2048), (512, 512), (64, 64))]
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] < 0.1 * big_gemm
    # one wave and a tile more leaves most of the second wave idle
    full = tflops(128 * 132, 256, 8192)
    assert tflops(128 * 133, 256, 8192) < 0.6 * full
    # memory-bound: a GEMV moves its weight at the HBM bandwidth
    gemv = gemm_seconds(H100, PEAK, 1, 8192, 8192, 2)
    assert gemv >= 8192 * 8192 * 2 / (H100.hbm_tbps * 1e12)


def test_a_faster_memory_speeds_the_memory_bound_ops_not_the_gemms():
    cfg = big("llama", 4, 4096, 32, 4096, 32000, mbs=1, gbs=8)
    shape = layouts.layout(cfg, tp=1)
    h100 = compute.layer_seconds(cfg, shape, False, H100, PEAK)
    h200 = compute.layer_seconds(cfg, shape, False, GPUS["h200"], PEAK)
    assert h200["gemm"] == pytest.approx(h100["gemm"], rel=0.01)
    assert h200["memory"] == pytest.approx(h100["memory"] * 3.35 / 4.8)


def test_narrow_expert_gemms_cost_more_per_flop_than_dense_ones():
    """The issue's case: at tp8 a 2,048-wide expert slice is 256 wide; the same FLOPs in one
    dense 16,384-wide GEMM take less time. The planner used to cost them the same (45% MFU)."""
    tokens, h = 8192, 8192
    narrow = 8 * gemm_seconds(H100, PEAK, tokens / 8, 256, h, 2)
    wide = gemm_seconds(H100, PEAK, tokens, 256, h, 2)
    assert narrow > 1.2 * wide
    dense = gemm_seconds(H100, PEAK, tokens, 16384, h, 2) / (16384 / 256)
    assert wide > 1.5 * dense


def test_attention_is_timed_by_sequence_and_cp():
    cfg = big("llama", 2, 4096, 32, 8192, 32000, mbs=1, gbs=8)
    one = compute.layer_seconds(cfg, layouts.layout(cfg, tp=1), False, H100, PEAK)["attention"]
    two = compute.layer_seconds(cfg, layouts.layout(cfg, tp=1, cp=2), False, H100, PEAK)
    assert two["attention"] == pytest.approx(one / 2)
    cfg.model.seq_length = 16384  # twice the tokens, each twice the keys, longer blocks faster
    four = compute.layer_seconds(cfg, layouts.layout(cfg, tp=1), False, H100, PEAK)["attention"]
    assert 3.8 * one < four < 4 * one


def test_the_step_uses_the_shape_model_unless_an_mfu_is_given():
    cfg = big("llama", 8, 2048, 16, 2048, 32000, mbs=1, gbs=64, precision="bf16")
    p = layouts.plan(cfg, layouts.layout(cfg, tp=2, dp=4, sequence_parallel=True), Cluster(8))
    by_shape = step_parts(cfg, p, Cluster(8), flops(cfg))
    mb = compute.microbatch_seconds(cfg, p.layout, Cluster(8))
    assert by_shape["compute"] == pytest.approx(p.microbatches * mb * 1.0, rel=0.05)
    flat = step_parts(cfg, p, Cluster(8, mfu=0.45), flops(cfg))["compute"]
    assert flat == pytest.approx(flops(cfg) * 64 * 2048 / 8 / (989e12 * 0.45), rel=0.05)
