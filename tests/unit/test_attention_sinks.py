"""gpt-oss's attention sinks (kernels/attention_sinks.py): the torch core equals transformers' gpt-oss
eager attention (sinks in the softmax, causal and sliding-window masks) in fp32 within 1e-6;
sinks at -inf give plain attention; a `gpt_oss` model's KV-cache generation picks the tokens
that full forwards pick (batched prompts of different lengths too), and its sinks change the
logits; they validate with --cp. The tp2 and cp2 gradients (the sinks split with the heads) are
in tests/distributed/test_hf_families.py, the Triton kernels' in
tests/kernels/test_attention_sinks.py.
"""

import pytest
import torch
from megalite.kernels import TORCH_OPS
from megalite.kernels.attention import _visible_ref
from megalite.kernels.attention_sinks import sink_attention

from megalite.config import Config, ModelConfig
from megalite.errors import MegaliteError
from megalite.generation import generate
from megalite.model.env import LayerEnv
from megalite.model.gpt import GPTChunk
from megalite.parallel.groups import single_process_groups
from megalite.parallel.sampling import Sampling
from megalite.shape import validate

transformers = pytest.importorskip("transformers")
B, HQ, HKV, S, D = 2, 4, 2, 10, 8


def qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, S, D, generator=g) for h in (HQ, HKV, HKV))
    return q, k, v, torch.randn(HQ, generator=g)


@pytest.mark.parametrize("window", [None, 3])
def test_core_matches_transformers_gpt_oss(window):
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    q, k, v, sinks = qkv()
    pos = torch.arange(S)
    vis = _visible_ref(pos, pos, None, None, window)  # (1, S, S)
    mask = torch.zeros(1, 1, S, S).masked_fill(~vis[:, None], float("-inf"))
    module = SimpleNamespace(num_key_value_groups=HQ // HKV, sinks=sinks, training=False)
    want, _ = eager_attention_forward(module, q, k, v, mask, scaling=D**-0.5)
    ours = sink_attention(q, k, v, sinks, vis)
    assert (ours.transpose(1, 2) - want).abs().max() <= 1e-6
    plain = TORCH_OPS.attention(q, k, v, window=window)
    assert (ours - plain).abs().max() > 1e-2  # the sinks matter
    no_sink = sink_attention(q, k, v, torch.full((HQ,), float("-inf")), vis)
    assert (no_sink - plain).abs().max() <= 1e-6


def tiny(**kw) -> ModelConfig:
    base = {"flavour": "gpt_oss", "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
            "num_query_groups": 2, "seq_length": 24, "vocab_size": 64}  # fmt: skip
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("window", [None, 4])
def test_kv_cache_generation_picks_what_full_forwards_pick(window):
    chunk = GPTChunk(tiny(sliding_window=window), LayerEnv(seed=3, dtype=torch.float64)).eval()
    with torch.no_grad():  # sinks away from 0 (its init is a small normal)
        for layer in chunk.layers.values():
            layer.attention.sinks.normal_(0.0, 2.0, generator=torch.Generator().manual_seed(4))
    prompts = [[5, 9, 2, 7, 1], [3, 8]]
    got = generate([chunk], single_process_groups(), prompts, 8, Sampling(0.0),
                   torch.Generator(), None)  # fmt: skip
    for prompt, new in zip(prompts, got):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(8):  # no cache: the whole context every step
                ids.append(int(chunk(torch.tensor([ids]))[0, -1].argmax()))
        assert new == ids[len(prompt) :], (prompt, window)
    with torch.no_grad():
        x = torch.tensor([prompts[0]])
        before = chunk(x)
        for layer in chunk.layers.values():
            layer.attention.sinks.zero_()
        assert (chunk(x) - before).abs().max() > 1e-3


def test_sinks_with_context_parallelism_validate():
    cfg = Config(model=tiny())
    cfg.parallel.cp = 2
    assert validate(cfg, 2).cp == 2  # they run with cp now (refused before)


def test_alternating_windows():
    """--window-attn-skip-freq 2: layers 0, 2 slide, 1, 3 see everything (gpt-oss)."""
    cfg = tiny(num_layers=4, sliding_window=3, window_attn_skip_freq=2)
    assert [cfg.window_of(i) for i in range(4)] == [3, None, 3, None]
    chunk = GPTChunk(cfg, LayerEnv(seed=3, dtype=torch.float64)).eval()
    assert [chunk.layers[str(i)].attention.window for i in range(4)] == [{"window": 3}, {}] * 2
    x = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = chunk(x)
        for other in (tiny(num_layers=4, sliding_window=3), tiny(num_layers=4)):
            assert (
                GPTChunk(other, LayerEnv(seed=3, dtype=torch.float64)).eval()(x) - ours
            ).abs().max() > 1e-6
    from megalite.checkpoint import hf

    mistral = ModelConfig(flavour="mistral", sliding_window=3, window_attn_skip_freq=2,
                          vocab_size=64)  # fmt: skip
    with pytest.raises(MegaliteError, match="alternating sliding/full layers"):
        hf.hf_config(mistral)
