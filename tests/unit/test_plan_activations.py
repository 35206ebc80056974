"""plan/activations.py against megalite itself: the bytes autograd saves for backward, and the
chunks in flight at the schedule's worst moment."""

import pytest
import torch
from megalite.kernels import fp8, fp8_linear

from megalite import kernels
from megalite.model.env import LayerEnv
from megalite.model.gpt import GPTChunk
from megalite.pipeline.partition import rank_chunks
from megalite.plan import activations
from megalite.plan.layouts import layout
from tests.unit.plan_configs import tiny


def saved_bytes(chunk, x, labels) -> int:
    """Bytes of the tensors autograd keeps for backward in one forward, each storage once,
    parameters and buffers left out."""
    skip = {t.untyped_storage().data_ptr() for t in [*chunk.parameters(), *chunk.buffers()]}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunk(x, labels)
    return sum(seen.values())


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_activations_match_saved_tensors(flavour):
    """One micro-batch through a first (embedding) and a middle chunk, fp32 on CPU: the
    planner's estimate against the bytes autograd saves (the contract: within 20%)."""
    cfg = tiny(flavour)
    b, s, h = 2, 64, 64
    for kw in ({"layers": range(2), "has_embedding": True, "has_head": True},
               {"layers": range(2), "has_embedding": False, "has_head": False}):  # fmt: skip
        chunk = GPTChunk(cfg.model, **kw)
        x = torch.randint(500, (b, s)) if kw["has_embedding"] else torch.randn(b, s, h)
        measured = saved_bytes(chunk, x.requires_grad_(x.is_floating_point()),
                               torch.randint(500, (b, s)))  # fmt: skip
        estimate, _ = activations.chunk_activations(cfg, layout(cfg), kw)
        assert abs(estimate / measured - 1) < 0.2, (kw, estimate, measured)


def test_interleaving_penalty():
    """Rank 0 keeps pp*vpp + pp - 1 chunks in flight: L (1 + (pp-1)/(pp vpp)) layers' worth
    (Korthikanti et al. 2022, section 4.2.3)."""
    cfg = tiny("gpt2", layers=8)
    cfg.training.global_batch_size = 16  # 8 micro-batches of 2
    lay = layout(cfg, pp=2, vpp=2)
    per_chunk, _ = activations.chunk_activations(
        cfg, lay, rank_chunks(8, 2, 2, 0)[1]
    )  # no embedding
    first, _ = activations.chunk_activations(cfg, lay, rank_chunks(8, 2, 2, 0)[0])
    # rank 0 runs F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 ...: after F3.0 five chunk activations
    # are alive (micro-batches 0-3 of chunk 0, 1 of chunk 1): 10 of the 8 layers' worth
    assert activations.peak_activations(cfg, lay, 0, 8) == 4 * first + per_chunk
    one_f_one_b = activations.peak_activations(cfg, layout(cfg, pp=2), 0, 8)
    assert (
        one_f_one_b
        == 2 * activations.chunk_activations(cfg, layout(cfg, pp=2), rank_chunks(8, 2, 1, 0)[0])[0]
    )


def test_p2p_tensors_follow_the_executors_batches():
    """buffers.P2PBuffers, in hidden tensors, on the last of two 1F1B stages (3 micro-batches):
    a received input counts with the activations from its forward; after its backward the
    batch that received it still holds it, as each input gradient sent; the oldest batch is
    let go when a fourth is posted (MAX_IN_FLIGHT)."""
    from megalite.plan.buffers import P2PBuffers

    steps = activations.schedule_steps("1f1b", 2, 1, 3, 1)
    walk = P2PBuffers(steps, 1)
    seen = [(f"{k}{c}.{m}", walk.step(k, c, m)) for k, c, m in steps]
    assert [n for _, n in seen] == [1, 1, 0, 2, 2, 3, 3, 2, 4, 4, 5, 5, 4, 6, 5], seen


def test_zero_bubble_v_places_the_head_on_the_first_rank():
    """The planner reads the schedule's placement: ZB-V's first rank holds the embedding and
    the head (the V turns on the last rank), not the interleaved one's last rank."""
    from megalite.plan.layouts import plan

    cfg = tiny("gpt2", layers=4)
    cfg.training.global_batch_size = 8
    cfg.parallel.pp_schedule = "zbv"
    p = plan(cfg, layout(cfg, pp=2, vpp=2))
    head = cfg.model.padded_vocab_size(1) * cfg.model.hidden_size
    assert p.stages[0]["numel"] - p.stages[1]["numel"] >= head, p.stages


