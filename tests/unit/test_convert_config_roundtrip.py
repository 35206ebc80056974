"""Every architecture's config through the converter and back, every field compared.

For each architecture of docs/models.md a config.json is written by transformers' own config
class (with token ids and a generation_config.json), random weights beside it (hf_random), and
the directory converted HF -> megalite -> HF. The two config.json files, each loaded by
transformers (so that a field left out and a field at transformers' default read alike), must
agree in every field a user sees: token ids, rope, window, MoE, MLA, sizes; the
generation_config.json too. Then megalite -> Megatron (torch_dist) -> megalite: every
ModelConfig field comes back, or the export is refused in one line (a feature Megatron's args
cannot carry); the converter's layout flags (--tp/--pp) never enter the saved config.
"""

import dataclasses
import json

import pytest

from megalite.checkpoint import format as fmt
from megalite.checkpoint.hf_config import ARCHITECTURES
from megalite.checkpoint.hf_random import write_random_hf
from megalite.checkpoint.megatron_args import resolved
from megalite.config_read import from_dict
from megalite.errors import MegaliteError

transformers = pytest.importorskip("transformers")

V, SEQ = 500, 64
IDS = {"bos_token_id": 1, "eos_token_id": 2}
COMMON = {"vocab_size": V, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": SEQ,
          **IDS}  # fmt: skip
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
        "original_max_position_embeddings": 16}  # fmt: skip
