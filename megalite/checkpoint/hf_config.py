"""config.json of Hugging Face transformers <-> megalite's ModelConfig, both ways.

An imported config.json is read as features first (`ModelFeatures`) and then matched to the
row of `megalite.model_config.FLAVOURS` that has them; every field it carries is read, or checked,
and one megalite cannot honour (a rope type it lacks, a per-layer attention pattern, partial
rotary dimensions, an activation other than SiLU, quantisation) is refused in one line, never
dropped. Export writes the config of the architecture the flavour's `hf_model_type` names, and
refuses a model that architecture cannot express. The weights are megalite/checkpoint/hf.py's.

GPT2LMHeadModel: the gpt2 flavour (activation gelu_new or gelu_pytorch_tanh), or with the exact
GELU (activation gelu) the bias-free nanogpt flavour, written with zero biases (checkpoint/hf.py).

Llama-layout architectures (names as Llama's, model.layers.{i}.self_attn.q_proj ...):
- LlamaForCausalLM (Llama 2/3.x): optional rope scaling (llama3, linear, yarn), tied embeddings;
- Qwen2ForCausalLM (Qwen2, Qwen2.5): biases on q, k, v only;
- Qwen3ForCausalLM (Qwen3 dense): q_norm and k_norm over each head, head_dim set explicitly;
- MistralForCausalLM: `sliding_window` (every layer);
- MixtralForCausalLM: experts in every layer (no sliding window);
- Qwen3MoeForCausalLM: Qwen3 with experts (softmax top-k, `norm_topk_prob`), dense MLPs on
  `mlp_only_layers` and off the `decoder_sparse_step` (read as --moe-dense-layers; written
  back as mlp_only_layers with decoder_sparse_step 1).
- DeepseekV3ForCausalLM: multi-head latent attention (checkpoint/hf_deepseek.py).
A flavour's MoE architecture is its `hf_moe_model_type`; the MoE fields of each (DeepSeek-V3's
too) are megalite/checkpoint/hf_moe.py's.
Qwen2/3 take a sliding window only when it covers every layer (`layer_types` all sliding).
"""

from megalite.checkpoint import hf_deepseek
from megalite.checkpoint.hf_moe import MOE_ARCHITECTURES, moe_config, moe_export, moe_fields
from megalite.errors import MegaliteError
from megalite.model_config import FLAVOURS, ModelConfig, ModelFeatures

ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
                 "mixtral": "MixtralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen3_moe": MOE_ARCHITECTURES["qwen3_moe"],
                 "gpt_oss": MOE_ARCHITECTURES["gpt_oss"],
                 "deepseek_v3": hf_deepseek.ARCH}  # fmt: skip
LABELS = {"llama": "Llama", "mixtral": "Mixtral", "qwen2": "Qwen2", "qwen3": "Qwen3",
          "mistral": "Mistral", "qwen3_moe": "Qwen3-MoE", "gpt_oss": "gpt-oss",
          "deepseek_v3": "DeepSeek-V3"}  # fmt: skip
# what an architecture always has beyond what its config.json states (its features' names)
ALWAYS = {
    "gpt_oss": {"moe_bias": True, "clamped_swiglu": True, "attention_sinks": True},
    "deepseek_v3": {"latent_attention": True},
}
DENSE_LAYOUT = {"mixtral": "llama", "qwen3_moe": "qwen3"}  # MoE architecture -> its dense one

