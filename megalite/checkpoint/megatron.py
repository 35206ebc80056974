"""Weight names, fused tensors and configs between Megatron-LM (megatron-core GPTModel) and megalite.

Works on whole tensors, as `checkpoint/hf.py` does: a *Megatron state* here is a flat dict of
global tensors (the tp/pp/vpp/ep shards already merged by `checkpoint/megatron_files.py`), one
entry per layer, under megatron-core's local-spec names:

    embedding.word_embeddings.weight        (V_padded, h)   embedding.position_embeddings.weight
    decoder.layers.{i}.input_layernorm.{weight,bias}       decoder.layers.{i}.pre_mlp_layernorm.*
    decoder.layers.{i}.self_attention.linear_qkv.{weight,bias}   rows per query group g:
                                            [q heads of g | k of g | v of g] (each head hd rows)
    decoder.layers.{i}.self_attention.linear_proj.{weight,bias}
    decoder.layers.{i}.mlp.linear_fc1.{weight,bias}   SwiGLU: [gate | up], each whole (ffn rows)
    decoder.layers.{i}.mlp.linear_fc2.{weight,bias}
    decoder.layers.{i}.mlp.router.weight   mlp.experts.local_experts.{j}.linear_fc{1,2}.weight
                                           (j the global expert), mlp.shared_experts.linear_fc*
    decoder.final_layernorm.{weight,bias}  output_layer.weight (untied models only)

TransformerEngine names (`self_attention.linear_qkv.layer_norm_{weight,bias}` for the input norm,
`mlp.linear_fc1.layer_norm_*` for the pre-MLP norm; torch_dist uses them for every spec) are
mapped onto these by `local_names`. The vocabulary padding is stripped on import and added on
export (`padded_vocab_size`, Megatron's rule: a multiple of make_vocab_size_divisible_by * tp).

Supported (everything else in the args is refused with one line, never dropped):
- GPT-2 style: LayerNorm, GELU (the tanh approximation, which megatron gives with
  --openai-gelu or with its default bias-GELU fusion; exact-erf GELU is refused), learned
  absolute positions, biases (--add-bias-linear), tied or untied output layer;
- Llama style: RMSNorm, SwiGLU, RoPE (rotary_percent 1, not interleaved, no scaling), grouped-
  query attention, no biases, tied or untied;
- MoE (SequentialMLP local experts, TE/grouped experts by `megatron_files`): top-k softmax
  router, optional shared expert, dropless or with a capacity factor;
- kv_channels must be hidden/heads; no qk-layernorm, zero-centred gamma, MLA, MTP, post-LN.
"""

import argparse

import torch
import torch.nn.functional as F

from megalite.config import FLAVOURS, ModelConfig, ModelFeatures
from megalite.errors import MegaliteError
from megalite.model.gpt import OUTPUT, VOCAB_TENSORS, WORD_EMBEDDING

EMBEDDING = "embedding.word_embeddings.weight"
POSITIONS = "embedding.position_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
LAYER = "decoder.layers.{}."
CHECKPOINT_VERSION = 3.0

# TransformerEngine's fused norm names -> megatron-core's local-spec names
TE_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}


def local_names(name: str) -> str:
    """A parameter name with TransformerEngine's fused-norm suffixes replaced by local ones."""
    for te, local in TE_NORMS.items():
        if name.endswith("." + te):
            return name[: -len(te)] + local
    return name


def te_names(name: str) -> str:
    """The inverse of `local_names` (torch_dist keys, TE-spec state dicts)."""
    for te, local in TE_NORMS.items():
        if name.endswith("." + local) and ".shared_experts." not in name:
            return name[: -len(local)] + te
    return name


