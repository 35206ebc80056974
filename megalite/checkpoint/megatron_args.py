"""megalite's ModelConfig from a Megatron checkpoint's `args`, and the args of an export.

`config_from_args` reads the fields that shape the model (num_layers, hidden_size,
ffn_hidden_size, num_attention_heads, group_query_attention/num_query_groups, kv_channels,
normalization, swiglu, position_embedding_type, rotary_base, untie_embeddings_and_output_weights,
vocab_size/padded_vocab_size, add_bias_linear/add_qkv_bias, layernorm_epsilon,
max_position_embeddings, seq_length, the MoE fields) and refuses, with one line, any field set to
something megalite cannot honour (`_UNSUPPORTED`; checkpoint/megatron.py lists what is supported).
`args_from_config` writes the fields a Megatron run needs to rebuild the model at a layout.
"""

import argparse
from dataclasses import fields

import torch

from megalite.errors import MegaliteError
from megalite.megatron_translate import resolve_flavour
from megalite.model_config import ModelConfig, ModelFeatures


def _get(args: dict, name: str, default=None):
    v = args.get(name, default)
    return default if v is None else v


def _gelu_is_tanh(args: dict) -> bool:
    """Megatron's GELU is exact (erf) unless --openai-gelu, or its bias-GELU fusion (on by
    default, and only with biases) runs the tanh approximation megalite uses."""
    if _get(args, "openai_gelu", False):
        return True
    return bool(_get(args, "bias_gelu_fusion", True)) and bool(_get(args, "add_bias_linear", True))


# (field, predicate on args that megalite cannot honour, what it is)
_UNSUPPORTED = (
    ("rotary_percent", lambda a: _get(a, "rotary_percent", 1.0) != 1.0, "partial rotary"),
    ("rotary_interleaved", lambda a: _get(a, "rotary_interleaved", False), "interleaved RoPE"),
    ("use_rope_scaling", lambda a: _get(a, "use_rope_scaling", False)
     and _get(a, "rotary_seq_len_interpolation_factor", 1) not in (1, 1.0),
     "both llama3 RoPE scaling and RoPE interpolation"),
    ("qk_layernorm", lambda a: _get(a, "qk_layernorm", False), "qk layernorm"),
    ("apply_residual_connection_post_layernorm",
     lambda a: _get(a, "apply_residual_connection_post_layernorm", False), "post-LN residuals"),
    ("multi_latent_attention", lambda a: _get(a, "multi_latent_attention", False), "MLA"),
    ("mtp_num_layers", lambda a: _get(a, "mtp_num_layers", 0) > 0, "multi-token prediction"),
    ("squared_relu", lambda a: _get(a, "squared_relu", False), "squared ReLU"),
    ("openai_gelu", lambda a: not _get(a, "swiglu", False) and not _gelu_is_tanh(a),
     "exact (erf) GELU, megalite's is the tanh approximation (--openai-gelu)"),
    ("heterogeneous_layers_config_path",
     lambda a: bool(_get(a, "heterogeneous_layers_config_path", None)), "heterogeneous layers"),
    ("moe_router_score_function",
     lambda a: _get(a, "moe_router_score_function", "softmax") != "softmax", "sigmoid routing"),
    ("moe_router_num_groups", lambda a: _get(a, "moe_router_num_groups", 0) > 0,
     "group-limited routing"),
    ("moe_router_topk_scaling_factor",
     lambda a: _get(a, "moe_router_topk_scaling_factor", 1.0) not in (1, 1.0), "top-k scaling"),
    ("moe_shared_expert_gate", lambda a: _get(a, "moe_shared_expert_gate", False),
     "a gated shared expert"),
    ("moe_router_enable_expert_bias", lambda a: _get(a, "moe_router_enable_expert_bias", False),
     "the expert bias (not converted, as the sigmoid routing it comes with)"),
    ("moe_layer_freq", lambda a: not isinstance(_get(a, "moe_layer_freq", 1), int),
     "a per-layer MoE pattern"),
    ("moe_pad_expert_input_to_capacity",
     lambda a: _get(a, "moe_pad_expert_input_to_capacity", False), "padding to capacity"),
    ("moe_expert_capacity_factor",
     lambda a: _get(a, "num_experts", 0) and a.get("moe_expert_capacity_factor") is not None,
     "token dropping (megalite drops in its own order; Megatron's is not reproduced)"),
    ("moe_router_load_balancing_type",
     lambda a: _get(a, "num_experts", 0)
     and _get(a, "moe_router_load_balancing_type", "aux_loss") not in ("aux_loss", "none"),
     "a load-balancing scheme other than the Switch auxiliary loss"),
    ("add_bias_linear", lambda a: _get(a, "num_experts", 0) and _get(a, "add_bias_linear", True),
     "expert biases (megalite's experts have none)"),
)  # fmt: skip


