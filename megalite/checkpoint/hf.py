"""Weight names and configs between megalite and Hugging Face transformers.

Works on whole logical tensors (one process's view of the model, tp=1): `to_hf` and `from_hf`
map a state dict one way or the other. megalite pads the vocabulary (to a multiple of
`make_vocab_size_divisible_by`); padding rows are added on import and stripped on export.
GPT-2 stores linear weights as Conv1D (in, out) and fuses q, k, v into `c_attn`; megalite keeps
`nn.Linear` (out, in) and separate q, k, v. `export_tokenizer` writes the run's tokenizer so that
`AutoTokenizer.from_pretrained` encodes text to the ids megalite trained on.
"""

import json
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

from megalite.config import ModelConfig
from megalite.data.tokenizer import SENTENCEPIECE, load_tokenizer
from megalite.errors import MegaliteError
from megalite.model.gpt import OUTPUT, VOCAB_TENSORS, WORD_EMBEDDING

ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}


def hf_config(cfg: ModelConfig) -> dict:
    """The config.json of the equivalent transformers model."""
    if cfg.flavour == "gpt2":
        return {
            "architectures": [ARCHITECTURES["gpt2"]],
            "model_type": "gpt2",
            "vocab_size": cfg.vocab_size,
            "n_positions": cfg.max_position_embeddings or cfg.seq_length,
            "n_embd": cfg.hidden_size,
            "n_layer": cfg.num_layers,
            "n_head": cfg.num_attention_heads,
            "n_inner": cfg.ffn,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": cfg.norm_epsilon,
            "initializer_range": cfg.init_method_std,
            "resid_pdrop": cfg.hidden_dropout,
            "embd_pdrop": cfg.hidden_dropout,
            "attn_pdrop": cfg.attention_dropout,
            "tie_word_embeddings": True,
        }
    return {
        "architectures": [ARCHITECTURES["llama"]],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.heads_kv,
        "max_position_embeddings": cfg.max_position_embeddings or cfg.seq_length,
        "rms_norm_eps": cfg.norm_epsilon,
        "rope_theta": cfg.rotary_base,
        "hidden_act": "silu",
        "tie_word_embeddings": cfg.tied,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": cfg.init_method_std,
        "attention_dropout": cfg.attention_dropout,
    }


def model_config_from_hf(hf: dict) -> ModelConfig:
    arch = (hf.get("architectures") or [hf.get("model_type", "?")])[0]
    if arch == ARCHITECTURES["gpt2"] or hf.get("model_type") == "gpt2":
        if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            raise MegaliteError(
                f"GPT-2 activation {hf['activation_function']!r} is not supported; megalite uses gelu_new"
            )
        return ModelConfig(
            flavour="gpt2",
            num_layers=hf["n_layer"],
            hidden_size=hf["n_embd"],
            num_attention_heads=hf["n_head"],
            ffn_hidden_size=hf.get("n_inner") or 4 * hf["n_embd"],
            seq_length=hf["n_positions"],
            max_position_embeddings=hf["n_positions"],
            vocab_size=hf["vocab_size"],
            norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
        )
    if arch == ARCHITECTURES["llama"] or hf.get("model_type") == "llama":
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise MegaliteError("Llama models with attention or MLP biases are not supported")
        if hf.get("rope_scaling"):
            raise MegaliteError("Llama models with rope_scaling are not supported")
        return ModelConfig(
            flavour="llama",
            num_layers=hf["num_hidden_layers"],
            hidden_size=hf["hidden_size"],
            num_attention_heads=hf["num_attention_heads"],
            num_query_groups=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            ffn_hidden_size=hf["intermediate_size"],
            seq_length=hf.get("max_position_embeddings", 2048),
            vocab_size=hf["vocab_size"],
            norm_epsilon=hf.get("rms_norm_eps", 1e-6),
            rotary_base=hf.get("rope_theta", 10000.0),
            untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        )
    raise MegaliteError(
        f"Hugging Face architecture {arch!r} is not supported; megalite converts GPT2LMHeadModel and LlamaForCausalLM"
    )


def _gpt2_names(cfg: ModelConfig):
    """(megalite name, hf name, transposed) for every tensor except c_attn (split in three)."""
    yield WORD_EMBEDDING, "transformer.wte.weight", False
    yield "embedding.position.weight", "transformer.wpe.weight", False
    for i in range(cfg.num_layers):
        m, h = f"layers.{i}.", f"transformer.h.{i}."
        for a, b in (("input_norm", "ln_1"), ("post_attention_norm", "ln_2")):
            yield m + a + ".weight", h + b + ".weight", False
            yield m + a + ".bias", h + b + ".bias", False
        for a, b in (
            ("attention.out", "attn.c_proj"),
            ("mlp.up", "mlp.c_fc"),
            ("mlp.down", "mlp.c_proj"),
        ):
            yield m + a + ".weight", h + b + ".weight", True
            yield m + a + ".bias", h + b + ".bias", False
    yield "final_norm.weight", "transformer.ln_f.weight", False
    yield "final_norm.bias", "transformer.ln_f.bias", False


