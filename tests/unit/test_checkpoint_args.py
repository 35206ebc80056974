"""The model architecture read back from a converted checkpoint (what `--load DIR` trains when no
model flag is given) is the Hugging Face model's, every field, for any Llama / GPT-2 config."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megalite.checkpoint import hf
from megalite.checkpoint.args import with_checkpoint_model
from megalite.cli import convert
from megalite.config import Config
from megalite.errors import MegaliteError

transformers = pytest.importorskip("transformers")

LLAMA_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
              "rms_norm_eps", "tie_word_embeddings")  # fmt: skip
GPT2_KEYS = ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions", "layer_norm_epsilon")


@st.composite
def hf_configs(draw):
    heads = draw(st.sampled_from([1, 2, 4]))
    width = heads * draw(st.sampled_from([4, 8]))
    common = {"vocab_size": draw(st.integers(8, 300)), "layers": draw(st.integers(1, 3)),
              "positions": draw(st.integers(4, 64)), "eps": draw(st.sampled_from([1e-5, 1e-6, 3e-7]))}  # fmt: skip
    if draw(st.booleans()):
        return transformers.LlamaConfig(
            vocab_size=common["vocab_size"], hidden_size=width, num_hidden_layers=common["layers"],
            intermediate_size=draw(st.integers(4, 48)), num_attention_heads=heads,
            num_key_value_heads=draw(st.sampled_from([k for k in (1, 2, 4) if heads % k == 0])),
            max_position_embeddings=common["positions"], rms_norm_eps=common["eps"],
            rope_theta=10000.0,  # another base: test_rope_base_survives_conversion below
            tie_word_embeddings=draw(st.booleans()),
        )  # fmt: skip
    return transformers.GPT2Config(
        vocab_size=common["vocab_size"], n_embd=width, n_layer=common["layers"], n_head=heads,
        n_positions=common["positions"], layer_norm_epsilon=common["eps"],
        n_inner=draw(st.one_of(st.none(), st.integers(4, 48))),
    )  # fmt: skip


def _convert(config, tmp):
    cls = (
        transformers.LlamaForCausalLM
        if config.model_type == "llama"
        else transformers.GPT2LMHeadModel
    )
    cls(config).save_pretrained(tmp / "hf", safe_serialization=True)
    convert.main([str(tmp / "hf"), str(tmp / "ml"), "--to", "megalite"])
    return tmp / "ml"


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(config=hf_configs())
def test_architecture_round_trips(config, tmp_path_factory):
    path = _convert(config, tmp_path_factory.mktemp("ckpt"))
    model = with_checkpoint_model(Config(), set(), path).model  # no model flag given
    original = config.to_dict()
    assert model == hf.model_config_from_hf(original)  # every megalite field
    back = hf.hf_config(model)
    for key in LLAMA_KEYS if config.model_type == "llama" else GPT2_KEYS:
        assert back[key] == original[key], key
    if config.model_type == "gpt2":
        assert back["n_inner"] == (original["n_inner"] or 4 * original["n_embd"])
    else:
        assert back["rope_theta"] == _rope_theta(original)


def _rope_theta(hf_config: dict) -> float:
    """transformers >= 5 keeps the RoPE base in rope_parameters, older ones at the top."""
    return (hf_config.get("rope_parameters") or {}).get("rope_theta", hf_config.get("rope_theta"))


def test_rope_base_survives_conversion(tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, max_position_embeddings=16, rope_theta=500000.0,
    )  # fmt: skip
    model = with_checkpoint_model(Config(), set(), _convert(config, tmp_path)).model
    assert model.rotary_base == _rope_theta(config.to_dict()) == 500000.0


def test_given_fields_must_agree(tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
    )  # fmt: skip
    path = _convert(config, tmp_path)
    cfg = Config()
    cfg.model.num_query_groups, cfg.model.seq_length = 2, 8  # agrees; a run's own length
    out = with_checkpoint_model(cfg, {"model.num_query_groups", "model.seq_length"}, path)
    assert (out.model.num_layers, out.model.seq_length, cfg.model.num_layers) == (2, 8, 2)
    cfg.model.num_layers = 3
    with pytest.raises(MegaliteError, match=r"has num_layers=2 but this run's --num-layers is 3"):
        with_checkpoint_model(cfg, {"model.num_layers"}, path)


def test_a_run_at_a_shorter_length_keeps_the_models_context(tmp_path):
    """A 128K model continued at 8K is exported as a 128K model: the run's --seq-length is
    not a model field (here 64 positions, continued at 16)."""
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, max_position_embeddings=64,
    )  # fmt: skip
    cfg = Config()
    cfg.model.seq_length = 16
    model = with_checkpoint_model(cfg, {"model.seq_length"}, _convert(config, tmp_path)).model
    assert model.seq_length == 16 and hf.hf_config(model)["max_position_embeddings"] == 64


def test_a_contradiction_names_where_the_size_came_from(tmp_path):
    """model.vocab_size from a YAML file is named as that file's field, not --vocab-size."""
    from megalite.config_read import Given, parse_args

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, max_position_embeddings=16,
    )  # fmt: skip
    path = _convert(config, tmp_path)
    (tmp_path / "run.yaml").write_text("model:\n  vocab_size: 96\n")
    for argv, source in (([], f"model.vocab_size in {tmp_path / 'run.yaml'}"),
                         (["--vocab-size", "80"], "--vocab-size")):  # fmt: skip
        given = Given()
        cfg = parse_args(["--config", str(tmp_path / "run.yaml"), *argv], given)
        with pytest.raises(MegaliteError) as e:
            with_checkpoint_model(cfg, given, path)
        assert f"has vocab_size=64 but this run's {source} is " in str(e.value), str(e.value)
