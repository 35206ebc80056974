import pytest
import torch
import torch.nn.functional as F

from megalite.checkpoint.hf import from_hf, hf_config, to_hf
from megalite.config import ModelConfig
from megalite.model.env import LayerEnv
from megalite.model.gpt import GPTChunk

transformers = pytest.importorskip("transformers")


def small(flavour, **kw):
    base = dict(
        flavour=flavour,
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        seq_length=24,
        vocab_size=250,
        make_vocab_size_divisible_by=64,
    )
    if flavour == "llama":
        base["num_query_groups"] = 2
    return ModelConfig(**{**base, **kw})


def hf_model(cfg):
    conf = hf_config(cfg)
    if cfg.features.hf_model_type == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(**conf)).eval()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**conf)).eval()


@pytest.mark.parametrize("flavour", ["gpt2", "nanogpt", "llama"])
def test_logits_equal_transformers(flavour):
    torch.manual_seed(0)
    cfg = small(flavour)
    ours = GPTChunk(cfg, LayerEnv(seed=3)).eval()
    theirs = hf_model(cfg)
    # our initialised weights into transformers' model
    missing, unexpected = theirs.load_state_dict(to_hf(ours.state_dict(), cfg), strict=False)
    assert not unexpected and all("rotary" in m or "attn.bias" in m for m in missing), (
        missing,
        unexpected,
    )
    ids = torch.randint(0, cfg.vocab_size, (3, cfg.seq_length))
    with torch.no_grad():
        a = ours(ids)
        b = theirs(ids).logits
    assert a.shape == b.shape == (3, cfg.seq_length, cfg.vocab_size)
    assert (a - b).abs().max().item() <= 1e-5
    # and transformers' (randomly initialised) weights into ours: the mapping is a bijection
    theirs2 = hf_model(cfg)
    ours2 = GPTChunk(cfg, LayerEnv(seed=9)).eval()
    ours2.load_full_state(from_hf(theirs2.state_dict(), cfg))
    with torch.no_grad():
        assert (ours2(ids) - theirs2(ids).logits).abs().max().item() <= 1e-5
    back = to_hf(ours2.state_dict(), cfg)
    for k, v in back.items():
        assert torch.equal(v, theirs2.state_dict()[k]), k
    # loss equals transformers' loss too (padding excluded from the softmax)
    with torch.no_grad():
        ours_loss = ours(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
        hf_loss = theirs(ids, labels=ids).loss
    assert abs(ours_loss.item() - hf_loss.item()) <= 1e-5


def _nanogpt_loss(w: dict, ids, labels, cfg):
    """nanoGPT's model (bias=False) in plain torch over megalite's tensors `w`: learned
    positions, pre-norm LayerNorms without bias, causal attention, exact GELU, tied output."""
    h, heads, eps = cfg.hidden_size, cfg.num_attention_heads, cfg.norm_epsilon
    b, s = ids.shape
    x = w["embedding.word.weight"][ids] + w["embedding.position.weight"][:s]
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        y = F.layer_norm(x, (h,), w[p + "input_norm.weight"], None, eps)
        q, k, v = (F.linear(y, w[p + f"attention.{n}.weight"]).view(b, s, heads, -1).transpose(1, 2)
                   for n in "qkv")  # fmt: skip
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        x = x + F.linear(o.reshape(b, s, h), w[p + "attention.out.weight"])
        y = F.layer_norm(x, (h,), w[p + "post_attention_norm.weight"], None, eps)
        y = F.gelu(F.linear(y, w[p + "mlp.up.weight"]))  # nn.GELU(): erf
        x = x + F.linear(y, w[p + "mlp.down.weight"])
    x = F.layer_norm(x, (h,), w["final_norm.weight"], None, eps)
    logits = F.linear(x, w["embedding.word.weight"])  # tied
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_nanogpt_flavour_is_nanogpts_model():
    """fp64, one process: loss and every gradient equal nanoGPT's model given the same weights;
    its parameters are GPT-2's without a single bias."""
    cfg = small("nanogpt", vocab_size=256)  # a multiple of 64: no padded rows
    ours = GPTChunk(cfg, LayerEnv(seed=4, dtype=torch.float64))
    h, f, L, V, s = cfg.hidden_size, cfg.ffn, cfg.num_layers, cfg.vocab_size, cfg.seq_length
    assert not [n for n, _ in ours.named_parameters() if n.endswith("bias")]
    per_layer = 4 * h * h + 2 * h * f + 2 * h  # q, k, v, out; up, down; two norm weights
    assert sum(p.numel() for p in ours.parameters()) == V * h + s * h + L * per_layer + h
    w = {n: p.detach().clone().requires_grad_() for n, p in ours.named_parameters()}
    ids = torch.randint(0, V, (3, s + 1), generator=torch.Generator().manual_seed(2))
    loss, expected = ours(ids[:, :-1], ids[:, 1:]), _nanogpt_loss(w, ids[:, :-1], ids[:, 1:], cfg)
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-12)
    loss.backward()
    expected.backward()
    for n, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, w[n].grad, rtol=0, atol=1e-12, msg=n)


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_tiny_model_overfits_a_batch(flavour):
    torch.manual_seed(0)
    cfg = small(flavour, vocab_size=64)
    model = GPTChunk(cfg, LayerEnv(seed=1))
    ids = torch.randint(0, cfg.vocab_size, (4, cfg.seq_length + 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(60):
        loss = model(ids[:, :-1], ids[:, 1:])
        first = first or loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first / 10, (first, loss.item())


def test_init_depends_on_seed_and_name_only():
    cfg = small("llama")
    a = GPTChunk(cfg, LayerEnv(seed=5)).state_dict()
    b = GPTChunk(
        cfg, LayerEnv(seed=5), layers=[1], has_embedding=False
    ).state_dict()  # a later pipeline stage
    assert torch.equal(a["layers.1.mlp.up.weight"], b["layers.1.mlp.up.weight"])
    assert torch.equal(a["output.weight"], b["output.weight"])
    assert not torch.equal(a["layers.0.mlp.up.weight"], a["layers.1.mlp.up.weight"])
    c = GPTChunk(cfg, LayerEnv(seed=6)).state_dict()
    assert not torch.equal(a["layers.1.mlp.up.weight"], c["layers.1.mlp.up.weight"])
    padded = GPTChunk(
        small("llama", make_vocab_size_divisible_by=128), LayerEnv(seed=5)
    ).state_dict()
    assert torch.equal(padded["embedding.word.weight"][:250], a["embedding.word.weight"][:250])
    assert padded["embedding.word.weight"][250:].abs().sum() == 0
