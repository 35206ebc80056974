"""Qwen3's per-head norms, an explicit head_dim and scaled RoPE through the Triton kernels (the
interpreter here) match the torch ops; so does Mistral's sliding window in the attention kernels
(causal, masked positions with documents, ring blocks), forward and backward, as exact as torch."""

import pytest
import torch
from megalite.kernels import TORCH_OPS, select
from megalite.kernels.attention import (
    _tile_lists,
    attention,
    attention_masked,
    attention_masked_ref,
    attention_ref,
)
from megalite.kernels.attention_blocks import (
    attention_block_bwd,
    attention_block_bwd_ref,
    attention_block_fwd,
    attention_block_fwd_ref,
)

from megalite.config import ModelConfig
from megalite.model.env import LayerEnv
from megalite.model.gpt import GPTChunk
from tests.kernels.helpers import ATOL, check_op, make


def _loss_and_grads(cfg, ops):
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, cfg.seq_length))
    labels = torch.randint(0, cfg.vocab_size, (1, cfg.seq_length))
    model = GPTChunk(cfg, LayerEnv(ops=ops, seed=3))
    loss = model(ids, labels)
    loss.backward()
    return loss, {n: p.grad for n, p in model.named_parameters()}


QWEN3_YARN = dict(
    flavour="qwen3",
    num_query_groups=1,
    kv_channels=16,
    rope_scaling="yarn",
    rope_scaling_factor=4.0,
    rope_original_max_position_embeddings=8,
)
MISTRAL = dict(flavour="mistral", sliding_window=7)


@pytest.mark.parametrize("case", [QWEN3_YARN, MISTRAL], ids=["qwen3-yarn", "mistral-window"])
def test_model_matches_torch(case, recwarn):
    cfg = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=2, seq_length=24,
                      vocab_size=250, make_vocab_size_divisible_by=64, **case)  # fmt: skip
    loss_t, grads_t = _loss_and_grads(cfg, TORCH_OPS)
    loss_k, grads_k = _loss_and_grads(cfg, select("triton", "cpu"))
    assert not [str(w.message) for w in recwarn]  # no fallback to the torch ops
    torch.testing.assert_close(loss_k, loss_t, rtol=1e-5, atol=1e-6)
    assert grads_k.keys() == grads_t.keys()
    for name, g in grads_t.items():
        torch.testing.assert_close(grads_k[name], g, rtol=1e-4, atol=1e-6, msg=name)


def _qkv(b, hq, hkv, s, d, dtype):
    q = make((b, s, hq * d), dtype).view(b, s, hq, d).transpose(1, 2)  # the model's layout
    return q, make((b, hkv, s, d), dtype), make((b, hkv, s, d), dtype, noncontig=True)


@pytest.mark.parametrize("s,window", [(37, 5), (150, 40), (150, 64), (70, 1), (20, 100)])
def test_sliding_window_attention_kernel(dtype, s, window):
    """Causal attention with a window: forward and every gradient as exact as torch's; the
    windows cross tile edges (64 under the interpreter), cover one key, or the whole row."""
    torch.manual_seed(0)
    check_op(lambda q, k, v: attention(q, k, v, window=window),
             lambda q, k, v: attention_ref(q, k, v, window=window), _qkv(1, 4, 2, s, 16, dtype))  # fmt: skip


def test_sliding_window_masked_and_ring_blocks(dtype):
    """Positions in a load-balanced order with documents, and one ring block of them."""
    torch.manual_seed(1)
    s, w = 96, 20
    perm = torch.cat([torch.arange(0, 24), torch.arange(72, 96), torch.arange(24, 72)])
    doc = (torch.arange(s) >= 50).long()[perm]
    check_op(lambda q, k, v: attention_masked(q, k, v, perm, perm, doc, doc, window=w),
             lambda q, k, v: attention_masked_ref(q, k, v, perm, perm, doc, doc, window=w),
             _qkv(2, 2, 1, s, 32, dtype))  # fmt: skip
    q, k, v = (t.detach() for t in _qkv(1, 2, 2, 48, 16, dtype))
    qp, kp = torch.arange(48, 96), torch.arange(30, 78)  # keys overlapping the window's edge
    out, lse = attention_block_fwd(q, k, v, qp, kp, window=w)
    out_r, lse_r = attention_block_fwd_ref(q, k, v, qp, kp, window=w)
    torch.testing.assert_close(out, out_r, rtol=0, atol=ATOL[dtype] * 4)
    torch.testing.assert_close(lse, lse_r, rtol=0, atol=ATOL[dtype] * 4)
    dout = torch.randn_like(q)
    for g, g_r in zip(attention_block_bwd(q, k, v, out, lse, dout, qp, kp, window=w),
                      attention_block_bwd_ref(q, k, v, out, lse, dout, qp, kp, window=w)):  # fmt: skip
        torch.testing.assert_close(g, g_r, rtol=0, atol=ATOL[dtype] * 8)


def test_window_tiles_skip_what_no_query_sees():
    p = torch.arange(128)[None]
    cnt, _ = _tile_lists(p, p, None, None, 32, 32, 128, by_key=False, window=16)
    assert cnt.tolist() == [[[0, 0, 0, 0], [1, 2, 2, 2]]]  # the diagonal tile and the one before
    cnt, _ = _tile_lists(p, p, None, None, 32, 32, 128, by_key=False, window=80)
    assert cnt.tolist() == [[[0, 1, 1, 1], [1, 1, 2, 3]]]  # the last row: tiles 0, 1 partly
