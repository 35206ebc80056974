"""The model recipes of docs/extending.md, exercised from a test module without editing megalite/:

- a linear through the ops seam (`kernels.override(ops, linear=...)`): it sees every matmul
  with a weight and, computing F.linear, trains bit for bit like the default;
- an attention variant through the same seam (the reference attention written out as scores,
  mask and softmax): it trains like the default to fp64 rounding;
- a new flavour: one row of `FLAVOURS` (a Qwen-style model, biases on q, k, v only);
- compiled blocks: `layer.compile()` on each transformer layer gives eager's forward and backward.
"""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from megalite import kernels
from megalite.config_read import from_dict
from megalite.model.env import LayerEnv
from megalite.model.gpt import GPTChunk
from megalite.model_config import FLAVOURS, ModelConfig, ModelFeatures
from megalite.parallel.comm import Group


def small(flavour="llama", **kw):
    base = dict(flavour=flavour, num_layers=2, hidden_size=32, num_attention_heads=4,
                num_query_groups=2, seq_length=12, vocab_size=80, make_vocab_size_divisible_by=16)  # fmt: skip
    return ModelConfig(**{**base, **kw})


def train(cfg, ops=kernels.TORCH_OPS, steps=3):
    """Losses of `steps` AdamW steps on one batch (fp64) and the final parameters."""
    model = GPTChunk(cfg, LayerEnv(ops=ops, seed=7, dtype=torch.float64))
    ids = torch.randint(
        0, cfg.vocab_size, (3, cfg.seq_length + 1), generator=torch.Generator().manual_seed(0)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = model(ids[:, :-1], ids[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


# ---- a kernel or precision: the linear seam ----------------------------------------------------


class CountingLinear:
    """A stand-in for an FP8 linear: counts its calls and computes what F.linear does."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x, w, b=None):
        self.calls += 1
        return F.linear(x, w, b)


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_a_linear_through_the_seam_trains_like_the_default(flavour):
    cfg = small(flavour)
    linear = CountingLinear()
    ops = kernels.override(kernels.TORCH_OPS, linear=linear)
    losses, params = train(cfg)
    got, got_params = train(cfg, ops)
    assert got == losses  # bit for bit
    for n, p in params.items():
        assert torch.equal(p, got_params[n]), n
    # every matmul with a weight: per layer q/k/v (fused), out, up (with gate), down; the head
    assert linear.calls == 3 * (4 * cfg.num_layers + 1)
    assert kernels.TORCH_OPS.linear is F.linear  # override left the default alone


def test_the_router_and_the_shared_expert_go_through_the_seam():
    cfg = small(num_experts=4, moe_shared_expert_intermediate_size=16)
    linear = CountingLinear()
    model = GPTChunk(cfg, LayerEnv(ops=kernels.override(kernels.TORCH_OPS, linear=linear), seed=7))
    model(torch.zeros(1, cfg.seq_length, dtype=torch.long))
    # per layer: q/k/v, out, the router, the shared expert's gate/up and down; the head
    assert linear.calls == 5 * cfg.num_layers + 1


def test_override_refuses_an_op_the_model_does_not_call():
    with pytest.raises(ValueError, match="no op named lineer"):
        kernels.override(kernels.TORCH_OPS, lineer=F.linear)


# ---- an attention variant: the attention seam --------------------------------------------------


def explicit_attention(q, k, v, dropout_p=0.0):
    """Causal attention as scores, mask and softmax: q (b, hq, s, d), k, v (b, hkv, s, d)."""
    assert dropout_p == 0.0
    explicit_attention.calls += 1
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q.shape[2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (b, hq, s, s)
    future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    return scores.masked_fill(future, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_an_attention_variant_trains_like_the_default(flavour):
    cfg = small(flavour)
    explicit_attention.calls = 0
    losses, params = train(cfg)
    got, got_params = train(cfg, kernels.override(kernels.TORCH_OPS, attention=explicit_attention))
    assert explicit_attention.calls == 3 * cfg.num_layers
    assert got == pytest.approx(losses, rel=1e-12, abs=0)
    for n, p in params.items():
        assert (p - got_params[n]).abs().max().item() <= 1e-10, n


# ---- a new flavour: a row of features ---------------------------------------------------------


def test_a_new_flavour_is_a_row_of_features(monkeypatch):
    qwen = ModelFeatures("rmsnorm", "rotary", gated_mlp=True, qkv_bias=True, linear_bias=False,
                         tied=False, hf_model_type="qwen2", doc="Llama with q, k, v biases")  # fmt: skip
    monkeypatch.setitem(FLAVOURS, "qwen-style", qwen)
    assert from_dict({"model": {"flavour": "qwen-style"}}).model.features is qwen  # --flavour
    cfg = small("qwen-style")
    assert cfg.ffn == small("llama").ffn and not cfg.tied
    names = {n for n, _ in GPTChunk(cfg, LayerEnv(seed=1)).named_parameters()}
    assert {f"layers.0.attention.{x}.bias" for x in "qkv"} <= names
    assert not {"layers.0.attention.out.bias", "layers.0.mlp.up.bias"} & names
    assert "embedding.position.weight" not in names and "output.weight" in names
    assert not any(n.endswith("norm.bias") for n in names)
    lay = GPTChunk(cfg, LayerEnv(seed=1)).layers["0"].attention
    assert lay.rope.cos.shape == (cfg.seq_length, cfg.head_dim // 2)
    gpt2_like = dataclasses.replace(qwen, norm="layernorm", position="learned", gated_mlp=False)
    monkeypatch.setitem(FLAVOURS, "qwen-style", gpt2_like)
    names = {n for n, _ in GPTChunk(small("qwen-style"), LayerEnv(seed=1)).named_parameters()}
    assert {"embedding.position.weight", "layers.0.input_norm.bias"} <= names
    assert "layers.0.mlp.gate.weight" not in names


# ---- sequence parallelism: one switch per chunk ------------------------------------------------


def test_full_sequences_turns_off_every_layer_through_one_switch():
    tp = Group("tp", [0, 1], 0)  # built only: no collective runs
    cfg = small(num_experts=2, moe_layer_freq=2)
    chunk = GPTChunk(cfg, LayerEnv(tp=tp, sequence_parallel=True, device="meta"))
    holders = [m for m in chunk.modules() if "sequence_parallel" in vars(m)]
    assert len(holders) >= 15  # the embedding; per layer itself, attention, its linears, MLP
    assert all(m.sequence_parallel is chunk.sequence_parallel for m in holders)
    assert chunk.sequence_parallel
    with chunk.full_sequences():
        assert not any(m.sequence_parallel for m in holders)
    assert all(m.sequence_parallel for m in holders)


# ---- compiled blocks ------------------------------------------------------------------------


def _compiled_matches_eager(flavour, parts=None, recompute="none", **compile_kw):
    """`parts`: compile these submodules of each layer instead of the whole layer."""
    cfg = small(flavour, num_layers=1, hidden_dropout=0.0)
    eager = GPTChunk(cfg, LayerEnv(seed=1, dtype=torch.float64, recompute=recompute))
    compiled = GPTChunk(cfg, LayerEnv(seed=1, dtype=torch.float64, recompute=recompute))
    for layer in compiled.layers.values():
        for part in [getattr(layer, p) for p in parts] if parts else [layer]:
            part.compile(**compile_kw)  # in place: parameter names stay logical
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    ids = torch.randint(
        0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=torch.Generator().manual_seed(0)
    )
    for model in (eager, compiled):
        model(ids[:, :-1], ids[:, 1:]).backward()
    a, b = eager(ids[:, :-1], ids[:, 1:]), compiled(ids[:, :-1], ids[:, 1:])
    assert (a - b).abs().item() <= 1e-12
    for (n, p), (_, q) in zip(eager.named_parameters(), compiled.named_parameters()):
        assert (p.grad - q.grad).abs().max().item() <= 1e-12, n


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_a_compiled_block_traces_whole_and_matches_eager(flavour):
    """fullgraph: a layer at tp=1 is one graph (no break in the seams or the SP switch)."""
    _compiled_matches_eager(flavour, backend="aot_eager", fullgraph=True)


@pytest.mark.parametrize(
    "recompute,parts", [("full", ("attention", "mlp")), ("selective", ("mlp",))]
)
def test_with_recompute_the_parts_inside_the_checkpoint_compile(recompute, parts):
    """torch.utils.checkpoint with the RNG replay (`context_fn`) stays outside the compiled
    region: dynamo fails on it (a bound context_fn), so the recipe compiles what it wraps."""
    _compiled_matches_eager("llama", parts, recompute, backend="aot_eager")


@pytest.mark.slow
def test_an_inductor_compiled_block_matches_eager():
    """The default backend generates C++ on CPU (needs a compiler; about a minute)."""
    _compiled_matches_eager("llama")
