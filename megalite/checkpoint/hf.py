"""Weight names and configs between megalite and Hugging Face transformers.

Works on whole logical tensors (one process's view of the model, tp=1): `to_hf` and `from_hf`
map a state dict one way or the other. megalite pads the vocabulary (to a multiple of
`make_vocab_size_divisible_by`); padding rows are added on import and stripped on export.
GPT-2 stores linear weights as Conv1D (in, out) and fuses q, k, v into `c_attn`; megalite keeps
`nn.Linear` (out, in) and separate q, k, v. `export_tokenizer` writes the run's tokenizer so that
`AutoTokenizer.from_pretrained` encodes text to the ids megalite trained on. The layout follows
the model's features (`cfg.features.hf_model_type`, its biases); an imported config.json is read
as features first and then matched to a row of `megalite.config.FLAVOURS`.

Mixtral (a Llama-flavoured model with experts in every layer, no shared expert, top-k weights
renormalised): megalite's stacked expert tensors are the ones recent transformers keep in
memory, `mlp.experts.gate_up_proj` (E, 2f, h: gate rows, then up rows) and `down_proj`
(E, h, f), with the router as `mlp.gate`. Checkpoints on the hub store one tensor per expert,
`block_sparse_moe.experts.{j}.w1` (gate), `w3` (up) and `w2` (down), router
`block_sparse_moe.gate`. Both are read; the per-expert hub layout is written, which every
transformers version loads (recent ones fuse it on load, and write it back on save).
"""

import json
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

from megalite.config import FLAVOURS, ModelConfig, ModelFeatures
from megalite.data.tokenizer import SENTENCEPIECE, load_tokenizer
from megalite.errors import MegaliteError
from megalite.model.gpt import OUTPUT, VOCAB_TENSORS, WORD_EMBEDDING

ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
                 "mixtral": "MixtralForCausalLM"}  # fmt: skip


def _gpt2_layout(cfg: ModelConfig) -> bool:
    """GPT-2's names: Conv1D (in, out) weights, q, k, v fused into c_attn."""
    return cfg.features.hf_model_type == "gpt2"


def _mixtral(cfg: ModelConfig) -> bool:
    """An MoE model exports as Mixtral; one Mixtral cannot express is refused."""
    if not cfg.num_experts:
        return False
    unsupported = {
        f"the {cfg.flavour} flavour": cfg.features.hf_model_type != "llama",
        "--moe-layer-freq > 1": cfg.moe_layer_freq != 1,
        "a shared expert": bool(cfg.moe_shared_expert_intermediate_size),
        "--moe-router-pre-softmax": cfg.moe_router_pre_softmax,
        "the expert bias": cfg.moe_router_enable_expert_bias,
    }
    why = [k for k, v in unsupported.items() if v]
    if why:
        raise MegaliteError(
            f"this mixture-of-experts model has {', '.join(why)}, which MixtralForCausalLM "
            "cannot express; it cannot be exported to Hugging Face"
        )
    return True


def hf_config(cfg: ModelConfig) -> dict:
    """The config.json of the equivalent transformers model."""
    if _gpt2_layout(cfg) and not _mixtral(cfg):
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
    out = {
        "architectures": [ARCHITECTURES[cfg.features.hf_model_type]],
        "model_type": cfg.features.hf_model_type,
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
        "attention_bias": cfg.features.qkv_bias,
        "mlp_bias": cfg.features.linear_bias,
        "initializer_range": cfg.init_method_std,
        "attention_dropout": cfg.attention_dropout,
    }
    if _mixtral(cfg):  # Llama's fields with experts (Mixtral has no bias options)
        del out["attention_bias"], out["mlp_bias"]
        out.update({
            "architectures": [ARCHITECTURES["mixtral"]],
            "model_type": "mixtral",
            "intermediate_size": cfg.moe_ffn,
            "num_local_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.moe_router_topk,
            "router_aux_loss_coef": cfg.moe_aux_loss_coeff,
            "sliding_window": None,
        })  # fmt: skip
    return out


