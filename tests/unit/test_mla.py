"""Multi-head latent attention (model/mla.py) and DeepseekV3ForCausalLM conversion (dense layers).

Random tiny transformers DeepSeek-V3 models (low-rank q or a full q projection; yarn with
mscale_all_dim, which changes the softmax scale): imported, they give transformers' logits
(fp32, 1e-5) and greedy tokens through megalite's latent KV cache; exported back, the state dict
and config.json are the original's. The sharded runs are in tests/distributed/test_mla.py.
"""

import dataclasses

import pytest
import torch

from megalite.checkpoint import hf
from megalite.config import ModelConfig
from megalite.errors import MegaliteError
from megalite.generation import KVCache
from megalite.model.env import LayerEnv
from megalite.model.gpt import GPTChunk
from megalite.model.mla import LatentAttention, softmax_scale
from megalite.model.moe import expert_biases
from megalite.testing import perturbed
from tests.unit.test_checkpoint_hf import SEQ, VOCAB, generate

transformers = pytest.importorskip("transformers")

YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "mscale": 0.8,
        "mscale_all_dim": 0.8, "original_max_position_embeddings": 8}  # fmt: skip
DEEPSEEK = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
            "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 12,
            "first_k_dense_replace": 2, "max_position_embeddings": SEQ}  # fmt: skip
# name -> config arguments beyond DEEPSEEK
VARIANTS = {"q-lora-yarn": {"q_lora_rank": 24, "rope_parameters": YARN},
            "q-proj": {"q_lora_rank": None, "v_head_dim": 16},
            # DeepSeek-V3's MoE from layer 1 on: sigmoid, 2 groups of 4 experts, a shared one
            "moe": {"q_lora_rank": 24, "first_k_dense_replace": 1, "n_routed_experts": 8,
                    "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
                    "n_shared_experts": 1, "moe_intermediate_size": 16,
                    "routed_scaling_factor": 2.5}}  # fmt: skip


def hf_deepseek(name: str, seed: int = 0):
    torch.manual_seed(seed)
    m = transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(**(DEEPSEEK | VARIANTS[name]))
    )
    return perturbed(m)


def imported(m, **change):
    cfg = dataclasses.replace(hf.model_config_from_hf(m.config.to_dict()), **change)
    chunk = GPTChunk(cfg).eval()
    chunk.load_full_state(hf.from_hf(m.state_dict(), cfg))
    return chunk


IDS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_imported_deepseek_v3_gives_transformers_logits_and_greedy_tokens(name):
    m = hf_deepseek(name)
    cfg = hf.model_config_from_hf(m.config.to_dict())
    assert cfg.flavour == "deepseek_v3" and cfg.features.latent_attention
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.v_head_dim) == (
        VARIANTS[name]["q_lora_rank"],
        16,
        VARIANTS[name].get("v_head_dim", 12),
    )
    chunk = imported(m)
    attn = chunk.layers["0"].attention
    assert isinstance(attn, LatentAttention) and hasattr(attn, "q_a") == (name != "q-proj")
    with torch.no_grad():
        theirs = m(IDS).logits
        assert (chunk(IDS) - theirs).abs().max() <= 1e-5
        if name == "q-lora-yarn":  # yarn's mscale_all_dim scales the scores: it matters
            no_mscale = imported(m, yarn_mscale_all_dim=None, yarn_mscale=None)
            assert softmax_scale(no_mscale.cfg) != softmax_scale(cfg)
            assert (no_mscale(IDS) - theirs).abs().max() > 1e-3
    prompt = IDS[0, :5].tolist()
    theirs = m.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                        eos_token_id=None, pad_token_id=0)[0, 5:].tolist()  # fmt: skip
    assert generate.generate(chunk, prompt, 12) == theirs