def zero_centred_gamma(args) -> bool:
    """Whether the checkpoint's norm weights are stored as their offset from 1
    (--apply-layernorm-1p: megatron-core's layernorm_zero_centered_gamma)."""
    a = dict(vars(args)) if isinstance(args, argparse.Namespace) else dict(args)
    return bool(_get(a, "apply_layernorm_1p", False)) or bool(
        _get(a, "layernorm_zero_centered_gamma", False)
    )


def _features(args: dict) -> ModelFeatures:
    norm = _get(args, "normalization", "LayerNorm")
    position = _get(args, "position_embedding_type", "learned_absolute")
    norms = {"LayerNorm": "layernorm", "RMSNorm": "rmsnorm"}
    positions = {"learned_absolute": "learned", "rope": "rotary"}
    if norm not in norms:
        raise MegaliteError(
            f"Megatron normalization={norm!r} is not supported (LayerNorm, RMSNorm)"
        )
    if position not in positions:
        raise MegaliteError(
            f"Megatron position_embedding_type={position!r} is not supported (learned_absolute, rope)"
        )
    bias = bool(_get(args, "add_bias_linear", True))
    return ModelFeatures(norms[norm], positions[position], gated_mlp=bool(_get(args, "swiglu", False)),
                         qkv_bias=bias or bool(_get(args, "add_qkv_bias", False)),
                         linear_bias=bias, tied=False, hf_model_type="")  # fmt: skip


def _flavour(features: ModelFeatures) -> str:
    """The megalite flavour of the checkpoint's architecture args: the one the same Megatron
    flags pick on a command line (megatron_translate.resolve_flavour). Megatron's LayerNorm
    always has a bias; its GELU is tanh here (exact is refused above)."""
    mlp = "swiglu" if features.gated_mlp else "gelu"
    asked = {"norm": features.norm, "position": features.position, "mlp": mlp,
             "linear_bias": features.linear_bias, "qkv_bias": features.qkv_bias}  # fmt: skip
    return resolve_flavour(asked, "the Megatron checkpoint's args describe")