# ---- config ---------------------------------------------------------------------------------


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
    ("use_rope_scaling", lambda a: _get(a, "use_rope_scaling", False), "RoPE scaling"),
    ("rotary_seq_len_interpolation_factor",
     lambda a: _get(a, "rotary_seq_len_interpolation_factor", 1) not in (1, 1.0),
     "RoPE interpolation"),
    ("apply_layernorm_1p", lambda a: _get(a, "apply_layernorm_1p", False), "zero-centred gamma"),
    ("layernorm_zero_centered_gamma",
     lambda a: _get(a, "layernorm_zero_centered_gamma", False), "zero-centred gamma"),
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
     "the expert bias (megalite does not checkpoint it)"),
    ("moe_layer_freq", lambda a: not isinstance(_get(a, "moe_layer_freq", 1), int),
     "a per-layer MoE pattern"),
    ("moe_pad_expert_input_to_capacity",
     lambda a: _get(a, "moe_pad_expert_input_to_capacity", False), "padding to capacity"),
)  # fmt: skip


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
    """The megalite flavour with these features (tying and the HF layout aside)."""
    keys = ("norm", "position", "gated_mlp", "qkv_bias", "linear_bias")
    mine = {k: getattr(features, k) for k in keys}
    for name, row in FLAVOURS.items():
        if mine == {k: getattr(row, k) for k in keys}:
            return name
    what = ", ".join(f"{k}={v}" for k, v in mine.items())
    raise MegaliteError(
        f"a Megatron model with {what} has no megalite flavour (megalite.config.FLAVOURS)"
    )


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
            "moe_expert_capacity_factor": a.get("moe_expert_capacity_factor"),
        }
    seq = _get(a, "seq_length", _get(a, "max_position_embeddings", 2048))
    return ModelConfig(
        flavour=_flavour(features),
        num_layers=a["num_layers"],
        hidden_size=h,
        num_attention_heads=heads,
        num_query_groups=groups if groups != heads else None,
        ffn_hidden_size=_get(a, "ffn_hidden_size", 4 * h),
        seq_length=seq,
        max_position_embeddings=a.get("max_position_embeddings") if features.learned_positions
        else None,
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


def padded_vocab_size(cfg: ModelConfig, tp: int) -> int:
    """Megatron's padded vocabulary: a multiple of make_vocab_size_divisible_by * tp."""
    return cfg.padded_vocab_size(tp)


def args_from_config(cfg: ModelConfig, tp=1, pp=1, vpp=None, ep=1, iteration=0) -> dict:
    """The fields of a Megatron `args` Namespace that rebuild this model at this layout."""
    f = cfg.features
    groups = cfg.heads_kv
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
        "openai_gelu": not f.gated_mlp,  # megalite's GELU is the tanh approximation
        "position_embedding_type": "rope" if f.rotary else "learned_absolute",
        "rotary_base": int(cfg.rotary_base) if float(cfg.rotary_base).is_integer()
        else cfg.rotary_base,
        "rotary_percent": 1.0,
        "untie_embeddings_and_output_weights": not cfg.tied,
        "add_bias_linear": f.linear_bias,
        "add_qkv_bias": f.qkv_bias,
        "layernorm_epsilon": cfg.norm_epsilon,
        "norm_epsilon": cfg.norm_epsilon,
        "max_position_embeddings": (cfg.max_position_embeddings or cfg.seq_length)
        if f.learned_positions else cfg.seq_length,
        "seq_length": cfg.seq_length,
        "vocab_size": cfg.vocab_size,
        "padded_vocab_size": padded_vocab_size(cfg, tp),
        "make_vocab_size_divisible_by": cfg.make_vocab_size_divisible_by,
        "hidden_dropout": cfg.hidden_dropout,
        "attention_dropout": cfg.attention_dropout,
        "init_method_std": cfg.init_method_std,
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "virtual_pipeline_model_parallel_size": vpp if vpp and vpp > 1 else None,
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": tp,
        "iteration": iteration,
        "num_experts": cfg.num_experts,
    }  # fmt: skip
    if cfg.num_experts:
        args.update({
            "moe_router_topk": cfg.moe_router_topk,
            "moe_ffn_hidden_size": cfg.moe_ffn,
            "moe_shared_expert_intermediate_size": cfg.moe_shared_expert_intermediate_size,
            "moe_layer_freq": cfg.moe_layer_freq,
            "moe_aux_loss_coeff": cfg.moe_aux_loss_coeff,
            "moe_z_loss_coeff": cfg.moe_z_loss_coeff,
            "moe_router_pre_softmax": cfg.moe_router_pre_softmax,
            "moe_expert_capacity_factor": cfg.moe_expert_capacity_factor,
            "moe_router_load_balancing_type": "aux_loss",
        })  # fmt: skip
    return args


# ---- tensor names and shapes ----------------------------------------------------------------


def _mlp_names(cfg: ModelConfig, m: str, g: str, ffn: int):
    """(megalite, megatron, shape) of one dense MLP (or shared expert): fc1 is split below."""
    h, bias = cfg.hidden_size, cfg.features.linear_bias
    yield None, g + "linear_fc1.weight", ((2 if cfg.features.gated_mlp else 1) * ffn, h)
    if bias:
        yield None, g + "linear_fc1.bias", ((2 if cfg.features.gated_mlp else 1) * ffn,)
    yield m + "down.weight", g + "linear_fc2.weight", (h, ffn)
    if bias:
        yield m + "down.bias", g + "linear_fc2.bias", (h,)


