"""Qwen3's per-head norms, an explicit head_dim and scaled RoPE through the Triton kernels (the
interpreter here) match the torch ops; a sliding window, which the Triton attention lacks, warns
once and runs the torch reference (validate() refuses --kernels triton with a window)."""

import pytest
import torch
from megalite.kernels import TORCH_OPS, select

from megalite.config import ModelConfig
from megalite.model.gpt import GPTChunk


def _loss_and_grads(cfg, ops):
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, cfg.seq_length))
    labels = torch.randint(0, cfg.vocab_size, (1, cfg.seq_length))
    model = GPTChunk(cfg, ops=ops, seed=3)
    loss = model(ids, labels)
    loss.backward()
    return loss, {n: p.grad for n, p in model.named_parameters()}


def test_qwen3_with_yarn_rope_matches_torch(recwarn):
    cfg = ModelConfig(flavour="qwen3", num_layers=1, hidden_size=64, num_attention_heads=2,
                      num_query_groups=1, kv_channels=16, seq_length=24, vocab_size=250,
                      make_vocab_size_divisible_by=64, rope_scaling="yarn",
                      rope_scaling_factor=4.0, rope_original_max_position_embeddings=8)  # fmt: skip
    loss_t, grads_t = _loss_and_grads(cfg, TORCH_OPS)
    loss_k, grads_k = _loss_and_grads(cfg, select("triton", "cpu"))
    assert not [str(w.message) for w in recwarn]  # no fallback to the torch ops
    torch.testing.assert_close(loss_k, loss_t, rtol=1e-5, atol=1e-6)
    assert "layers.0.attention.q_norm.weight" in grads_t and grads_k.keys() == grads_t.keys()
    for name, g in grads_t.items():
        torch.testing.assert_close(grads_k[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_a_window_falls_back_to_the_torch_attention():
    ops = select("triton", "cpu")
    q, k, v = torch.randn(3, 1, 2, 20, 16).unbind(0)
    with pytest.warns(UserWarning, match="sliding window"):
        out = ops.attention(q, k, v, window=5)
    assert torch.equal(out, TORCH_OPS.attention(q, k, v, window=5))
    assert not torch.allclose(out, TORCH_OPS.attention(q, k, v))