def _llama_names(cfg: ModelConfig):
    yield WORD_EMBEDDING, "model.embed_tokens.weight"
    for i in range(cfg.num_layers):
        m, h = f"layers.{i}.", f"model.layers.{i}."
        yield m + "input_norm.weight", h + "input_layernorm.weight"
        yield m + "post_attention_norm.weight", h + "post_attention_layernorm.weight"
        for a, b in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("out", "o_proj")):
            yield m + f"attention.{a}.weight", h + f"self_attn.{b}.weight"
        for a in ("gate", "up", "down"):
            yield m + f"mlp.{a}.weight", h + f"mlp.{a}_proj.weight"
    yield "final_norm.weight", "model.norm.weight"
    if not cfg.tied:
        yield OUTPUT, "lm_head.weight"


def to_hf(state: dict, cfg: ModelConfig) -> dict:
    """megalite logical tensors (padded vocabulary) -> transformers state dict."""
    V = cfg.vocab_size
    out = {}
    unpad = set(VOCAB_TENSORS)
    if cfg.flavour == "gpt2":
        for m, h, t in _gpt2_names(cfg):
            w = state[m][:V] if m in unpad else state[m]
            out[h] = w.t().contiguous() if t else w.clone()
        for i in range(cfg.num_layers):
            a = f"layers.{i}.attention."
            out[f"transformer.h.{i}.attn.c_attn.weight"] = (
                torch.cat([state[a + x + ".weight"] for x in "qkv"]).t().contiguous()
            )
            out[f"transformer.h.{i}.attn.c_attn.bias"] = torch.cat(
                [state[a + x + ".bias"] for x in "qkv"]
            )
        out["lm_head.weight"] = out["transformer.wte.weight"]
    else:
        for m, h in _llama_names(cfg):
            out[h] = (state[m][:V] if m in unpad else state[m]).clone()
        if cfg.tied:
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def from_hf(hf_state: dict, cfg: ModelConfig) -> dict:
    """transformers state dict -> megalite logical tensors, the vocabulary padded to tp=1's size."""
    pad = cfg.padded_vocab_size(1) - cfg.vocab_size

    def get(name):
        if name not in hf_state:
            raise MegaliteError(
                f"Hugging Face checkpoint lacks tensor {name}; is it a complete {cfg.flavour} model?"
            )
        return hf_state[name]

    out = {}
    if cfg.flavour == "gpt2":
        for m, h, t in _gpt2_names(cfg):
            out[m] = get(h).t().contiguous() if t else get(h).clone()
        h_ = cfg.hidden_size
        for i in range(cfg.num_layers):
            w = get(f"transformer.h.{i}.attn.c_attn.weight").t()  # (3h, h)
            b = get(f"transformer.h.{i}.attn.c_attn.bias")
            for j, x in enumerate("qkv"):
                out[f"layers.{i}.attention.{x}.weight"] = w[j * h_ : (j + 1) * h_].contiguous()
                out[f"layers.{i}.attention.{x}.bias"] = b[j * h_ : (j + 1) * h_].clone()
    else:
        for m, h in _llama_names(cfg):
            out[m] = get(h).clone()
    for name in VOCAB_TENSORS:
        if name in out:
            out[name] = F.pad(out[name], (0, 0, 0, pad))
    return out


def export_tokenizer(path, dst: Path) -> dict:
    """Write the tokenizer file `path` (a checkpoint's tokenizer.model or tokenizer.json) into
    the transformers model directory `dst`, with a tokenizer_config.json that makes
    AutoTokenizer encode as megalite does; returns {"bos_token_id", "eos_token_id"} for
    config.json (None where the tokenizer has no such token)."""
    tok = load_tokenizer(path)
    shutil.copyfile(path, dst / tok.file_name)
    # megalite adds no BOS/EOS when encoding text, so neither may the exported tokenizer.
    conf = {"add_bos_token": False, "add_eos_token": False}
    if tok.kind == SENTENCEPIECE:
        # The sentencepiece model loads as a (slow) LlamaTokenizer with no dummy prefix.
        conf.update(tokenizer_class="LlamaTokenizer", add_prefix_space=False, legacy=True)
    else:
        # tokenizer.json as it is; a special token's text inside a document is text to
        # megalite (split_special_tokens), and decoding keeps spaces as they were.
        conf.update(tokenizer_class="PreTrainedTokenizerFast", split_special_tokens=True,
                    clean_up_tokenization_spaces=False, **tok.special_tokens)  # fmt: skip
    (dst / "tokenizer_config.json").write_text(json.dumps(conf, indent=2))
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id}
    return {k: (v if v >= 0 else None) for k, v in ids.items()}
