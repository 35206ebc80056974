"""plan/memory.py against megalite itself: the parameter list of the meta-device model, and
the bytes of parameters, gradients and optimizer state DistributedOptimizer allocates (sharded
layouts: tests/distributed/test_ledger.py)."""

import pytest
import torch

from megalite.model.env import LayerEnv
from megalite.model.gpt import GPTChunk
from megalite.optim.distributed_optimizer import build_optimizer
from megalite.parallel.comm import Group
from megalite.parallel.groups import single_process_groups
from megalite.parallel.specs import spec_of
from megalite.pipeline.partition import rank_chunks
from megalite.plan import memory
from megalite.plan.layouts import layout
from tests.unit.plan_configs import tiny


@pytest.mark.parametrize("flavour", ["gpt2", "nanogpt", "llama"])
@pytest.mark.parametrize("tp, sequence_parallel", [(1, False), (2, False), (2, True), (4, True)])
def test_parameters_are_gpt_chunks(flavour, tp, sequence_parallel):
    """Names, sizes and the TP gradient sum in registration order, the first and the last
    stage (the planner expands one meta-device layer to many)."""
    m = tiny(flavour, layers=4, num_query_groups=2 if flavour == "llama" else None).model
    group = Group("tp", list(range(tp)), tp - 1)  # building a chunk needs no process group
    for kw in rank_chunks(4, 2, 1, 0) + rank_chunks(4, 2, 1, 1):
        chunk = GPTChunk(m, LayerEnv(tp=group, sequence_parallel=sequence_parallel), **kw)
        real = [(n, p.numel(), "tp" in spec_of(p).grad_sum)
                for n, p in chunk.named_parameters()]  # fmt: skip
        assert memory.chunk_params(m, tp, **kw, sequence_parallel=sequence_parallel) == real


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_buffers_one_process(precision):
    """Parameters, gradients and optimizer state: exactly what DistributedOptimizer allocates
    (small buckets, so several are cut and padded). Sharded layouts: tests/distributed."""
    cfg = tiny("gpt2", layers=3)
    cfg.training.precision, cfg.optimizer.bucket_size_mb = precision, 0.05
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    opt = build_optimizer(
        [GPTChunk(cfg.model, LayerEnv(dtype=dtype))], single_process_groups(), cfg
    )
    mem = memory.state_memory(cfg, layout(cfg), 0)
    buf = opt.buffer
    assert len(buf.buckets) == len(memory.buckets(cfg, layout(cfg), 0)) > 2
    assert mem["params"] == buf.param_buffer.numel() * buf.param_buffer.element_size()
    assert mem["grads"] == buf.grad_buffer.numel() * buf.grad_buffer.element_size()
    assert mem["optimizer"] == opt.state_bytes()


@pytest.mark.parametrize("first_last", [False, True])
def test_zero3_fp8_buckets_are_the_buffers(first_last):
    """ZeRO-3 with FP8 linears: the planner lays out Zero3Buffer's buckets (the FP8 weights of
    each unit in a bucket of their own, the MTP modules' in the outer unit's, none for the
    layers --fp8-first-last-layers-bf16 keeps high), and its gathered peak at 1 byte per FP8
    element with --fp8-param-gather."""
    from megalite.kernels import fp8, fp8_linear

    from megalite import kernels

    cfg = tiny("llama", layers=3, mtp_num_layers=1)
    t = cfg.training
    t.fp8_format, t.fp8_param_gather, t.fp8_first_last_layers_bf16 = "hybrid", True, first_last
    cfg.optimizer.zero_stage = 3
    maker = fp8_linear.Fp8Maker(fp8.make_recipe("tensorwise"), first_last_high=first_last)
    chunks = [
        GPTChunk(cfg.model, LayerEnv(ops=kernels.override(kernels.TORCH_OPS, fp8_linear=maker)))
    ]
    opt = build_optimizer(chunks, single_process_groups(), cfg)
    lay = layout(cfg, zero=3)
    assert [e - s for s, e, _ in memory.buckets(cfg, lay, 0)] == [
        b.numel for b in opt.buffer.buckets
    ]
    assert len(opt.buffer._fp8) == (2 if first_last else 4)  # layers (not 0, 2) and MTP
    chunks[0](torch.randint(500, (2, 64)), torch.randint(500, (2, 64))).backward()
    peak = opt.memory_bytes()["param_gathered_peak_bytes"]
    assert peak == memory.zero3_units(cfg, lay, 0)["forward"][0]


def test_default_buckets_grow_with_dp():
    """The default bucket is 25 MB, or 2^20 elements per data-parallel rank when larger
    (buckets.bucket_numel): at dp=256 a 1.3B model's gradients are cut into fewer, larger buckets,
    each rank's piece of a bucket staying 2^20 elements; --bucket-size-mb still wins."""
    from megalite.parallel.buckets import bucket_numel
    from tests.unit.plan_configs import big

    assert bucket_numel(None, 1, 4) == 25 * 2**18 and bucket_numel(None, 256, 4) == 2**28
    assert bucket_numel(None, 256, 2) == 2**28 and bucket_numel(0.5, 256, 4) == 2**17
    cfg = big("llama", 24, 2048, 16, 2048, 32000, 1, 256)
    small, large = (memory.buckets(cfg, layout(cfg, dp=d, zero=1), 0) for d in (1, 256))
    sizes = [e - s for s, e, _ in large]
    assert len(large) < len(small) / 10 and max(sizes) >= 2**28
    cfg.optimizer.bucket_size_mb = 25.0
    assert len(memory.buckets(cfg, layout(cfg, dp=256, zero=1), 0)) >= len(small)


def test_expert_slices_over_etp_are_planned():
    """--expert-tensor-parallel-size: each rank holds 1/etp of its experts' weights and shards
    their optimizer state over edp = tp*dp/(ep*etp); the planner's buckets are those slices."""
    cfg = tiny("llama", layers=2, num_experts=4, moe_ffn_hidden_size=32)
    cfg.training.global_batch_size = 8
    cfg.parallel.ep = 2
    whole = memory.buckets(cfg, layout(cfg, tp=2, dp=2), 0, experts=True)
    cfg.parallel.etp = 2
    shape = layout(cfg, tp=2, dp=2)
    sliced = memory.buckets(cfg, shape, 0, experts=True)
    numel = lambda bs: sum(k for _, _, ranges in bs for _, _, k, _ in ranges)  # noqa: E731
    assert numel(sliced) * 2 == numel(whole) > 0
    assert memory.expert_parallel(shape) == (2, 1)