def megatron_shapes(cfg: ModelConfig, padded_vocab: int) -> dict:
    """{megatron name: global shape} of every tensor of this model (the Megatron state)."""
    return {n: s for _, n, s in _names(cfg, padded_vocab)}


def _names(cfg: ModelConfig, padded_vocab: int):
    """(megalite name or None for the fused ones, megatron name, global shape)."""
    h, f = cfg.hidden_size, cfg.features
    yield WORD_EMBEDDING, EMBEDDING, (padded_vocab, h)
    if f.learned_positions:
        yield (
            "embedding.position.weight",
            POSITIONS,
            (cfg.max_position_embeddings or cfg.seq_length, h),
        )
    qkv = (cfg.num_attention_heads + 2 * cfg.heads_kv) * cfg.head_dim
    norms = ("weight",) if f.rms_norm else ("weight", "bias")
    for i in range(cfg.num_layers):
        m, g = f"layers.{i}.", LAYER.format(i)
        for x in norms:
            yield m + f"input_norm.{x}", g + f"input_layernorm.{x}", (h,)
            yield m + f"post_attention_norm.{x}", g + f"pre_mlp_layernorm.{x}", (h,)
        yield None, g + "self_attention.linear_qkv.weight", (qkv, h)
        if f.qkv_bias:
            yield None, g + "self_attention.linear_qkv.bias", (qkv,)
        yield m + "attention.out.weight", g + "self_attention.linear_proj.weight", (h, h)
        if f.linear_bias:
            yield m + "attention.out.bias", g + "self_attention.linear_proj.bias", (h,)
        if not cfg.is_moe_layer(i):
            yield from _mlp_names(cfg, m + "mlp.", g + "mlp.", cfg.ffn)
            continue
        yield m + "mlp.router.weight", g + "mlp.router.weight", (cfg.num_experts, h)
        fc1 = (2 if f.gated_mlp else 1) * cfg.moe_ffn
        for j in range(cfg.num_experts):
            e = g + f"mlp.experts.local_experts.{j}."
            yield None, e + "linear_fc1.weight", (fc1, h)
            yield None, e + "linear_fc2.weight", (h, cfg.moe_ffn)
        if cfg.moe_shared_expert_intermediate_size:
            size = cfg.moe_shared_expert_intermediate_size
            yield from _mlp_names(cfg, m + "mlp.shared.", g + "mlp.shared_experts.", size)
    for x in norms:
        yield f"final_norm.{x}", f"decoder.final_layernorm.{x}", (h,)
    if not cfg.tied:
        yield OUTPUT, OUTPUT_LAYER, (padded_vocab, h)


def check_shapes(state: dict, cfg: ModelConfig, where: str):
    """Every tensor the args imply is there with the shape they imply (one line if not)."""
    vocab = state[EMBEDDING].shape[0] if EMBEDDING in state else cfg.vocab_size
    if vocab < cfg.vocab_size:
        raise MegaliteError(
            f"{where}: {EMBEDDING} has {vocab} rows but the args say the vocabulary is "
            f"{cfg.vocab_size}; the args contradict the tensors"
        )
    for name, shape in megatron_shapes(cfg, vocab).items():
        if name not in state:
            raise MegaliteError(
                f"{where} lacks the tensor {name} that its args imply; is it a complete "
                f"{cfg.flavour}-style model?"
            )
        if tuple(state[name].shape) != tuple(shape):
            raise MegaliteError(
                f"{where}: {name} has shape {tuple(state[name].shape)} but the checkpoint's args "
                f"imply {tuple(shape)}; the args contradict the tensors"
            )


# ---- fused tensors ----------------------------------------------------------------------------


def split_qkv(w: torch.Tensor, cfg: ModelConfig):
    """linear_qkv rows (per query group: q heads of the group, k, v) -> q, k, v."""
    groups, hd = cfg.heads_kv, cfg.head_dim
    per = cfg.num_attention_heads // groups
    x = w.reshape(groups, per + 2, hd, *w.shape[1:])
    q = x[:, :per].reshape(groups * per * hd, *w.shape[1:])
    return q.contiguous(), x[:, per].reshape(groups * hd, *w.shape[1:]).contiguous(), \
        x[:, per + 1].reshape(groups * hd, *w.shape[1:]).contiguous()  # fmt: skip


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig):
    groups, hd = cfg.heads_kv, cfg.head_dim
    per = cfg.num_attention_heads // groups
    rest = q.shape[1:]
    parts = (q.reshape(groups, per, hd, *rest), k.reshape(groups, 1, hd, *rest),
             v.reshape(groups, 1, hd, *rest))  # fmt: skip
    return torch.cat(parts, 1).reshape(-1, *rest).contiguous()