# RoPE parameters per rope_type: config.json key -> ModelConfig field
ROPE_FIELDS = {
    "default": {},
    "linear": {"factor": "rope_scaling_factor"},
    "llama3": {"factor": "rope_scaling_factor", "low_freq_factor": "rope_low_freq_factor",
               "high_freq_factor": "rope_high_freq_factor",
               "original_max_position_embeddings": "rope_original_max_position_embeddings"},
    "yarn": {"factor": "rope_scaling_factor", "beta_fast": "yarn_beta_fast",
             "beta_slow": "yarn_beta_slow", "mscale": "yarn_mscale",
             "mscale_all_dim": "yarn_mscale_all_dim", "attention_factor": "yarn_attention_factor",
             "original_max_position_embeddings": "rope_original_max_position_embeddings",
             "truncate": "yarn_truncate"},
}  # fmt: skip
RUNTIME = {"none": "default"}  # ModelConfig.rope_scaling -> rope_type where the names differ
# transformers' values for yarn keys left out: not written (nor None), as transformers writes them
YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": True}
# ModelFeatures.gelu -> GPT-2's activation_function values for it (the first one is written)
GPT2_ACTIVATIONS = {"tanh": ("gelu_new", "gelu_pytorch_tanh"), "exact": ("gelu",)}


# ---- export ---------------------------------------------------------------------------------


def _gpt2_config(cfg: ModelConfig) -> dict:
    return {
        "architectures": [ARCHITECTURES["gpt2"]],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_position_embeddings or cfg.seq_length,
        "n_embd": cfg.hidden_size,
        "n_layer": cfg.num_layers,
        "n_head": cfg.num_attention_heads,
        "n_inner": cfg.ffn,
        "activation_function": GPT2_ACTIVATIONS[cfg.features.gelu][0],
        "layer_norm_epsilon": cfg.norm_epsilon,
        "initializer_range": cfg.init_method_std,
        "resid_pdrop": cfg.hidden_dropout,
        "embd_pdrop": cfg.hidden_dropout,
        "attn_pdrop": cfg.attention_dropout,
        "tie_word_embeddings": True,
    }


def rope_parameters(cfg: ModelConfig) -> dict:
    """transformers >= 5's rope_parameters: the base, the rope_type and its parameters."""
    kind = RUNTIME.get(cfg.rope_scaling, cfg.rope_scaling)
    out = {"rope_theta": cfg.rotary_base, "rope_type": kind}
    for key, name in ROPE_FIELDS[kind].items():
        value = getattr(cfg, name)
        if value is not None and (kind != "yarn" or YARN_DEFAULTS.get(key) != value):
            out[key] = value
    return out


