"""The mixture-of-experts fields of a Hugging Face config.json <-> ModelConfig, per architecture.

megalite/checkpoint/hf_config.py reads and writes the rest of config.json and calls these for
the MoE architecture a flavour names (`ModelFeatures.hf_moe_model_type`):

- MixtralForCausalLM: experts in every layer, softmax top-k renormalised, no shared expert;
- Qwen3MoeForCausalLM: softmax top-k, renormalised when `norm_topk_prob`; dense layers by
  `mlp_only_layers` and `decoder_sparse_step` (transformers: layer i is sparse when
  (i + 1) % step == 0 and i is not in mlp_only_layers), read as --moe-dense-layers and written
  back as mlp_only_layers with decoder_sparse_step 1;
- GptOssForCausalLM: experts in every layer (biased, clamped SwiGLU: `swiglu_limit`, alpha
  1.702), top-k then softmax over the k; `layer_types` alternating sliding/full read as
  --window-attn-skip-freq 2 (all sliding or all full: a window everywhere or nowhere);
- DeepSeek-V3 (`deepseek_v3_moe_fields` / `deepseek_v3_moe_config`, for the DeepSeek-V3
  architecture and its MLA attention to use): sigmoid scores with the correction bias,
  n_group/topk_group, norm_topk_prob, routed_scaling_factor, n_shared_experts and the first
  first_k_dense_replace layers dense.
A model its architecture cannot express is refused in one line by `moe_export`.
"""

from megalite.config import ModelConfig
from megalite.errors import MegaliteError
from megalite.model.moe import SWIGLU_ALPHA

MOE_ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                     "deepseek_v3": "DeepseekV3ForCausalLM",
                     "gpt_oss": "GptOssForCausalLM"}  # fmt: skip
LAYER_TYPES = ("sliding_attention", "full_attention")


def moe_export(cfg: ModelConfig) -> str | None:
    """The transformers model_type an MoE model exports as (its flavour's hf_moe_model_type),
    None for a dense model; one that architecture cannot express is refused in one line."""
    if not cfg.num_experts:
        return None
    kind = cfg.features.hf_moe_model_type
    qwen = kind == "qwen3_moe"  # dense layers anywhere, top-k renormalised or not
    deepseek = kind == "deepseek_v3"  # sigmoid routing, shared experts, first layers dense
    gpt_oss = kind == "gpt_oss"  # windows on alternate layers
    shared = cfg.moe_shared_expert_intermediate_size
    first_k = list(range(len(cfg.moe_dense_layers))) == cfg.moe_dense_layers
    sigmoid = cfg.moe_router_score_function == "sigmoid"
    unsupported = {
        f"the {cfg.flavour} flavour": kind is None,
        "--moe-layer-freq > 1": cfg.moe_layer_freq != 1 and not qwen,
        "--moe-dense-layers": bool(cfg.moe_dense_layers) and not (qwen or deepseek and first_k),
        "a shared expert": bool(shared) and not (deepseek and shared % cfg.moe_ffn == 0),
        "--moe-router-pre-softmax": cfg.moe_router_pre_softmax and not (qwen or deepseek),
        "the expert bias": cfg.moe_router_enable_expert_bias and not deepseek,
        "softmax router scores": not sigmoid and deepseek,
        "sigmoid router scores": sigmoid and not deepseek,
        "node-limited routing": cfg.moe_router_num_groups is not None and not deepseek,
        "a top-k scaling factor": (cfg.moe_router_topk_scaling_factor or 1.0) != 1.0
        and not deepseek,
        "a sliding window": cfg.sliding_window is not None and not gpt_oss,
    }
    why = [k for k, v in unsupported.items() if v]
    if why:
        arch = MOE_ARCHITECTURES.get(kind, "any Hugging Face MoE architecture megalite writes")
        raise MegaliteError(
            f"this mixture-of-experts model has {', '.join(why)}, which {arch} "
            "cannot express; it cannot be exported to Hugging Face"
        )
    return kind


def moe_config(cfg: ModelConfig, kind: str) -> dict:
    """What config.json adds for the MoE architecture `kind` (mixtral, qwen3_moe)."""
    out = {"architectures": [MOE_ARCHITECTURES[kind]], "model_type": kind,
           "num_experts_per_tok": cfg.moe_router_topk,
           "router_aux_loss_coef": cfg.moe_aux_loss_coeff}  # fmt: skip
    if kind == "mixtral":  # one width: every layer has experts
        out.update(intermediate_size=cfg.moe_ffn, num_local_experts=cfg.num_experts,
                   sliding_window=None)  # fmt: skip
        return out
    if kind == "gpt_oss":
        types = [LAYER_TYPES[cfg.window_of(i) is None] for i in range(cfg.num_layers)]
        out.update(intermediate_size=cfg.moe_ffn, num_local_experts=cfg.num_experts,
                   swiglu_limit=cfg.swiglu_limit, swiglu_alpha=SWIGLU_ALPHA,
                   sliding_window=cfg.sliding_window, layer_types=types)  # fmt: skip
        return out
    out.update({
        "num_experts": cfg.num_experts,
        "moe_intermediate_size": cfg.moe_ffn,
        "norm_topk_prob": not cfg.moe_router_pre_softmax,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)],
    })  # fmt: skip
    return out