def test_the_rotary_pairs_are_reordered_to_halves():
    """Without the reordering of the interleaved rotary rows the logits are another model's."""
    m = hf_deepseek("q-lora-yarn")
    cfg = hf.model_config_from_hf(m.config.to_dict())
    state = hf.from_hf(m.state_dict(), cfg)
    w = m.state_dict()["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    ours = state["layers.0.attention.kv_a.weight"]
    assert torch.equal(ours[:16], w[:16])  # the latent rows as they are
    assert torch.equal(ours[16:], w[[16, 18, 17, 19]])  # rope rows: evens, then odds
    chunk = GPTChunk(cfg).eval()
    chunk.load_full_state({**state, "layers.0.attention.kv_a.weight": w})
    with torch.no_grad():
        assert (chunk(IDS) - m(IDS).logits).abs().max() > 1e-4


def test_the_kv_cache_holds_the_latent_and_the_rope_key():
    """One layer's cache is (b, 1, slots, kv_lora_rank) and (b, 1, slots, qk_rope_head_dim), not
    per-head keys and values; fed token by token, the logits are the whole sequence's."""
    chunk = imported(hf_deepseek("q-lora-yarn"))
    cache = KVCache(torch.zeros(2, dtype=torch.long), SEQ, padded=False)
    with torch.no_grad():
        whole = chunk(IDS[:, :6])
        steps = [chunk(IDS[:, :3], cache=cache)]
        steps += [chunk(IDS[:, i : i + 1], cache=cache) for i in range(3, 6)]
    layer = cache.layers["0"]
    assert layer.k.shape == (2, 1, SEQ, 16) and layer.v.shape == (2, 1, SEQ, 4)
    for i, logits in zip((2, 3, 4, 5), steps):
        assert (logits[:, :VOCAB] - whole[:, i]).abs().max() <= 1e-5


def _fused(state: dict, cfg) -> dict:
    """The hub's per-expert tensors as transformers holds them in memory (what it does on load)."""
    out = {k: v for k, v in state.items() if ".mlp.experts." not in k}
    for i in filter(cfg.is_moe_layer, range(cfg.num_layers)):
        h, e = f"model.layers.{i}.mlp.experts.", range(cfg.num_experts)
        out[h + "gate_up_proj"] = torch.stack(
            [torch.cat([state[f"{h}{j}.gate_proj.weight"], state[f"{h}{j}.up_proj.weight"]])
             for j in e])  # fmt: skip
        out[h + "down_proj"] = torch.stack([state[f"{h}{j}.down_proj.weight"] for j in e])
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_export_gives_back_the_state_dict_and_config(name):
    m = hf_deepseek(name)
    cfg = hf.model_config_from_hf(m.config.to_dict())
    theirs = m.state_dict()
    back = _fused(hf.to_hf(hf.from_hf(theirs, cfg), cfg), cfg)
    assert sorted(back) == sorted(theirs)
    for k, v in theirs.items():
        assert torch.equal(back[k], v), k
    exported = hf.hf_config(cfg)
    assert exported["num_nextn_predict_layers"] == 0  # MTP modules are not exported
    exported = type(m.config).from_dict(exported).to_dict()
    original = m.config.to_dict()
    for key in set(original) | set(exported):
        if key not in ("architectures", "num_nextn_predict_layers"):
            assert exported.get(key) == original.get(key), key


def test_what_megalite_cannot_honour_is_refused_in_one_line():
    config = hf_deepseek("q-proj").config.to_dict()
    for change, match in (
        ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"rope_interleave": False}, "rope_interleave=False"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ):
        with pytest.raises(MegaliteError, match=match):
            hf.model_config_from_hf(config | change)


def test_mla_parameters_and_head_dims():
    cfg = ModelConfig(flavour="deepseek_v3", num_layers=1, hidden_size=32, num_attention_heads=4,
                      q_lora_rank=8, kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=2,
                      v_head_dim=10, vocab_size=64, seq_length=8)  # fmt: skip
    shapes = {n: tuple(p.shape) for n, p in GPTChunk(cfg).layers["0"].attention.named_parameters()}
    assert shapes == {"q_a.weight": (8, 32), "q_a_norm.weight": (8,), "q_b.weight": (4 * 6, 8),
                      "kv_a.weight": (6 + 2, 32), "kv_a_norm.weight": (6,),
                      "kv_b.weight": (4 * (4 + 10), 6), "out.weight": (32, 4 * 10)}  # fmt: skip
    # v wider than q/k: q and k are padded, the scale stays 1/sqrt(dn + dr)
    chunk = GPTChunk(cfg)
    ids = torch.randint(0, 64, (2, 8))
    loss = chunk(ids, ids)
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in chunk.parameters())