@pytest.mark.parametrize("recipe", ["tensorwise", "mxfp8"])
def test_fp8_activations_match_saved_tensors(recipe):
    """FP8 linears through a middle chunk (fp32, llama): what they change in the bytes autograd
    saves (tensorwise: FP8 copies of inputs and weights instead of the high-precision inputs;
    mxfp8: the fused layers' concatenated weights, which an FP8 linear keeps and F.linear's
    fused path does not) is the planner's change, to the byte."""
    cfg = tiny("llama")
    kw = {"layers": range(2), "has_embedding": False, "has_head": False}
    x, labels = torch.randn(2, 64, 64, requires_grad=True), torch.randint(500, (2, 64))
    measured, estimate = [], []
    for on in (False, True):
        ops = kernels.TORCH_OPS
        cfg.training.fp8_format, cfg.training.fp8_recipe = ("hybrid" if on else None), recipe
        if on:
            ops = kernels.override(ops, fp8_linear=fp8_linear.Fp8Maker(fp8.make_recipe(recipe)))
        measured.append(saved_bytes(GPTChunk(cfg.model, LayerEnv(ops=ops), **kw), x, labels))
        estimate.append(activations.chunk_activations(cfg, layout(cfg), kw)[0])
    change, planned = measured[1] - measured[0], estimate[1] - estimate[0]
    assert planned == change, (measured, estimate)
    if recipe == "tensorwise":  # the check can fail: FP8 copies are a real change here
        assert change < -0.05 * measured[0] and planned < 0


def test_latent_attention_and_expert_activations_match_saved_tensors():
    """DeepSeek-V3's layers (MLA with a q latent, v narrower than q/k; a dense layer, then an
    MoE layer with a shared expert), fp32 on CPU, within 5%: MLA keeps no rotary inputs or
    unpadded q, its dense MLP keeps the fused gate/up weights (issue 47's fake world)."""
    m = dict(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
             v_head_dim=16, ffn_hidden_size=128, num_experts=4, moe_router_topk=2,
             moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32,
             moe_dense_layers=[0])  # fmt: skip
    cfg = tiny("deepseek_v3", **m)
    cfg.model.num_attention_heads = 8
    for layers in (range(0, 1), range(1, 2)):  # dense, then MoE
        kw = {"layers": layers, "has_embedding": False, "has_head": False}
        chunk = GPTChunk(cfg.model, **kw)
        x = torch.randn(2, 64, 64, requires_grad=True)
        measured = saved_bytes(chunk, x, None)
        estimate, _ = activations.chunk_activations(cfg, layout(cfg), kw)
        assert abs(estimate / measured - 1) < 0.05, (list(layers), estimate, measured)


def test_backward_working_counts_the_regathered_input(monkeypatch):
    """With sequence parallelism a fused block's backward gathers its input again
    (tensor_parallel._JoinedLinear): the planner's backward working memory grows by the tensor
    that backward allocates for it, (b, s, h), against the same layout without SP (the input
    gradient's reduce-scatter then fills this rank's rows, as the layer without SP fills the
    whole gradient). The collectives are stood in for (one process): the gather repeats this
    rank's rows, the reduce-scatter keeps the first."""
    import types

    from torch.utils._python_dispatch import TorchDispatchMode

    from megalite.parallel import comm, tensor_parallel
    from megalite.plan.buffers import backward_working

    def gather(out, t, group, async_op=False):
        out.copy_(torch.cat([t] * group.size))
        return types.SimpleNamespace(wait=lambda: None)

    def scatter(out, t, group, async_op=False):
        out.copy_(t[: out.shape[0]])
        return types.SimpleNamespace(wait=lambda: None)

    monkeypatch.setattr(comm, "all_gather", gather)
    monkeypatch.setattr(comm, "reduce_scatter", scatter)
    cfg = tiny("llama")  # fp32, micro-batch 2 of 64 tokens, h 64
    b, s, h = 2, 64, 64
    x = torch.randn(b, s // 2, h, requires_grad=True)  # this rank's rows
    weights = [torch.randn(32, h, requires_grad=True) for _ in range(3)]  # q, k, v on a rank
    y = tensor_parallel._joined_linear(comm.Group("tp", [0, 1], 0), 1, 3, x, *weights)
    made = []

    class Allocations(TorchDispatchMode):
        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.new_empty.default:
                made.append(out.nbytes)
            return out

    with Allocations():
        y.backward(torch.ones_like(y))
    kw = {"layers": range(2), "has_embedding": False, "has_head": False}
    split = backward_working(cfg, layout(cfg, tp=2, sequence_parallel=True), kw)
    assert made == [b * s * h * 4, b * s // 2 * h * 4]  # the rows again; the gradient's rows
    assert split - backward_working(cfg, layout(cfg, tp=2), kw) == made[0]


def test_forward_temporaries_are_counted():
    """A forward's widest temporary (SwiGLU's silu(gate) here, wider than the gathered input)
    is in the peak with buffers: the peak of the first forward alone is at least it."""
    from megalite.plan.activations import peaks
    from megalite.plan.buffers import forward_working
    from megalite.shape import validate
    from tests.unit.plan_configs import big

    cfg = big("llama", 4, 1024, 8, 512, 1000, mbs=2, gbs=2, precision="bf16")
    cfg.parallel.tp, cfg.parallel.sequence_parallel = 2, True
    shape = validate(cfg, 2)
    kw = shape.partition.rank_chunks(0)[0]
    fwd = forward_working(cfg, shape, kw)
    assert fwd == 2 * 512 * cfg.model.ffn / 2 * 2  # tokens · ffn/tp · bf16
    plain, peak = peaks(cfg, shape, 0, 1)
    assert peak >= plain + fwd