def hf_config(cfg: ModelConfig) -> dict:
    """The config.json of the equivalent transformers model."""
    kind, moe = cfg.features.hf_model_type, moe_export(cfg)
    if kind == "gpt2" and not moe:
        return _gpt2_config(cfg)
    if kind not in ARCHITECTURES:
        raise MegaliteError(
            f"the {cfg.flavour} flavour cannot be exported to Hugging Face yet (megalite writes "
            f"{', '.join(ARCHITECTURES.values())})"
        )
    if kind == "gpt_oss" and not moe:
        raise MegaliteError("a gpt_oss model without experts cannot be exported to Hugging Face")
    if cfg.sliding_window is not None and cfg.window_attn_skip_freq and moe != "gpt_oss":
        raise MegaliteError(
            f"alternating sliding/full layers (--window-attn-skip-freq) cannot be exported as "
            f"{ARCHITECTURES[kind]} yet; its window covers every layer or none"
        )
    rope = rope_parameters(cfg)
    out = {
        "architectures": [ARCHITECTURES[kind]],
        "model_type": kind,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.heads_kv,
        "head_dim": cfg.head_dim,
        # the context the model came with (a run at a shorter --seq-length keeps it; a longer
        # one extends it)
        "max_position_embeddings": max(cfg.max_position_embeddings or 0, cfg.seq_length),
        "rms_norm_eps": cfg.norm_epsilon,
        "rope_theta": cfg.rotary_base,  # where transformers < 5 reads it
        "rope_parameters": rope,
        "hidden_act": "silu",
        "tie_word_embeddings": cfg.tied,
        "attention_bias": cfg.features.qkv_bias,
        "mlp_bias": cfg.features.linear_bias,
        "initializer_range": cfg.init_method_std,
        "attention_dropout": cfg.attention_dropout,
    }
    if rope["rope_type"] != "default":
        out["rope_scaling"] = rope  # transformers < 5 reads the scaling here
    window = cfg.sliding_window
    if cfg.features.latent_attention:  # MLA's fields, its MoE's (checkpoint/hf_deepseek.py)
        return hf_deepseek.hf_config(cfg, out)
    if moe == "mixtral":  # Llama's fields with experts (Mixtral has no bias options)
        del out["attention_bias"], out["mlp_bias"]
        out.update(moe_config(cfg, moe))
    elif moe == "gpt_oss":  # biases on q, k, v and o (attention_bias); its windows per layer
        del out["mlp_bias"]
        out.update(moe_config(cfg, moe))
    elif kind == "mistral":  # no bias options; a window on every layer (or none)
        del out["attention_bias"], out["mlp_bias"]
        out["sliding_window"] = window
    elif kind in ("qwen2", "qwen3"):  # biases fixed by the architecture (qwen3: attention_bias)
        del out["mlp_bias"]
        if kind == "qwen2":  # no head_dim field unless it differs from hidden / heads
            del out["attention_bias"]
            if cfg.kv_channels is None:
                del out["head_dim"]
        layer = "full_attention" if window is None else "sliding_attention"
        out.update(use_sliding_window=window is not None, sliding_window=window,
                   layer_types=[layer] * cfg.num_layers)  # fmt: skip
        if window is not None:
            out["max_window_layers"] = 0  # the window from the first layer on
        if moe == "qwen3_moe":  # Qwen3's fields with experts; no per-layer attention types
            del out["layer_types"]
            out.update(moe_config(cfg, moe))
    elif window is not None:
        raise MegaliteError(
            f"{ARCHITECTURES[kind]} has no sliding window; this model (--sliding-window "
            f"{window}) cannot be exported to Hugging Face as {kind}"
        )
    return out


# transformers' bookkeeping and the weights' dtype (the export's own): never taken from a source
NOT_CARRIED = ("transformers_version", "_name_or_path", "torch_dtype", "dtype")


def with_source_fields(config: dict, source: dict | None) -> dict:
    """`config` (hf_config's) with each field of the source's config.json (the model it was
    imported from) that says the same model: one megalite does not read (initializer_range,
    use_cache, a user's own) or spells another way (rope_scaling's "type") keeps the source's
    value; one the model changed since (a longer context, another RoPE factor) keeps the
    model's. Decided by reading the config back with the field both ways."""
    if not source:
        return config
    out, mine = dict(config), model_config_from_hf(config)
    for key, value in source.items():
        if key in NOT_CARRIED or key in out and out[key] == value:
            continue
        try:
            same = model_config_from_hf({**out, key: value}) == mine
        except (MegaliteError, KeyError, TypeError, ValueError, AttributeError):
            same = False  # the source's value reads as no model of these weights
        if same:
            out[key] = value
    return out


# ---- import ---------------------------------------------------------------------------------


def _flavour(features: ModelFeatures, arch: str) -> str:
    """The flavour whose row has these features (the output tying aside: a flag sets it)."""
    differ = {}
    for name, row in FLAVOURS.items():
        theirs = {k: v for k, v in vars(features).items()
                  if k not in ("tied", "doc", "hf_moe_model_type")}  # fmt: skip
        mine = {k: getattr(row, k) for k in theirs}
        if theirs == mine:
            return name
        if row.hf_model_type == features.hf_model_type:
            differ = {k: v for k, v in theirs.items() if v != mine[k]}
    what = ", ".join(f"{k}={v}" for k, v in differ.items()) or str(features)
    raise MegaliteError(
        f"{arch} models with {what} are not supported: no megalite flavour has these features "
        "(megalite.model_config.FLAVOURS)"
    )