@pytest.mark.parametrize("name", ["q-lora-yarn", "moe"])  # moe: the MTP layer has experts
def test_mtp_modules_are_stored_as_the_hubs_extra_layers(name, tmp_path):
    """--mtp-num-layers 1: exported as model.layers.2.* (enorm, hnorm, eh_proj, shared_head and
    the layer, with copies of the shared embedding and head), read back identically;
    transformers loads the export without them and gives the model's logits."""
    cfg = dataclasses.replace(hf.model_config_from_hf(hf_deepseek(name).config.to_dict()),
                              mtp_num_layers=1)  # fmt: skip
    model = GPTChunk(cfg, LayerEnv(seed=4))
    state = {n: p.detach() for n, p in model.named_parameters()}
    state.update(expert_biases([model]))  # the whole logical state: the expert biases too
    out = hf.to_hf(state, cfg)
    mlp = "mlp.experts.3.down_proj" if name == "moe" else "mlp.down_proj"
    for key in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head",
                "embed_tokens", "self_attn.kv_b_proj", mlp):  # fmt: skip
        assert f"model.layers.2.{key}.weight" in out, key
    assert torch.equal(out["model.layers.2.shared_head.head.weight"], out["lm_head.weight"])
    config = hf.hf_config(cfg)
    assert config["num_nextn_predict_layers"] == 1
    assert hf.model_config_from_hf(config).mtp_num_layers == 0  # transformers' default: 1
    back_cfg = dataclasses.replace(hf.model_config_from_hf(config), mtp_num_layers=1)
    back = hf.from_hf(out, back_cfg)
    assert sorted(back) == sorted(state)
    for k, v in state.items():
        assert torch.equal(back[k], v), k
    m = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**config)).eval()
    missing, unexpected = m.load_state_dict(_fused(out, cfg), strict=False)
    assert not missing and all(k.startswith("model.layers.2.") for k in unexpected)
    chunk = GPTChunk(cfg).eval()
    chunk.load_full_state(state)
    with torch.no_grad():
        assert (chunk(IDS) - m(IDS).logits).abs().max() <= 1e-5
    with pytest.raises(MegaliteError, match="lacks tensor model.layers.2.enorm.weight"):
        hf.from_hf(hf.to_hf(state, dataclasses.replace(cfg, mtp_num_layers=0)), back_cfg)


def test_a_resume_takes_the_checkpoints_latent_dims_and_refuses_others(tmp_path):
    from megalite.checkpoint.args import with_checkpoint_model
    from megalite.config import Config
    from tests.unit.test_checkpoint_hf import convert

    hf_deepseek("q-lora-yarn").save_pretrained(tmp_path / "hf", safe_serialization=True)
    convert.main([str(tmp_path / "hf"), str(tmp_path / "ml"), "--to", "megalite"])
    m = with_checkpoint_model(Config(), set(), tmp_path / "ml").model
    assert (m.flavour, m.q_lora_rank, m.kv_lora_rank, m.v_head_dim) == ("deepseek_v3", 24, 16, 12)
    for name, flag in (("kv_lora_rank", "--kv-lora-rank"), ("mtp_num_layers", "--mtp-num-layers")):
        cfg = Config()
        setattr(cfg.model, name, 8)
        with pytest.raises(MegaliteError, match=f"has {name}=.* but this run's {flag} is 8"):
            with_checkpoint_model(cfg, {f"model.{name}"}, tmp_path / "ml")


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputation_gives_the_same_gradients(recompute):
    cfg = hf.model_config_from_hf(hf_deepseek("q-lora-yarn").config.to_dict())
    grads = []
    for mode in ("none", recompute):
        chunk = GPTChunk(cfg, LayerEnv(recompute=mode, seed=2, dtype=torch.float64)).train()
        chunk(IDS[:, :-1], IDS[:, 1:]).backward()
        grads.append({n: p.grad for n, p in chunk.named_parameters()})
    for name, g in grads[0].items():
        assert torch.equal(grads[1][name], g), name


@pytest.mark.parametrize("name", ["q-lora-yarn", "moe"])
def test_conversion_round_trip_through_checkpoints(name, tmp_path):
    from tests.unit.test_checkpoint_hf import assert_round_trip_exact, convert

    m = hf_deepseek(name)
    m.save_pretrained(tmp_path / "hf", safe_serialization=True)
    convert.main([str(tmp_path / "hf"), str(tmp_path / "ml"), "--to", "megalite", "--tp", "2",
                  "--pp", "2"])  # fmt: skip
    assert_round_trip_exact(m, tmp_path / "ml", tmp_path / "out")
