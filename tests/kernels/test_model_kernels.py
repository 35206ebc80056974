"""A tiny model with kernels="triton" (the interpreter here) matches kernels="torch"."""

import warnings

import pytest
import torch
from megalite.kernels import select

from megalite.config import ModelConfig
from megalite.model.env import LayerEnv
from megalite.model.gpt import GPTChunk


@pytest.mark.parametrize("flavour", ["gpt2", "nanogpt", "llama"])  # nanogpt: the exact GELU
def test_triton_model_matches_torch(flavour):
    cfg = ModelConfig(
        flavour=flavour,
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,  # head dim 16
        num_query_groups=2 if flavour == "llama" else None,
        seq_length=24,  # attention spans several blocks of 16/32
        vocab_size=250,  # padded to 256: the loss reads a strided slice of the logits
        make_vocab_size_divisible_by=64,
    )
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, cfg.seq_length))
    labels = torch.randint(0, cfg.vocab_size, (1, cfg.seq_length))
    results = []
    for mode in ("torch", "triton"):
        model = GPTChunk(cfg, LayerEnv(ops=select(mode, "cpu"), seed=3))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no silent fallback to the torch ops
            loss = model(ids, labels)
            loss.backward()
        results.append((loss, {n: p.grad for n, p in model.named_parameters()}))
    (loss_t, grads_t), (loss_k, grads_k) = results
    assert select("triton", "cpu").rms_norm is not select("torch", "cpu").rms_norm
    torch.testing.assert_close(loss_k, loss_t, rtol=1e-5, atol=1e-6)
    assert grads_k.keys() == grads_t.keys()
    for name, g in grads_t.items():
        torch.testing.assert_close(grads_k[name], g, rtol=1e-4, atol=1e-6, msg=name)
