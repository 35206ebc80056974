"""Mixtral <-> megalite: a random MixtralForCausalLM (4 experts, top-2) converts, loads and gives
the same logits and greedy tokens; the hub's per-expert tensors (what save_pretrained writes)
and recent transformers' fused in-memory ones read to the same tensors; the round trip is exact.
"""

import pytest
import torch

from megalite.checkpoint import hf
from megalite.cli import convert_hf
from megalite.config import ModelConfig
from megalite.errors import MegaliteError
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


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    torch.manual_seed(0)
    c = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
    )  # fmt: skip
    m = transformers.MixtralForCausalLM(c)
    perturbed(m, 0.02)
    d = tmp_path_factory.mktemp("mixtral")
    m.save_pretrained(d / "hf", safe_serialization=True)
    convert.main([str(d / "hf"), str(d / "ml"), "--to", "megalite", "--tp", "2", "--pp", "2"])
    return m, d / "hf", d / "ml"


def test_same_logits_and_greedy_tokens(mixtral):
    m, _, ml = mixtral
    chunk = megalite_model(ml)
    assert chunk.cfg.num_experts == 4 and chunk.cfg.moe_router_topk == 2
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = chunk(ids), m(ids).logits
    assert (ours - theirs).abs().max() <= 1e-4
    prompt = ids[0, :5].tolist()
    assert generate.generate(chunk, prompt, 12) == hf_greedy(m, prompt, 12)


def test_hub_and_fused_layouts_read_alike(mixtral):
    m, hf_dir, _ = mixtral
    cfg = hf.model_config_from_hf(convert_hf.read_hf_config(hf_dir))
    hub = convert_hf.read_hf_weights(hf_dir)  # what save_pretrained wrote: per-expert w1/w2/w3
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in hub
    fused = m.state_dict()  # transformers' in-memory names: experts.gate_up_proj, mlp.gate
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused
    a, b = hf.from_hf(hub, cfg), hf.from_hf(fused, cfg)
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert a["layers.1.mlp.experts.gate_up.weight"].shape == (4, 96, 32)


def test_round_trip_is_exact(mixtral, tmp_path):
    m, _, ml = mixtral
    assert_round_trip_exact(m, ml, tmp_path)


def test_what_mixtral_cannot_express_is_refused():
    cfg = ModelConfig(flavour="llama", num_experts=4, moe_shared_expert_intermediate_size=16,
                      vocab_size=VOCAB)  # fmt: skip
    with pytest.raises(MegaliteError, match="a shared expert, which MixtralForCausalLM"):
        hf.hf_config(cfg)
    with pytest.raises(MegaliteError, match="sliding_window=16 is not supported"):
        hf.model_config_from_hf({"model_type": "mixtral", "sliding_window": 16,
                                 "hidden_size": 32, "num_attention_heads": 4})  # fmt: skip
