"""gpt-oss <-> megalite: a random GptOssForCausalLM (attention sinks, alternating sliding/full
layers, yarn RoPE, biased q/k/v/o, 4 biased experts top-2 with clamped SwiGLU) converts at
tp2*pp2, loads and gives transformers' logits within 1e-5 (fp32) and its greedy tokens; the
round trip is exact, config.json's fields included. Its tp2 gradients are in
tests/distributed/test_hf_families.py, the MoE at ep2*tp2 in tests/distributed/test_moe_variants.py.
"""

import json

import pytest
import torch

from megalite.checkpoint import hf
from megalite.testing import perturbed
from tests.unit.test_checkpoint_hf import (
    assert_round_trip_exact,
    convert,
    generate,
    hf_greedy,
    megalite_model,
)

transformers = pytest.importorskip("transformers")
VOCAB, SEQ = 500, 32


def gpt_oss():
    torch.manual_seed(0)
    c = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=SEQ,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=6, swiglu_limit=1.0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 8},
    )  # fmt: skip
    m = transformers.GptOssForCausalLM(c)
    return perturbed(m, louder=("sinks", "experts"))  # sinks and experts well off their init


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    m = gpt_oss()
    d = tmp_path_factory.mktemp("gpt_oss")
    m.save_pretrained(d / "hf", safe_serialization=True)
    convert.main([str(d / "hf"), str(d / "ml"), "--to", "megalite", "--tp", "2", "--pp", "2"])
    return m, d / "hf", d / "ml"


def test_config_is_read():
    cfg = hf.model_config_from_hf(gpt_oss().config.to_dict())
    assert (cfg.flavour, cfg.num_experts, cfg.moe_ffn, cfg.kv_channels) == ("gpt_oss", 4, 24, 16)
    assert [cfg.window_of(i) for i in range(4)] == [6, None, 6, None]
    assert (cfg.rope_scaling, cfg.yarn_truncate, cfg.swiglu_limit) == ("yarn", False, 1.0)


def test_same_logits_and_greedy_tokens(converted):
    m, _, ml = converted
    chunk = megalite_model(ml)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = chunk(ids), m(ids).logits
        assert (ours - theirs).abs().max() <= 1e-5
        for layer in chunk.layers.values():  # the sinks matter
            layer.attention.sinks.zero_()
        assert (chunk(ids) - theirs).abs().max() > 1e-3
    chunk = megalite_model(ml)
    prompt = ids[0, :5].tolist()
    assert generate.generate(chunk, prompt, 12) == hf_greedy(m, prompt, 12)


def test_round_trip_is_exact(converted, tmp_path):
    m, hf_dir, ml = converted
    assert_round_trip_exact(m, ml, tmp_path)
    ours = json.loads((tmp_path / "hf" / "config.json").read_text())
    theirs = json.loads((hf_dir / "config.json").read_text())
    for key in ("model_type", "num_local_experts", "num_experts_per_tok", "intermediate_size",
                "sliding_window", "layer_types", "swiglu_limit", "swiglu_alpha", "head_dim",
                "attention_bias"):  # fmt: skip
        assert ours[key] == theirs[key], key
    # rope_parameters: yarn's default betas are left out, as for every family
    assert hf.model_config_from_hf(ours) == hf.model_config_from_hf(theirs)