def config_from_args(args, vocab_size: int | None = None) -> ModelConfig:
    """megalite's ModelConfig from a Megatron checkpoint's `args` (a Namespace or dict).
    `vocab_size`: the real vocabulary when the args hold only the padded one."""
    a = dict(vars(args)) if isinstance(args, argparse.Namespace) else dict(args)
    for field, bad, what in _UNSUPPORTED:
        if bad(a):
            raise MegaliteError(
                f"the Megatron checkpoint uses {what} ({field}={a.get(field)!r}), which megalite "
                "cannot honour; it cannot be converted"
            )
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads") if a.get(k) is None]
    if missing:
        raise MegaliteError(f"the Megatron checkpoint's args lack {', '.join(missing)}")
    h, heads = a["hidden_size"], a["num_attention_heads"]
    if _get(a, "kv_channels", h // heads) != h // heads:
        raise MegaliteError(
            f"Megatron kv_channels={a['kv_channels']} != hidden_size/num_attention_heads="
            f"{h // heads} is not supported: megalite's head dimension is hidden/heads"
        )
    features = _features(a)
    groups = a.get("num_query_groups") if _get(a, "group_query_attention", False) else None
    vocab = vocab_size or a.get("vocab_size") or a.get("padded_vocab_size")
    if vocab is None:
        raise MegaliteError(
            "the Megatron checkpoint's args hold neither vocab_size nor padded_vocab_size; pass "
            "--vocab-size"
        )
    experts = {}
    if _get(a, "num_experts", 0):
        experts = {
            "num_experts": a["num_experts"],
            "moe_router_topk": _get(a, "moe_router_topk", 2),
            "moe_ffn_hidden_size": a.get("moe_ffn_hidden_size"),
            "moe_shared_expert_intermediate_size": a.get("moe_shared_expert_intermediate_size"),
            "moe_layer_freq": _get(a, "moe_layer_freq", 1),
            "moe_aux_loss_coeff": float(_get(a, "moe_aux_loss_coeff", 0.0)),
            "moe_z_loss_coeff": float(_get(a, "moe_z_loss_coeff", 0.0)),
            "moe_router_pre_softmax": bool(_get(a, "moe_router_pre_softmax", False)),
        }
    seq = _get(a, "seq_length", _get(a, "max_position_embeddings", 2048))
    return ModelConfig(
        **_rope_from_args(a),
        flavour=_flavour(features),
        num_layers=a["num_layers"],
        hidden_size=h,
        num_attention_heads=heads,
        num_query_groups=groups if groups != heads else None,
        ffn_hidden_size=_get(a, "ffn_hidden_size", 4 * h),
        seq_length=seq,
        # the model's context (a RoPE model's too), apart from the run's sequence length
        max_position_embeddings=a.get("max_position_embeddings"),
        vocab_size=vocab,
        make_vocab_size_divisible_by=_get(a, "make_vocab_size_divisible_by", 128),
        hidden_dropout=float(_get(a, "hidden_dropout", 0.0)),
        attention_dropout=float(_get(a, "attention_dropout", 0.0)),
        norm_epsilon=float(_get(a, "layernorm_epsilon", _get(a, "norm_epsilon", 1e-5))),
        rotary_base=float(_get(a, "rotary_base", 10000)),
        init_method_std=float(_get(a, "init_method_std", 0.02)),
        untie_embeddings_and_output_weights=bool(
            _get(a, "untie_embeddings_and_output_weights", False)
        ),
        **experts,
    )  # fmt: skip


# megatron-core's llama3 RoPE scaling (RotaryEmbedding._apply_scaling): only the factor is an
# argument (--rope-scaling-factor); the other three are fixed there
MEGATRON_LLAMA3 = {"rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
                   "rope_original_max_position_embeddings": 8192}  # fmt: skip


def _rope_from_args(a: dict) -> dict:
    """ModelConfig's RoPE scaling fields from --use-rope-scaling (llama3) or
    --rotary-seq-len-interpolation-factor (linear: positions / factor)."""
    if _get(a, "use_rope_scaling", False):
        factor = float(_get(a, "rope_scaling_factor", 8.0))
        return {"rope_scaling": "llama3", "rope_scaling_factor": factor, **MEGATRON_LLAMA3}
    linear = _get(a, "rotary_seq_len_interpolation_factor", 1)
    if linear not in (1, 1.0):
        return {"rope_scaling": "linear", "rope_scaling_factor": float(linear)}
    return {}


def rope_args(cfg: ModelConfig) -> dict:
    """The Megatron args of this model's RoPE scaling, or one line saying Megatron cannot
    express it (yarn; llama3 with other than megatron-core's fixed low/high/original)."""
    kind = cfg.rope_scaling if cfg.features.rotary else "none"
    off = {"use_rope_scaling": False, "rope_scaling_factor": 8.0,
           "rotary_seq_len_interpolation_factor": None}  # fmt: skip
    if kind == "none":
        return off
    if kind == "linear":
        return {**off, "rotary_seq_len_interpolation_factor": cfg.rope_scaling_factor}
    fixed = {k: getattr(cfg, k) for k in MEGATRON_LLAMA3}
    if kind == "llama3" and fixed == MEGATRON_LLAMA3:
        return {**off, "use_rope_scaling": True, "rope_scaling_factor": cfg.rope_scaling_factor}
    what = (f"llama3 RoPE scaling with {', '.join(f'{k}={v}' for k, v in fixed.items())}"
            if kind == "llama3" else f"{kind} RoPE scaling")  # fmt: skip
    raise MegaliteError(
        f"this model uses {what}, which Megatron-LM cannot express (it has --use-rope-scaling "
        "for llama3 with low_freq_factor 1, high_freq_factor 4, original context 8192, and "
        "--rotary-seq-len-interpolation-factor for linear); it cannot be exported"
    )


def padded_vocab_size(cfg: ModelConfig, tp: int) -> int:
    """Megatron's padded vocabulary: a multiple of make_vocab_size_divisible_by * tp."""
    return cfg.padded_vocab_size(tp)


# Megatron-LM's args of an uneven pipeline split (and their defaults): partition.py's flags
PIPELINE_SPLIT_ARGS = {
    "decoder_first_pipeline_num_layers": None,
    "decoder_last_pipeline_num_layers": None,
    "account_for_embedding_in_pipeline_split": False,
    "account_for_loss_in_pipeline_split": False,
    "pipeline_model_parallel_layout": None,
}


def args_from_config(cfg: ModelConfig, tp=1, pp=1, vpp=None, ep=1, iteration=0,
                     dtype=torch.float32, ckpt_format="torch_dist", transformer_impl="local",
                     stages: dict | None = None) -> dict:  # fmt: skip
    """The fields of a Megatron `args` Namespace that rebuild this model at this layout (the
    ones --use-checkpoint-args takes, and those check_checkpoint_args compares). `stages`:
    uneven pipeline stages, Megatron's flags by their args names (PIPELINE_SPLIT_ARGS)."""
    refused = {"--moe-expert-capacity-factor (megalite's drop order is its own)":
               cfg.moe_expert_capacity_factor is not None and cfg.num_experts,
               "--moe-router-enable-expert-bias (the converter does not map the bias)":
               cfg.moe_router_enable_expert_bias and cfg.num_experts,
               "LayerNorms without a bias (Megatron's LayerNorm always has one)":
               not (cfg.features.rms_norm or cfg.features.norm_bias)}  # fmt: skip
    if any(refused.values()):
        raise MegaliteError(
            f"this model uses {', '.join(k for k, v in refused.items() if v)}, which a Megatron "
            "checkpoint cannot carry; it cannot be exported"
        )
    f = cfg.features
    groups = cfg.heads_kv
    vpp = vpp if vpp and vpp > 1 else None
    args = {
        "num_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "ffn_hidden_size": cfg.ffn,
        "num_attention_heads": cfg.num_attention_heads,
        "group_query_attention": groups != cfg.num_attention_heads,
        "num_query_groups": groups,
        "kv_channels": cfg.head_dim,
        "normalization": "RMSNorm" if f.rms_norm else "LayerNorm",
        "swiglu": f.gated_mlp,
        "openai_gelu": not f.gated_mlp and f.gelu == "tanh",  # GPT-2's tanh approximation
        "position_embedding_type": "rope" if f.rotary else "learned_absolute",
        "rotary_base": int(cfg.rotary_base) if float(cfg.rotary_base).is_integer()
        else cfg.rotary_base,
        "rotary_percent": 1.0,
        **rope_args(cfg),
        "untie_embeddings_and_output_weights": not cfg.tied,
        "add_bias_linear": f.linear_bias,
        "add_qkv_bias": f.qkv_bias,
        "layernorm_epsilon": cfg.norm_epsilon,
        "norm_epsilon": cfg.norm_epsilon,
        "max_position_embeddings": context(cfg),
        "seq_length": cfg.seq_length,
        "vocab_size": cfg.vocab_size,
        "padded_vocab_size": padded_vocab_size(cfg, tp),
        "make_vocab_size_divisible_by": cfg.make_vocab_size_divisible_by,
        "hidden_dropout": cfg.hidden_dropout,
        "attention_dropout": cfg.attention_dropout,
        "init_method_std": cfg.init_method_std,
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "virtual_pipeline_model_parallel_size": vpp,
        "num_layers_per_virtual_pipeline_stage": cfg.num_layers // pp // vpp
        if vpp and not any((stages or {}).values()) else None,
        **{k: (stages or {}).get(k, PIPELINE_SPLIT_ARGS[k]) for k in PIPELINE_SPLIT_ARGS},
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": tp,
        "iteration": iteration,
        "num_experts": cfg.num_experts,
        "add_position_embedding": True,  # Megatron's default; position_embedding_type decides
        "use_rotary_position_embeddings": f.rotary,
        "rotary_interleaved": False,
        "apply_layernorm_1p": False,
        "squared_relu": False,
        "qk_layernorm": False,
        "params_dtype": dtype,
        "bf16": dtype == torch.bfloat16,
        "fp16": dtype == torch.float16,
        "ckpt_format": ckpt_format,
        "use_dist_ckpt": ckpt_format != "torch",
        "transformer_impl": transformer_impl,
        "tokenizer_type": None,  # megalite's tokenizer is not one of Megatron's named types
        "data_parallel_random_init": False,
    }  # fmt: skip
    _moe_args(cfg, args)
    _refuse_what_is_lost(cfg, args)
    return args


# ModelConfig fields an export need not carry: the flavour's name (Megatron's args name features,
# compared below), training-only numbers, and where a HF architecture keeps its files' names
_NOT_CARRIED = {"flavour", "init_method_std", "hidden_dropout", "attention_dropout",
                "moe_aux_loss_coeff", "moe_z_loss_coeff", "mtp_loss_scaling_factor"}  # fmt: skip
_FEATURES_NOT_CARRIED = {"doc", "tied", "hf_model_type", "hf_moe_model_type"}


def _refuse_what_is_lost(cfg: ModelConfig, args: dict):
    """Read the args back as an import would and refuse, in one line, any model field that
    does not come back: never a Megatron checkpoint of a different model."""
    try:
        back = config_from_args(args)
    except MegaliteError as e:
        raise MegaliteError(f"this model cannot be exported to Megatron-LM: {e}") from None
    lost = [f.name for f in fields(cfg) if f.name not in _NOT_CARRIED | _ROPE_FIELDS
            and resolved(cfg, f.name) != resolved(back, f.name)]  # fmt: skip
    if cfg.features.rotary:  # the scaling's parameters, those of the scaling in use
        lost += [k for k in _ROPE_USED[cfg.rope_scaling] if getattr(cfg, k) != getattr(back, k)]
    lost += [f"features.{f.name}" for f in fields(cfg.features)
             if f.name not in _FEATURES_NOT_CARRIED
             and getattr(cfg.features, f.name) != getattr(back.features, f.name)]  # fmt: skip
    if lost:
        what = ", ".join(f"{k}={_field(cfg, k)!r}" for k in lost)
        raise MegaliteError(
            f"this {cfg.flavour} model has {what}, which a Megatron-LM checkpoint's args cannot "
            "carry (megalite's Megatron converter maps none of it); it cannot be exported"
        )


# fields whose None means a default: compared as the model resolves them
_RESOLVED = {"ffn_hidden_size": lambda c: c.ffn, "num_query_groups": lambda c: c.heads_kv,
             "kv_channels": lambda c: c.head_dim, "moe_ffn_hidden_size": lambda c: c.moe_ffn,
             "untie_embeddings_and_output_weights": lambda c: not c.tied,
             "max_position_embeddings": lambda c: context(c)}  # fmt: skip
_ROPE_USED = {"none": (), "linear": ("rope_scaling_factor",),
              "llama3": ("rope_scaling_factor", *MEGATRON_LLAMA3), "yarn": ()}  # fmt: skip
_ROPE_FIELDS = {"rope_scaling_factor", "rope_original_max_position_embeddings",
                "rope_low_freq_factor", "rope_high_freq_factor", "yarn_beta_fast",
                "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim", "yarn_attention_factor",
                "yarn_truncate"}  # fmt: skip


def context(cfg: ModelConfig) -> int:
    """Megatron's max_position_embeddings: a learned table's size; a RoPE model's declared
    context (a run at a shorter --seq-length keeps it), at least the sequence length (Megatron
    requires it)."""
    if cfg.features.learned_positions:
        return cfg.max_position_embeddings or cfg.seq_length
    return max(cfg.max_position_embeddings or 0, cfg.seq_length)


def resolved(cfg: ModelConfig, name: str):
    """A ModelConfig field as the model resolves it (a None that means a default, the default)."""
    if name in _RESOLVED and (name != "moe_ffn_hidden_size" or cfg.num_experts):
        return _RESOLVED[name](cfg)
    if name == "rope_scaling" and not cfg.features.rotary:
        return None  # learned positions: no RoPE to scale
    return getattr(cfg, name)


def _field(cfg: ModelConfig, name: str):
    return getattr(cfg.features, name[len("features.") :]) if name.startswith("features.") \
        else getattr(cfg, name)  # fmt: skip


def _moe_args(cfg: ModelConfig, args: dict):
    if cfg.num_experts:
        args.update({
            "moe_router_topk": cfg.moe_router_topk,
            "moe_ffn_hidden_size": cfg.moe_ffn,
            "moe_shared_expert_intermediate_size": cfg.moe_shared_expert_intermediate_size,
            "moe_layer_freq": cfg.moe_layer_freq,
            "moe_aux_loss_coeff": cfg.moe_aux_loss_coeff,
            "moe_z_loss_coeff": cfg.moe_z_loss_coeff,
            "moe_router_pre_softmax": cfg.moe_router_pre_softmax,
            "moe_router_load_balancing_type": "aux_loss",
        })  # fmt: skip