def _features(hf: dict, kind: str) -> ModelFeatures:
    """The features a Llama-layout config.json states (`kind`: its weight layout)."""
    attention = bool(hf.get("attention_bias"))  # Llama, Qwen3: q, k, v and o_proj
    qkv = attention or kind == "qwen2"  # Qwen2: q, k, v always, o_proj never
    return ModelFeatures("rmsnorm", "rotary", gated_mlp=True, qkv_bias=qkv,
                         linear_bias=attention or bool(hf.get("mlp_bias")),
                         tied=bool(hf.get("tie_word_embeddings", False)),
                         hf_model_type=DENSE_LAYOUT.get(kind, kind),
                         qk_norm=DENSE_LAYOUT.get(kind, kind) == "qwen3",
                         **ALWAYS.get(kind, {}))  # fmt: skip


def model_config_from_hf(hf: dict) -> ModelConfig:
    arch = (hf.get("architectures") or [hf.get("model_type", "?")])[0]
    if hf.get("quantization_config"):
        raise MegaliteError(f"{arch} checkpoints with a quantization_config are not supported")
    if arch == ARCHITECTURES["gpt2"] or hf.get("model_type") == "gpt2":
        return _gpt2_from_hf(hf)
    for kind, name in ARCHITECTURES.items():
        if kind != "gpt2" and (arch == name or hf.get("model_type") == kind):
            return _llama_config(hf, kind)
    raise MegaliteError(
        f"Hugging Face architecture {arch!r} is not supported; megalite converts "
        f"{', '.join(ARCHITECTURES.values())}"
    )


def _gpt2_from_hf(hf: dict) -> ModelConfig:
    act = hf.get("activation_function", "gelu_new")
    gelu = next((k for k, names in GPT2_ACTIVATIONS.items() if act in names), None)
    if gelu is None:
        known = ", ".join(n for names in GPT2_ACTIVATIONS.values() for n in names)
        raise MegaliteError(f"GPT-2 activation {act!r} is not supported; megalite reads {known}")
    # what GPT2LMHeadModel always is: its config.json has no switch for these. The exact GELU
    # is the nanogpt flavour's, which has no biases: checkpoint/hf.py's from_hf refuses weights
    # whose biases are not all zero (a GPT-2 with exact GELU and real biases has no flavour)
    bias = gelu == "tanh"
    gpt2 = ModelFeatures("layernorm", "learned", gated_mlp=False, qkv_bias=bias,
                         linear_bias=bias, tied=True, hf_model_type="gpt2", norm_bias=bias,
                         gelu=gelu)  # fmt: skip
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
        **_gpt2_dropouts(hf),
    )


def _gpt2_dropouts(hf: dict) -> dict:
    """GPT-2's dropouts (transformers' default 0.1): megalite has one for the residual stream
    and the embedding (resid_pdrop, embd_pdrop) and one for attention (attn_pdrop)."""
    resid, embd = hf.get("resid_pdrop", 0.1), hf.get("embd_pdrop", 0.1)
    if resid != embd:
        raise MegaliteError(
            f"GPT-2 with resid_pdrop={resid} and embd_pdrop={embd} is not supported: megalite's "
            "--hidden-dropout is both"
        )
    return {"hidden_dropout": resid, "attention_dropout": hf.get("attn_pdrop", 0.1)}


