"""Qwen3-MoE <-> megalite: a random Qwen3MoeForCausalLM (QK-norm, head_dim 16, 4 experts top-2,
norm_topk_prob, layer 1 dense by mlp_only_layers) converts at tp2*pp2, loads and gives
transformers' logits within 1e-5 (fp32) and its greedy tokens; the hub's per-expert tensors and
the fused in-memory ones read alike; the round trip is exact, config.json included. The
ep2 training run is in tests/distributed/test_moe_training.py.
"""

import json

import pytest
import torch

from megalite.checkpoint import hf
from megalite.cli import convert_hf
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


def qwen3_moe(**kw):
    torch.manual_seed(0)
    args = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
            "moe_intermediate_size": 24, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": SEQ,
            "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
            "mlp_only_layers": [1], "tie_word_embeddings": False, **kw}  # fmt: skip
    m = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**args))
    return perturbed(m)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    m = qwen3_moe()
    d = tmp_path_factory.mktemp("qwen3_moe")
    m.save_pretrained(d / "hf", safe_serialization=True)
    convert.main([str(d / "hf"), str(d / "ml"), "--to", "megalite", "--tp", "2", "--pp", "2"])
    return m, d / "hf", d / "ml"


def test_config_is_read():
    cfg = hf.model_config_from_hf(
        qwen3_moe(decoder_sparse_step=2, mlp_only_layers=[]).config.to_dict()
    )
    assert (cfg.flavour, cfg.num_experts, cfg.moe_router_topk) == ("qwen3", 4, 2)
    assert (cfg.moe_ffn, cfg.ffn, cfg.kv_channels) == (24, 64, 16)
    assert not cfg.moe_router_pre_softmax
    # transformers' rule: layer i sparse when (i + 1) % step == 0 and i not in mlp_only_layers
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, True]


def test_same_logits_and_greedy_tokens(converted):
    m, _, ml = converted
    chunk = megalite_model(ml)
    assert [chunk.cfg.is_moe_layer(i) for i in range(4)] == [True, False, True, True]
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = chunk(ids), m(ids).logits
    assert (ours - theirs).abs().max() <= 1e-5
    prompt = ids[0, :5].tolist()
    assert generate.generate(chunk, prompt, 12) == hf_greedy(m, prompt, 12)


def test_hub_and_fused_layouts_read_alike(converted):
    m, hf_dir, _ = converted
    cfg = hf.model_config_from_hf(convert_hf.read_hf_config(hf_dir))
    hub = convert_hf.read_hf_weights(hf_dir)  # what save_pretrained wrote: per-expert tensors
    assert "model.layers.2.mlp.experts.3.down_proj.weight" in hub
    fused = m.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused
    a, b = hf.from_hf(hub, cfg), hf.from_hf(fused, cfg)
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert a["layers.2.mlp.experts.gate_up.weight"].shape == (4, 48, 32)
    assert "layers.1.mlp.gate.weight" in a  # the dense layer


def test_round_trip_is_exact(converted, tmp_path):
    m, hf_dir, ml = converted
    assert_round_trip_exact(m, ml, tmp_path)
    ours = json.loads((tmp_path / "hf" / "config.json").read_text())
    theirs = json.loads((hf_dir / "config.json").read_text())
    for key in (
        "model_type",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "mlp_only_layers",
        "decoder_sparse_step",
        "head_dim",
        "intermediate_size",
    ):
        assert ours[key] == theirs[key], key
    assert ours.get("num_experts", ours.get("num_local_experts")) == 4


def test_what_qwen3_moe_cannot_express_is_refused():
    cfg = hf.model_config_from_hf(qwen3_moe().config.to_dict())
    import dataclasses

    for change, what in (({"moe_router_score_function": "sigmoid"}, "sigmoid router scores"),
                         ({"moe_router_num_groups": 2, "moe_router_group_topk": 1},
                          "node-limited routing"),
                         ({"moe_shared_expert_intermediate_size": 16}, "a shared expert")):  # fmt: skip
        with pytest.raises(MegaliteError, match=f"{what}, which Qwen3MoeForCausalLM"):
            hf.hf_config(dataclasses.replace(cfg, **change))
    with pytest.raises(MegaliteError, match="Qwen3-MoE with sliding_window=8 is not supported"):
        hf.model_config_from_hf({**qwen3_moe().config.to_dict(), "use_sliding_window": True,
                                 "sliding_window": 8})  # fmt: skip
