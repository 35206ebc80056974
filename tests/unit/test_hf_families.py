"""Qwen3, Qwen2.5, Llama 3.x (rope scaling) and Mistral (sliding window) from and to transformers.

Random tiny transformers models of each (vocabulary 500, padded by megalite): imported, they give
transformers' logits (fp32, 1e-5) and greedy tokens; the feature each family adds (QK-norm, an
explicit head_dim, the rope scaling, the window, tied embeddings) changes the logits, so a model
that dropped it would fail; exported back, the state dict and config.json are the original's.
The sharded runs (greedy text at tp2*pp2, training at tp2*pp2*dp2) are in
tests/distributed/test_hf_families.py and tests/e2e/test_hf_families.py.
"""

import dataclasses

import pytest
import torch

from megalite.checkpoint import hf
from megalite.config import Config
from megalite.errors import MegaliteError
from megalite.model.gpt import GPTChunk
from megalite.model.rope import rotary_tables
from megalite.shape import validate
from megalite.testing import perturbed
from tests.unit.test_checkpoint_hf import SEQ, VOCAB, assert_round_trip_exact, convert, generate

transformers = pytest.importorskip("transformers")

COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": SEQ}  # fmt: skip
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}  # fmt: skip
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
             "original_max_position_embeddings": 8}  # fmt: skip

# family -> (config class, model class, config arguments, what megalite must read from it)
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16, "tie_word_embeddings": True},
              {"flavour": "qwen3", "kv_channels": 16, "untie_embeddings_and_output_weights": False}),
    "qwen2.5": ("Qwen2Config", "Qwen2ForCausalLM", {"rope_parameters": YARN_ROPE},
                {"flavour": "qwen2", "rope_scaling": "yarn", "rotary_base": 1e6}),
    "llama3": ("LlamaConfig", "LlamaForCausalLM",
               {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True},
               {"flavour": "llama", "rope_scaling": "llama3", "rotary_base": 500000.0,
                "rope_original_max_position_embeddings": 16}),
    "llama-linear": ("LlamaConfig", "LlamaForCausalLM",
                     {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
                     {"flavour": "llama", "rope_scaling": "linear", "rope_scaling_factor": 2.0}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8},
                {"flavour": "mistral", "sliding_window": 8}),
}  # fmt: skip
# what each family adds, undone: the logits must then differ from transformers'
WITHOUT = {
    "qwen3": {"kv_channels": None},  # head_dim 8 instead of 16: shapes differ (checked apart)
    "qwen2.5": {"rope_scaling": "none"},
    "llama3": {"rope_scaling": "none"},
    "llama-linear": {"rope_scaling": "none"},
    "mistral": {"sliding_window": None},
}


def hf_family(name: str, seed: int = 0):
    config_cls, model_cls, kw, _ = FAMILIES[name]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**COMMON, **kw)
    m = getattr(transformers, model_cls)(config)
    return perturbed(m)


def imported(m, **change):
    cfg = dataclasses.replace(hf.model_config_from_hf(m.config.to_dict()), **change)
    chunk = GPTChunk(cfg).eval()
    chunk.load_full_state(hf.from_hf(m.state_dict(), cfg))
    return chunk


IDS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_imported_model_gives_transformers_logits_and_greedy_tokens(name):
    m = hf_family(name)
    cfg = hf.model_config_from_hf(m.config.to_dict())
    for field, value in FAMILIES[name][3].items():
        assert getattr(cfg, field) == value, field
    chunk = imported(m)
    with torch.no_grad():
        theirs = m(IDS).logits
        assert (chunk(IDS) - theirs).abs().max() <= 1e-5
        if name != "qwen3":  # the feature matters: without it the logits are another model's
            assert (imported(m, **WITHOUT[name])(IDS) - theirs).abs().max() > 1e-3
    prompt = IDS[0, :5].tolist()  # 5 + 14 tokens: past Mistral's window of 8
    theirs = m.generate(torch.tensor([prompt]), max_new_tokens=14, do_sample=False,
                        eos_token_id=None, pad_token_id=0)[0, 5:].tolist()  # fmt: skip
    assert generate.generate(chunk, prompt, 14) == theirs


def test_qwen3_norms_each_head_and_sets_head_dim():
    m = hf_family("qwen3")
    chunk = imported(m)
    attn = chunk.layers["0"].attention
    assert attn.q_norm.weight.shape == attn.k_norm.weight.shape == (16,)
    assert chunk.layers["0"].attention.q.weight.shape == (4 * 16, 32)
    assert not hasattr(chunk, "output")  # tied: the head is the embedding
    with torch.no_grad():
        attn.q_norm.weight.fill_(1.0)  # a model without q_norm's weight is another model
        assert (chunk(IDS) - m(IDS).logits).abs().max() > 1e-3


@pytest.mark.parametrize("name", list(FAMILIES))
def test_export_gives_back_the_state_dict_and_config(name):
    m = hf_family(name)
    cfg = hf.model_config_from_hf(m.config.to_dict())
    theirs = m.state_dict()
    back = hf.to_hf(hf.from_hf(theirs, cfg), cfg)
    assert sorted(back) == sorted(theirs)
    for k, v in theirs.items():
        assert torch.equal(back[k], v), k
    exported = type(m.config).from_dict(hf.hf_config(cfg)).to_dict()
    original = m.config.to_dict()
    for key in set(original) | set(exported):
        if key != "architectures":  # None in a config built in memory
            assert exported.get(key) == original.get(key), key