def _flavour(features: ModelFeatures, arch: str) -> str:
    """The flavour whose row has these features (the output tying aside: a flag sets it)."""
    differ = {}
    for name, row in FLAVOURS.items():
        theirs = {k: v for k, v in vars(features).items() if k not in ("tied", "doc")}
        mine = {k: getattr(row, k) for k in theirs}
        if theirs == mine:
            return name
        if row.hf_model_type == features.hf_model_type:
            differ = {k: v for k, v in theirs.items() if v != mine[k]}
    what = ", ".join(f"{k}={v}" for k, v in differ.items()) or str(features)
    raise MegaliteError(
        f"{arch} models with {what} are not supported: no megalite flavour has these features "
        "(megalite.config.FLAVOURS)"
    )


def _llama_features(hf: dict) -> ModelFeatures:
    """Llama's (and Mixtral's) features as config.json states them."""
    bias = bool(hf.get("attention_bias"))  # q, k, v and o_proj
    return ModelFeatures("rmsnorm", "rotary", gated_mlp=True, qkv_bias=bias,
                         linear_bias=bias or bool(hf.get("mlp_bias")),
                         tied=bool(hf.get("tie_word_embeddings", False)), hf_model_type="llama")  # fmt: skip


def model_config_from_hf(hf: dict) -> ModelConfig:
    arch = (hf.get("architectures") or [hf.get("model_type", "?")])[0]
    if arch == ARCHITECTURES["gpt2"] or hf.get("model_type") == "gpt2":
        if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            raise MegaliteError(
                f"GPT-2 activation {hf['activation_function']!r} is not supported; megalite uses gelu_new"
            )
        # what GPT2LMHeadModel always is: its config.json has no switch for these
        gpt2 = ModelFeatures("layernorm", "learned", gated_mlp=False, qkv_bias=True,
                             linear_bias=True, tied=True, hf_model_type="gpt2")  # fmt: skip
        return ModelConfig(
            flavour=_flavour(gpt2, "GPT-2"),
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
        return _llama_config(hf, "Llama")
    if arch == ARCHITECTURES["mixtral"] or hf.get("model_type") == "mixtral":
        return _mixtral_config(hf)
    raise MegaliteError(
        f"Hugging Face architecture {arch!r} is not supported; megalite converts GPT2LMHeadModel, "
        "LlamaForCausalLM and MixtralForCausalLM"
    )


def _rope_base(hf: dict, default: float, arch: str) -> float:
    """The RoPE base: at the top of config.json (older transformers) or in rope_parameters
    (transformers >= 5, which also keeps any scaling there). Scaled RoPE is refused."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    if scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise MegaliteError(f"{arch} models with rope scaling are not supported")
    return params.get("rope_theta", hf.get("rope_theta", default))


def _mixtral_config(hf: dict) -> ModelConfig:
    h, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("sliding_window") is not None:
        raise MegaliteError(
            f"Mixtral with sliding_window={hf['sliding_window']} is not supported; megalite "
            "attends over the whole sequence"
        )
    if hf.get("head_dim") not in (None, h // heads):
        raise MegaliteError(
            f"Mixtral with head_dim={hf['head_dim']} != hidden/heads is not supported"
        )
    return _llama_config(
        hf, "Mixtral", seq=4096, eps=1e-5, rope=1e6,
        num_experts=hf["num_local_experts"],
        moe_router_topk=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=hf["intermediate_size"],
        moe_aux_loss_coeff=hf.get("router_aux_loss_coef", 0.0),
    )  # fmt: skip


def _llama_config(hf: dict, arch: str, seq=2048, eps=1e-6, rope=10000.0, **experts):
    """The ModelConfig of a Llama-style config.json (Llama, or Mixtral with `experts`); the
    defaults are transformers' for fields the file leaves out."""
    heads = hf["num_attention_heads"]
    return ModelConfig(
        flavour=_flavour(_llama_features(hf), arch),
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        ffn_hidden_size=hf["intermediate_size"],
        seq_length=hf.get("max_position_embeddings", seq),
        vocab_size=hf["vocab_size"],
        norm_epsilon=hf.get("rms_norm_eps", eps),
        rotary_base=_rope_base(hf, rope, arch),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        **experts,
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
            if cfg.features.linear_bias if a == "out" else cfg.features.qkv_bias:
                yield m + f"attention.{a}.bias", h + f"self_attn.{b}.bias"
        if cfg.is_moe_layer(i):  # Mixtral: the router; the experts in _experts_to/_from_hf
            yield m + "mlp.router.weight", h + "block_sparse_moe.gate.weight"
            continue
        for a in ("gate", "up", "down"):
            yield m + f"mlp.{a}.weight", h + f"mlp.{a}_proj.weight"
            if cfg.features.linear_bias:
                yield m + f"mlp.{a}.bias", h + f"mlp.{a}_proj.bias"
    yield "final_norm.weight", "model.norm.weight"
    if not cfg.tied:
        yield OUTPUT, "lm_head.weight"


def to_hf(state: dict, cfg: ModelConfig) -> dict:
    """megalite logical tensors (padded vocabulary) -> transformers state dict."""
    _mixtral(cfg)  # an MoE model Mixtral cannot express is refused before anything is written
    V = cfg.vocab_size
    out = {}
    unpad = set(VOCAB_TENSORS)
    if _gpt2_layout(cfg):
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
        if _mixtral(cfg):
            out.update(_experts_to_hf(state, cfg))
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
    if _gpt2_layout(cfg):
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
        fused = cfg.num_experts and "model.layers.0.mlp.experts.gate_up_proj" in hf_state
        for m, h in _llama_names(cfg):
            if fused:  # recent transformers' in-memory names: the router is mlp.gate
                h = h.replace("block_sparse_moe.gate.", "mlp.gate.")
            out[m] = get(h).clone()
        if cfg.num_experts:
            out.update(_experts_from_hf(hf_state, cfg, get, fused))
    for name in VOCAB_TENSORS:
        if name in out:
            out[name] = F.pad(out[name], (0, 0, 0, pad))
    return out


def _experts_to_hf(state: dict, cfg: ModelConfig) -> dict:
    """Stacked expert tensors -> the hub's per-expert w1 (gate), w3 (up), w2 (down)."""
    out, f = {}, cfg.moe_ffn
    for i in range(cfg.num_layers):
        gate_up = state[f"layers.{i}.mlp.experts.gate_up.weight"]  # (E, 2f, h)
        down = state[f"layers.{i}.mlp.experts.down.weight"]  # (E, h, f)
        for j in range(cfg.num_experts):
            h = f"model.layers.{i}.block_sparse_moe.experts.{j}."
            out[h + "w1.weight"] = gate_up[j, :f].clone()
            out[h + "w3.weight"] = gate_up[j, f:].clone()
            out[h + "w2.weight"] = down[j].clone()
    return out


def _experts_from_hf(hf_state: dict, cfg: ModelConfig, get, fused: bool) -> dict:
    """The hub's per-expert tensors, or recent transformers' fused ones -> stacked tensors."""
    out = {}
    for i in range(cfg.num_layers):
        m = f"layers.{i}.mlp.experts."
        if fused:
            out[m + "gate_up.weight"] = get(f"model.layers.{i}.mlp.experts.gate_up_proj").clone()
            out[m + "down.weight"] = get(f"model.layers.{i}.mlp.experts.down_proj").clone()
            continue
        h = f"model.layers.{i}.block_sparse_moe.experts."
        out[m + "gate_up.weight"] = torch.stack(
            [torch.cat([get(f"{h}{j}.w1.weight"), get(f"{h}{j}.w3.weight")])
             for j in range(cfg.num_experts)]
        )  # fmt: skip
        out[m + "down.weight"] = torch.stack(
            [get(f"{h}{j}.w2.weight") for j in range(cfg.num_experts)]
        )
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