def moe_fields(hf: dict, kind: str) -> dict:
    """ModelConfig's MoE fields of a mixtral or qwen3_moe config.json (transformers' defaults
    for the fields it leaves out)."""
    if kind == "mixtral":
        return {"num_experts": hf["num_local_experts"],
                "moe_router_topk": hf["num_experts_per_tok"],
                "moe_ffn_hidden_size": hf["intermediate_size"],
                "moe_aux_loss_coeff": hf.get("router_aux_loss_coef", 0.0)}  # fmt: skip
    if kind == "gpt_oss":
        return _gpt_oss_fields(hf)
    n, step = hf["num_hidden_layers"], hf.get("decoder_sparse_step", 1)
    only = set(hf.get("mlp_only_layers") or [])
    dense = [i for i in range(n) if i in only or (i + 1) % step]  # transformers' rule
    return {"num_experts": hf.get("num_experts") or hf["num_local_experts"],
            "moe_router_topk": hf["num_experts_per_tok"],
            "moe_ffn_hidden_size": hf["moe_intermediate_size"],
            "moe_router_pre_softmax": not hf.get("norm_topk_prob", False),
            "moe_aux_loss_coeff": hf.get("router_aux_loss_coef", 0.001),
            "moe_dense_layers": dense}  # fmt: skip


def _gpt_oss_fields(hf: dict) -> dict:
    """gpt-oss's experts, its clamp and its windows (sliding_window, layer_types)."""
    if hf.get("swiglu_alpha", SWIGLU_ALPHA) != SWIGLU_ALPHA:
        raise MegaliteError(f"gpt-oss with swiglu_alpha={hf['swiglu_alpha']} is not supported")
    n, window = hf["num_hidden_layers"], hf.get("sliding_window")
    types = hf.get("layer_types") or [LAYER_TYPES[i % 2] for i in range(n)]
    sliding = [t == LAYER_TYPES[0] for t in types]
    skip = None
    if not any(sliding):
        window = None
    elif not all(sliding):
        skip = 2  # the 2nd, 4th, ... layers see everything
        if sliding != [(i + 1) % skip != 0 for i in range(n)]:
            raise MegaliteError(
                "gpt-oss with layer_types other than alternating sliding/full (or all one kind) "
                "is not supported"
            )
    return {"num_experts": hf["num_local_experts"], "moe_router_topk": hf["num_experts_per_tok"],
            "moe_ffn_hidden_size": hf["intermediate_size"],
            "moe_aux_loss_coeff": hf.get("router_aux_loss_coef", 0.001),
            "swiglu_limit": float(hf.get("swiglu_limit", 7.0)),
            "sliding_window": window, "window_attn_skip_freq": skip}  # fmt: skip


def deepseek_v3_moe_fields(hf: dict) -> dict:
    """ModelConfig's MoE fields of a DeepSeek-V3 config.json: sigmoid scores with the
    e_score_correction_bias (the expert bias), n_group/topk_group, norm_topk_prob,
    routed_scaling_factor, n_shared_experts (one shared MLP of n times the expert width) and the
    first first_k_dense_replace layers dense (width intermediate_size)."""
    method, scoring = hf.get("topk_method", "noaux_tc"), hf.get("scoring_func", "sigmoid")
    if (method, scoring) != ("noaux_tc", "sigmoid"):  # what transformers' DeepseekV3 computes
        raise MegaliteError(
            f"DeepSeek-V3 with topk_method={method!r}, scoring_func={scoring!r} is not "
            "supported (noaux_tc, sigmoid)"
        )
    f, shared = hf["moe_intermediate_size"], hf.get("n_shared_experts") or 0
    groups = hf.get("n_group") or 1
    return {"num_experts": hf["n_routed_experts"], "moe_router_topk": hf["num_experts_per_tok"],
            "moe_ffn_hidden_size": f, "moe_shared_expert_intermediate_size": shared * f or None,
            "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
            "moe_router_num_groups": groups if groups > 1 else None,
            "moe_router_group_topk": hf.get("topk_group") if groups > 1 else None,
            "moe_router_pre_softmax": not hf.get("norm_topk_prob", True),
            "moe_router_topk_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
            "moe_dense_layers": list(range(hf.get("first_k_dense_replace", 0)))}  # fmt: skip


def deepseek_v3_moe_config(cfg: ModelConfig) -> dict:
    """The MoE fields of a DeepSeek-V3 config.json (the inverse of `deepseek_v3_moe_fields`;
    intermediate_size, the dense layers' width, is the architecture's like every other field)."""
    shared = cfg.moe_shared_expert_intermediate_size or 0
    return {"n_routed_experts": cfg.num_experts, "num_experts_per_tok": cfg.moe_router_topk,
            "moe_intermediate_size": cfg.moe_ffn, "n_shared_experts": shared // cfg.moe_ffn,
            "n_group": cfg.moe_router_num_groups or 1,
            "topk_group": cfg.moe_router_group_topk or 1,
            "norm_topk_prob": not cfg.moe_router_pre_softmax,
            "routed_scaling_factor": cfg.moe_router_topk_scaling_factor or 1.0,
            "first_k_dense_replace": len(cfg.moe_dense_layers)}  # fmt: skip