def from_megatron(state: dict, cfg: ModelConfig, where: str = "the Megatron checkpoint") -> dict:
    """A Megatron state (global tensors, local names) -> megalite's logical tensors, the
    vocabulary padding stripped (what megalite's format stores)."""
    state = {local_names(k): v for k, v in state.items()}
    check_shapes(state, cfg, where)
    vocab = state[EMBEDDING].shape[0]
    out = {}
    for m, g, _ in _names(cfg, vocab):
        if m is not None:
            out[m] = state[g]
    for i in range(cfg.num_layers):
        m, g = f"layers.{i}.", LAYER.format(i)
        a = g + "self_attention.linear_qkv."
        for x, t in zip("qkv", split_qkv(state[a + "weight"], cfg)):
            out[m + f"attention.{x}.weight"] = t
        if cfg.features.qkv_bias:
            for x, t in zip("qkv", split_qkv(state[a + "bias"], cfg)):
                out[m + f"attention.{x}.bias"] = t
        if not cfg.is_moe_layer(i):
            out.update(_fc1_from(state, cfg, m + "mlp.", g + "mlp."))
            continue
        if cfg.moe_shared_expert_intermediate_size:
            out.update(_fc1_from(state, cfg, m + "mlp.shared.", g + "mlp.shared_experts."))
        e = g + "mlp.experts.local_experts.{}."
        first = "gate_up" if cfg.features.gated_mlp else "up"
        out[m + f"mlp.experts.{first}.weight"] = torch.stack(
            [state[e.format(j) + "linear_fc1.weight"] for j in range(cfg.num_experts)]
        )
        out[m + "mlp.experts.down.weight"] = torch.stack(
            [state[e.format(j) + "linear_fc2.weight"] for j in range(cfg.num_experts)]
        )
    for name in VOCAB_TENSORS:
        if name in out:
            out[name] = out[name][: cfg.vocab_size]
    return {k: v.contiguous() for k, v in out.items()}


def _fc1_from(state, cfg, m, g):
    out = {}
    for x in ("weight", "bias") if cfg.features.linear_bias else ("weight",):
        t = state[g + f"linear_fc1.{x}"]
        if cfg.features.gated_mlp:
            out[m + f"gate.{x}"], out[m + f"up.{x}"] = t.chunk(2)
        else:
            out[m + f"up.{x}"] = t
    return out


def to_megatron(logical: dict, cfg: ModelConfig, padded_vocab: int) -> dict:
    """megalite's logical tensors (any vocabulary padding) -> a Megatron state with the
    vocabulary padded to `padded_vocab` rows (zeros, as Megatron initialises nothing there)."""
    out = {}
    for m, g, _ in _names(cfg, padded_vocab):
        if m is not None:
            out[g] = logical[m]
    for name in (EMBEDDING, OUTPUT_LAYER):
        if name in out:
            t = out[name][: cfg.vocab_size]
            out[name] = F.pad(t, (0, 0, 0, padded_vocab - t.shape[0]))
    for i in range(cfg.num_layers):
        m, g = f"layers.{i}.", LAYER.format(i)
        a = g + "self_attention.linear_qkv."
        out[a + "weight"] = merge_qkv(*(logical[m + f"attention.{x}.weight"] for x in "qkv"),
                                      cfg)  # fmt: skip
        if cfg.features.qkv_bias:
            out[a + "bias"] = merge_qkv(*(logical[m + f"attention.{x}.bias"] for x in "qkv"), cfg)
        if not cfg.is_moe_layer(i):
            out.update(_fc1_to(logical, cfg, m + "mlp.", g + "mlp."))
            continue
        if cfg.moe_shared_expert_intermediate_size:
            out.update(_fc1_to(logical, cfg, m + "mlp.shared.", g + "mlp.shared_experts."))
        first = "gate_up" if cfg.features.gated_mlp else "up"
        fc1, fc2 = (
            logical[m + f"mlp.experts.{first}.weight"],
            logical[m + "mlp.experts.down.weight"],
        )
        for j in range(cfg.num_experts):
            e = g + f"mlp.experts.local_experts.{j}."
            out[e + "linear_fc1.weight"], out[e + "linear_fc2.weight"] = fc1[j], fc2[j]
    return {k: v.contiguous() for k, v in out.items()}


def _fc1_to(logical, cfg, m, g):
    out = {}
    for x in ("weight", "bias") if cfg.features.linear_bias else ("weight",):
        parts = [logical[m + f"{p}.{x}"] for p in (("gate", "up") if cfg.features.gated_mlp
                                                   else ("up",))]  # fmt: skip
        out[g + f"linear_fc1.{x}"] = torch.cat(parts)
    return out