@pytest.mark.parametrize("name", ["qwen3", "mistral"])
def test_conversion_round_trip_through_checkpoints(name, tmp_path):
    m = hf_family(name)
    m.save_pretrained(tmp_path / "hf", safe_serialization=True)
    convert.main([str(tmp_path / "hf"), str(tmp_path / "ml"), "--to", "megalite", "--tp", "2",
                  "--pp", "2"])  # fmt: skip
    assert_round_trip_exact(m, tmp_path / "ml", tmp_path / "out")


def test_a_resume_takes_the_checkpoints_head_dim_and_refuses_another(tmp_path):
    from megalite.checkpoint.args import with_checkpoint_model

    m = hf_family("qwen3")
    m.save_pretrained(tmp_path / "hf", safe_serialization=True)
    convert.main([str(tmp_path / "hf"), str(tmp_path / "ml"), "--to", "megalite"])
    assert with_checkpoint_model(Config(), set(), tmp_path / "ml").model.head_dim == 16
    cfg = Config()
    cfg.model.kv_channels = 8
    with pytest.raises(MegaliteError, match="has kv_channels=16 but this run's --kv-channels is 8"):
        with_checkpoint_model(cfg, {"model.kv_channels"}, tmp_path / "ml")


def test_rope_tables_are_transformers():
    """Each scaling's cos/sin equal transformers' rotary embedding's (yarn's attention factor
    included), at every position of the sequence."""
    for name in ("qwen2.5", "llama3", "llama-linear"):
        m = hf_family(name)
        cfg = hf.model_config_from_hf(m.config.to_dict())
        cos, sin = rotary_tables(cfg)
        x = torch.zeros(1, SEQ, cfg.head_dim)
        their_cos, their_sin = m.model.rotary_emb(x, torch.arange(SEQ)[None])
        half = cfg.head_dim // 2
        assert torch.equal(cos, their_cos[0, :, :half]) and torch.equal(sin, their_sin[0, :, :half])
    assert hf.model_config_from_hf(hf_family("qwen2.5").config.to_dict()).rope_scaling == "yarn"


def _refusal(name, match, **change):
    config = hf_family(name).config.to_dict() | change
    with pytest.raises(MegaliteError, match=match):
        hf.model_config_from_hf(config)


def test_what_megalite_cannot_honour_is_refused_in_one_line():
    _refusal("qwen3", "window on some layers only", use_sliding_window=True, sliding_window=4,
             max_window_layers=1, layer_types=["full_attention", "sliding_attention"])  # fmt: skip
    _refusal("qwen3", "qkv_bias=True, linear_bias=True", attention_bias=True)
    _refusal(
        "llama3",
        "rope_type 'dynamic' are not supported",
        rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
    )
    _refusal(
        "llama3",
        "rope parameters partial_rotary_factor",
        rope_parameters={**LLAMA3_ROPE, "partial_rotary_factor": 0.5},
    )
    _refusal("llama3", "rope parameters beta_fast", rope_parameters={**LLAMA3_ROPE, "beta_fast": 4})
    _refusal("mistral", "hidden_act='gelu'", hidden_act="gelu")
    _refusal("qwen2.5", "quantization_config", quantization_config={"quant_method": "gptq"})
    # a window on every Qwen layer is Mistral's window
    cfg = hf.model_config_from_hf(hf_family("qwen3").config.to_dict() | {
        "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0,
        "layer_types": ["sliding_attention"] * 2})  # fmt: skip
    assert cfg.sliding_window == 4 and hf.hf_config(cfg)["use_sliding_window"]
    llama = hf.model_config_from_hf(hf_family("llama3").config.to_dict())
    with pytest.raises(MegaliteError, match="LlamaForCausalLM has no sliding window"):
        hf.hf_config(dataclasses.replace(llama, sliding_window=4))


def test_validate_takes_head_dim_windows_and_rope_scaling():
    cfg = Config()
    cfg.model = dataclasses.replace(cfg.model, flavour="mistral", sliding_window=8)
    cfg.training.kernels = "triton"  # the Triton attention takes the window
    validate(cfg, 1)
    cfg.parallel.cp = 2  # context parallelism honours it (tests/distributed/test_hf_families.py)
    validate(cfg, 2)
    cfg.parallel.cp = 1
    cfg.model = dataclasses.replace(cfg.model, hidden_size=36, kv_channels=16)  # 36 % 4 != 0
    assert validate(cfg, 1).model.head_dim == 16
    cfg.model = dataclasses.replace(cfg.model, rope_scaling="yarn", rope_scaling_factor=0.0)
    with pytest.raises(MegaliteError, match="--rope-scaling-factor=0.0 must be positive"):
        validate(cfg, 1)
    cfg.model = dataclasses.replace(cfg.model, sliding_window=0, rope_scaling="none")
    with pytest.raises(MegaliteError, match="--sliding-window=0 must be a positive integer"):
        validate(cfg, 1)