# architecture -> (transformers config class, its arguments)
ARCHS = {
    "gpt2": ("GPT2Config", {"n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": SEQ,
                            "vocab_size": V, **IDS}),
    "llama3": ("LlamaConfig", {**COMMON, "rope_parameters": LLAMA3, "tie_word_embeddings": True}),
    "llama-linear": ("LlamaConfig", {**COMMON, "rope_parameters": {
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
    "qwen2": ("Qwen2Config", {**COMMON, "rope_parameters": YARN}),
    "qwen3": ("Qwen3Config", {**COMMON, "head_dim": 16, "tie_word_embeddings": True}),
    "mistral": ("MistralConfig", {**COMMON, "sliding_window": 8}),
    "mixtral": ("MixtralConfig", {**COMMON, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", {**COMMON, "head_dim": 16, "num_experts": 4,
                                     "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "mlp_only_layers": [0]}),
    "deepseek_v3": ("DeepseekV3Config", {**COMMON, "num_key_value_heads": 4, "kv_lora_rank": 16,
                                         "q_lora_rank": 24, "qk_nope_head_dim": 8,
                                         "qk_rope_head_dim": 4, "v_head_dim": 12,
                                         "first_k_dense_replace": 1, "n_routed_experts": 8,
                                         "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
                                         "n_shared_experts": 1, "moe_intermediate_size": 16,
                                         # no MTP weights (hf_deepseek: not read by default)
                                         "num_nextn_predict_layers": 0}),
    "gpt_oss": ("GptOssConfig", {**COMMON, "intermediate_size": 24, "head_dim": 16,
                                 "num_local_experts": 4, "num_experts_per_tok": 2,
                                 "sliding_window": 6, "swiglu_limit": 1.0,
                                 "rope_parameters": {**YARN, "beta_fast": 32.0, "beta_slow": 1.0,
                                                     "truncate": False}}),
}  # fmt: skip
# the ones Megatron-LM's args can carry; the others' export is refused in one line
MEGATRON = {"gpt2", "llama3", "llama-linear", "mixtral"}
GENERATION = {"bos_token_id": 1, "eos_token_id": [2, 3], "temperature": 0.6, "top_p": 0.9}
# transformers' bookkeeping, not the model's
IGNORED = {"transformers_version", "dtype", "torch_dtype", "_name_or_path"}


def convert(*argv):
    from megalite.cli import convert as cli

    cli.main([str(a) for a in argv])


def seen(config: dict) -> dict:
    """A config.json as transformers loads it: every field, defaults filled in (a head_dim or
    n_inner of None is the one the sizes imply)."""
    loaded = transformers.AutoConfig.for_model(**config).to_dict()
    if "head_dim" in loaded and loaded["head_dim"] is None:
        loaded["head_dim"] = loaded["hidden_size"] // loaded["num_attention_heads"]
    if "n_inner" in loaded and loaded["n_inner"] is None:
        loaded["n_inner"] = 4 * loaded["n_embd"]
    for key in ("rope_parameters", "rope_scaling"):  # yarn's betas at transformers' defaults
        rope = loaded.get(key)
        if isinstance(rope, dict) and rope.get("rope_type") == "yarn":
            loaded[key] = {"beta_fast": 32.0, "beta_slow": 1.0, **rope}
    return {k: v for k, v in loaded.items() if k not in IGNORED}


@pytest.fixture(scope="module", params=list(ARCHS))
def source(request, tmp_path_factory):
    cls, kwargs = ARCHS[request.param]
    config = getattr(transformers, cls)(**kwargs).to_dict()
    config["architectures"] = [ARCHITECTURES[config["model_type"]]]  # as save_pretrained writes
    d = write_random_hf(tmp_path_factory.mktemp(request.param) / "hf", config)
    (d / "generation_config.json").write_text(json.dumps(GENERATION))
    return request.param, d


def test_hf_round_trip_keeps_every_field(source, tmp_path):
    name, d = source
    convert(d, tmp_path / "ml", "--to", "megalite", "--tp", 2, "--pp", 2)
    saved = fmt.Checkpoint(tmp_path / "ml").index["config"]
    assert saved["parallel"]["tp"] == 1 and saved["parallel"]["pp"] == 1  # the layout flags
    convert(tmp_path / "ml", tmp_path / "hf", "--to", "hf")
    theirs = seen(json.loads((d / "config.json").read_text()))
    ours = seen(json.loads((tmp_path / "hf" / "config.json").read_text()))
    diff = {k: (theirs.get(k), ours.get(k)) for k in theirs.keys() | ours.keys()
            if theirs.get(k) != ours.get(k)}  # fmt: skip
    assert not diff, (name, json.dumps(diff, default=str))
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text()) == GENERATION


def test_megatron_round_trip_keeps_every_field_or_refuses(source, tmp_path):
    name, d = source
    convert(d, tmp_path / "ml", "--to", "megalite")
    if name not in MEGATRON:
        with pytest.raises(MegaliteError) as e:
            convert(tmp_path / "ml", tmp_path / "mt", "--to", "megatron")
        assert "\n" not in str(e.value) and "cannot be exported" in str(e.value), str(e.value)
        assert not (tmp_path / "mt").exists()
        return
    convert(tmp_path / "ml", tmp_path / "mt", "--to", "megatron", "--tp", 2)
    convert(tmp_path / "mt", tmp_path / "back", "--to", "megalite")
    theirs = from_dict({"model": fmt.Checkpoint(tmp_path / "ml").model_config}).model
    ours = from_dict({"model": fmt.Checkpoint(tmp_path / "back").model_config}).model
    # the flavour is named by its features (Megatron's args cannot tell llama from mistral);
    # the init std is a training setting
    names = [
        f.name for f in dataclasses.fields(theirs) if f.name not in ("flavour", "init_method_std")
    ]
    diff = {k: (resolved(theirs, k), resolved(ours, k)) for k in names
            if resolved(theirs, k) != resolved(ours, k)}  # fmt: skip
    assert not diff, (name, diff)
    assert theirs.features == ours.features or theirs.flavour == "mistral"
    # and on to Hugging Face: the token ids and generation config of the model it came from
    convert(tmp_path / "back", tmp_path / "hf", "--to", "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert {k: config[k] for k in IDS} == IDS
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text()) == GENERATION


@pytest.mark.parametrize("fmt_", ["legacy", "torch_dist"])
def test_megatron_round_trip_of_a_trained_run_keeps_its_tokenizers_ids(tmp_path, fmt_):
    """A megalite run's checkpoint holds no Hugging Face record, only its tokenizer: the ids
    come from that tokenizer, through Megatron and back."""
    from megalite.checkpoint.hf import export_tokenizer
    from megalite.data.tokenizer import Tokenizer

    d = write_random_hf(tmp_path / "src", {**ARCHS["llama3"][1], "model_type": "llama",
                                           "architectures": ["LlamaForCausalLM"],
                                           "bos_token_id": None, "eos_token_id": None})  # fmt: skip
    text = tmp_path / "text.txt"
    text.write_text("\n".join(f"line {i} of some text, more words here" for i in range(400)))
    Tokenizer.train([str(text)], tmp_path / "tok", 300)
    (d / "tokenizer.model").write_bytes((tmp_path / "tok.model").read_bytes())
    convert(d, tmp_path / "ml", "--to", "megalite")
    ids = export_tokenizer(tmp_path / "tok.model", tmp_path)
    assert ids["eos_token_id"] is not None
    convert(tmp_path / "ml", tmp_path / "mt", "--to", "megatron", "--format", fmt_)
    convert(tmp_path / "mt", tmp_path / "back", "--to", "megalite")
    convert(tmp_path / "back", tmp_path / "hf", "--to", "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert {k: config[k] for k in ids} == ids


def test_export_keeps_the_sources_own_fields_and_dtype(tmp_path):
    """Fields megalite's model does not hold (initializer_range, use_cache, pad_token_id, a
    field of the user's own) come back as the source wrote them, and so does its dtype: fp32
    weights under a bfloat16 config (as a run's checkpoint holds) are written in bfloat16, or
    in the dtype --dtype names."""
    import torch
    from safetensors import safe_open

    extra = {"initializer_range": 0.006, "use_cache": False, "pad_token_id": 0,
             "my_note": {"team": "x"}, "rope_scaling": {"type": "linear", "factor": 2.0}}  # fmt: skip
    config = {**ARCHS["llama3"][1], "model_type": "llama", "architectures": ["LlamaForCausalLM"],
              **extra}  # fmt: skip
    del config["rope_parameters"]
    d = write_random_hf(tmp_path / "src", config, dtype=torch.float32)
    source = json.loads((d / "config.json").read_text())
    source.update(torch_dtype="bfloat16", dtype="bfloat16")  # what the model says it is
    (d / "config.json").write_text(json.dumps(source))
    convert(d, tmp_path / "ml", "--to", "megalite")
    for flags, want in (((), "bfloat16"), (("--dtype", "float32"), "float32")):
        out = tmp_path / f"hf{len(flags)}"
        convert(tmp_path / "ml", out, "--to", "hf", *flags)
        config = json.loads((out / "config.json").read_text())
        same = {k: v for k, v in source.items() if k not in ("torch_dtype", "dtype")}
        assert {k: config.get(k) for k in same} == same
        assert (config["torch_dtype"], config["dtype"]) == (want, want)
        with safe_open(out / "model.safetensors", "pt") as f:
            assert {str(f.get_slice(k).get_dtype()) for k in f.keys()} == {
                {"bfloat16": "BF16", "float32": "F32"}[want]
            }