def _rope(hf: dict, default: float, arch: str) -> dict:
    """ModelConfig's RoPE fields: the base at the top of config.json (transformers < 5) or in
    rope_parameters (>= 5), the scaling in either rope_scaling or rope_parameters."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_FIELDS:
        raise MegaliteError(
            f"{arch} models with rope_type {kind!r} are not supported; megalite has "
            f"{', '.join(ROPE_FIELDS)}"
        )
    names = ROPE_FIELDS[kind]
    unknown = set(scaling) - {"rope_type", "type", "rope_theta", *names}
    if scaling.get("partial_rotary_factor", 1.0) == 1.0:
        unknown.discard("partial_rotary_factor")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        unknown.add("partial_rotary_factor")
    if unknown:
        raise MegaliteError(
            f"{arch} models with rope parameters {', '.join(sorted(unknown))} are not supported"
        )
    base = scaling.get("rope_theta", params.get("rope_theta", hf.get("rope_theta", default)))
    out = {"rotary_base": float(base), "rope_scaling": {"default": "none"}.get(kind, kind)}
    for key, name in names.items():
        if scaling.get(key) is not None:
            out[name] = scaling[key]
    if kind == "yarn" and scaling.get("factor") is None:  # transformers' default factor
        context = out["rope_original_max_position_embeddings"]
        out["rope_scaling_factor"] = hf["max_position_embeddings"] / context
    return out


def _window(hf: dict, kind: str, arch: str) -> int | None:
    """The sliding window of every layer, or None; a per-layer pattern is refused."""
    if kind in ("qwen2", "qwen3"):
        window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
        if window is None:  # transformers then attends over everything, whatever layer_types
            return None
        n, first = hf["num_hidden_layers"], hf.get("max_window_layers", 28)
        types = set(hf.get("layer_types") or [])  # older configs: sliding from max_window_layers
        types = types or {"sliding_attention" if i >= first else "full_attention" for i in range(n)}
        if types == {"full_attention"}:
            return None
        if types != {"sliding_attention"}:
            raise MegaliteError(
                f"{arch} with a sliding window on some layers only (use_sliding_window, "
                "max_window_layers, layer_types) is not supported; megalite's window covers "
                "every layer or none"
            )
        return window
    window = hf.get("sliding_window")
    if kind == "qwen3_moe" and not hf.get("use_sliding_window"):
        window = None  # transformers then attends over everything
    if kind in ("mixtral", "qwen3_moe") and window is not None:
        raise MegaliteError(
            f"{LABELS[kind]} with sliding_window={window} is not supported; megalite's MoE "
            "models attend over the whole sequence"
        )
    if kind == "llama" and window is not None:
        raise MegaliteError(f"Llama with sliding_window={window} is not supported")
    return window


def _llama_config(hf: dict, kind: str) -> ModelConfig:
    """The ModelConfig of a Llama-layout config.json; the defaults are transformers' for fields
    the file leaves out."""
    arch = LABELS[kind]
    seq, eps, rope = (4096, 1e-5, 1e6) if kind == "mixtral" else (2048, 1e-6, 10000.0)
    h, heads = hf["hidden_size"], hf["num_attention_heads"]
    window = _window(hf, kind, arch)
    if hf.get("hidden_act", "silu") != "silu":
        raise MegaliteError(f"{arch} with hidden_act={hf['hidden_act']!r} is not supported (silu)")
    if hf.get("pretraining_tp", 1) != 1:
        raise MegaliteError(f"{arch} with pretraining_tp={hf['pretraining_tp']} is not supported")
    head_dim = hf.get("head_dim") or h // heads
    if kind == "deepseek_v3":  # MLA (no head_dim of its own: transformers sets the rope dims)
        experts, head_dim = hf_deepseek.model_fields(hf), h // heads  # and its MoE fields
    else:
        experts = moe_fields(hf, kind) if kind in MOE_ARCHITECTURES else {}
    return ModelConfig(
        flavour=_flavour(_features(hf, kind), arch),
        num_layers=hf["num_hidden_layers"],
        hidden_size=h,
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        ffn_hidden_size=hf["intermediate_size"],
        kv_channels=None if head_dim * heads == h else head_dim,
        seq_length=hf.get("max_position_embeddings", seq),
        # the model's context, kept apart from the sequence length a run trains at
        max_position_embeddings=hf.get("max_position_embeddings", seq),
        vocab_size=hf["vocab_size"],
        norm_epsilon=hf.get("rms_norm_eps", eps),
        **_rope(hf, rope, arch),
        attention_dropout=hf.get("attention_dropout", 0.0),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        **{"sliding_window": window, **experts},  # gpt-oss: its windows are its experts' fields
    )
