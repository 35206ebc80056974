"""Multi-head latent attention through the Triton kernels (the interpreter here): q/k head dim
(nope + rope) != v head dim, v zero-padded to the q/k dim and q pre-scaled by yarn's mscale,
matches the torch ops, forward and every gradient, with no fallback to the torch attention."""

import torch
from megalite.kernels import TORCH_OPS, select

from megalite.config import ModelConfig
from tests.kernels.test_hf_families_kernels import _loss_and_grads

# q/k 12 + 4 = 16 (a Triton head dim), v 8 (padded to 16); yarn's mscale_all_dim scales q
MLA = dict(flavour="deepseek_v3", q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12,
           qk_rope_head_dim=4, v_head_dim=8, rope_scaling="yarn", rope_scaling_factor=4.0,
           rope_original_max_position_embeddings=8, yarn_mscale=1.0, yarn_mscale_all_dim=0.7)  # fmt: skip


def test_latent_attention_matches_torch(recwarn):
    cfg = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=2, seq_length=24,
                      vocab_size=250, make_vocab_size_divisible_by=64, **MLA)  # fmt: skip
    loss_t, grads_t = _loss_and_grads(cfg, TORCH_OPS)
    loss_k, grads_k = _loss_and_grads(cfg, select("triton", "cpu"))
    assert not [str(w.message) for w in recwarn]  # no fallback to the torch ops
    torch.testing.assert_close(loss_k, loss_t, rtol=1e-5, atol=1e-6)
    assert grads_k.keys() == grads_t.keys()
    for name, g in grads_t.items():
        torch.testing.assert_close(grads_k[name], g, rtol=1e-4, atol=1e-6, msg=name)
