"""The model's configuration: `ModelConfig` (every field a flag, see megalite/config/) and the
feature table `FLAVOURS` its flavours name. Data only: imports nothing of megalite."""

import dataclasses
from dataclasses import dataclass, field


def opt(default, doc, *aliases, choices=None):
    """A config field: its default, its documentation, any extra flag names and, where the
    values are a fixed set, its choices."""
    kw = {"default_factory": default} if callable(default) else {"default": default}
    return field(**kw, metadata={"doc": doc, "aliases": aliases, "choices": choices})


@dataclass(frozen=True)
class ModelFeatures:
    """What a flavour decides about the architecture. Code asks these fields (`cfg.features`),
    never the flavour's name, so a new family (Qwen: qkv biases, ...) is one row of FLAVOURS.
    Hugging Face import derives them from a config.json (checkpoint/hf.py) and finds the row."""

    norm: str  # "layernorm" (weight and bias) or "rmsnorm" (weight only)
    position: str  # "learned" (a position table added to the embedding) or "rotary" (RoPE)
    gated_mlp: bool  # SwiGLU: silu(gate) * up; else GELU(up)
    qkv_bias: bool  # biases on the q, k, v projections (Megatron's --add-qkv-bias)
    linear_bias: bool  # biases on the other linears: attention out, MLP (--add-bias-linear)
    tied: bool  # the output layer is the word embedding unless --untie-... says otherwise
    hf_model_type: str  # transformers' model_type with this weight layout (checkpoint/hf.py)
    doc: str = ""
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen3; Megatron's
    # --qk-layernorm)
    latent_attention: bool = False  # multi-head latent attention (DeepSeek-V2/V3, model/mla.py):
    # low-rank q and kv with their norms, a decoupled RoPE key shared by the heads
    moe_bias: bool = False  # biases on the router and the experts (gpt-oss)
    clamped_swiglu: bool = False  # experts' SwiGLU as gpt-oss: (up + 1) g sigmoid(1.702 g),
    # gate and up clamped at --swiglu-limit
    hf_moe_model_type: str | None = None  # transformers' model_type of this layout with experts
    attention_sinks: bool = False  # a learned logit per head in the softmax (gpt-oss)
    norm_bias: bool = True  # LayerNorm with a bias (nanoGPT's bias=False drops it; RMSNorm: none)
    gelu: str = "tanh"  # the MLP's GELU: "tanh" (GPT-2's approximation) or "exact" (erf)

    @property
    def rms_norm(self) -> bool:
        return self.norm == "rmsnorm"

    @property
    def rotary(self) -> bool:
        return self.position == "rotary"

    @property
    def learned_positions(self) -> bool:
        return self.position == "learned"

    @property
    def layer_norm_bias(self) -> bool:
        """The norms hold a bias: a LayerNorm with `norm_bias`."""
        return not self.rms_norm and self.norm_bias

    @property
    def gelu_kwargs(self) -> dict:
        """What the model hands `ops.gelu` beside x: nothing for GPT-2's tanh GELU (the op's
        default, so an op written for it alone keeps working), F.gelu's approximate="none" for
        the exact one."""
        return {"tanh": {}, "exact": {"approximate": "none"}}[self.gelu]

    def default_ffn(self, h: int) -> int:
        """MLP width without --ffn-hidden-size: 4h, or 8h/3 rounded up to 64 when gated (the
        same weights as 4h split over gate and up, as Llama sizes it)."""
        return -(-8 * h // 3 // 64) * 64 if self.gated_mlp else 4 * h


FLAVOURS = {
    "gpt2": ModelFeatures(
        "layernorm", "learned", gated_mlp=False, qkv_bias=True, linear_bias=True, tied=True,
        hf_model_type="gpt2", doc="LayerNorm, GELU, learned positions, biases, tied embeddings",
    ),
    "nanogpt": ModelFeatures(
        "layernorm", "learned", gated_mlp=False, qkv_bias=False, linear_bias=False, tied=True,
        hf_model_type="gpt2", norm_bias=False, gelu="exact",
        doc="nanoGPT's (bias=False): gpt2 without any bias, LayerNorms included, exact GELU",
    ),
    "llama": ModelFeatures(
        "rmsnorm", "rotary", gated_mlp=True, qkv_bias=False, linear_bias=False, tied=False,
        hf_model_type="llama", hf_moe_model_type="mixtral",
        doc="RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases, untied",
    ),
    "qwen2": ModelFeatures(
        "rmsnorm", "rotary", gated_mlp=True, qkv_bias=True, linear_bias=False, tied=False,
        hf_model_type="qwen2", doc="Qwen2/2.5: llama with biases on q, k, v",
    ),
    "qwen3": ModelFeatures(
        "rmsnorm", "rotary", gated_mlp=True, qkv_bias=False, linear_bias=False, tied=False,
        hf_model_type="qwen3", qk_norm=True, hf_moe_model_type="qwen3_moe",
        doc="Qwen3 (dense): llama with an RMSNorm over each head's q and k",
    ),
    "mistral": ModelFeatures(
        "rmsnorm", "rotary", gated_mlp=True, qkv_bias=False, linear_bias=False, tied=False,
        hf_model_type="mistral", doc="Mistral: llama's layers, usually with --sliding-window",
    ),
    "deepseek_v3": ModelFeatures(
        "rmsnorm", "rotary", gated_mlp=True, qkv_bias=False, linear_bias=False, tied=False,
        hf_model_type="deepseek_v3", latent_attention=True,
        hf_moe_model_type="deepseek_v3",
        doc="DeepSeek-V3: llama's layers with multi-head latent attention (--q-lora-rank, ...)",
    ),
    "gpt_oss": ModelFeatures(
        "rmsnorm", "rotary", gated_mlp=True, qkv_bias=True, linear_bias=True, tied=False,
        hf_model_type="gpt_oss", moe_bias=True, clamped_swiglu=True, attention_sinks=True,
        hf_moe_model_type="gpt_oss",
        doc="gpt-oss: attention sinks, biases; MoE with biased router and experts, clamped SwiGLU",
    ),
}  # fmt: skip


@dataclass
class ModelConfig:
    flavour: str = opt(
        "gpt2",
        "; ".join(f"{name}: {f.doc}" for name, f in FLAVOURS.items()),
        choices=lambda: tuple(FLAVOURS),  # a row added after import counts too
    )
    num_layers: int = opt(2, "transformer layers")
    hidden_size: int = opt(64, "model width h")
    num_attention_heads: int = opt(4, "attention heads")
    num_query_groups: int | None = opt(
        None, "key/value heads for grouped-query attention (default: heads)"
    )
    ffn_hidden_size: int | None = opt(
        None, "MLP width (default: 4h; 8h/3 rounded up to 64 with a gated MLP, as llama)"
    )
    seq_length: int = opt(128, "tokens per sample")
    max_position_embeddings: int | None = opt(
        None,
        "the model's context: learned positions' table (gpt2), what a RoPE model declares "
        "(exported as is; a run may train longer); default: seq_length",
    )
    vocab_size: int | None = opt(None, "vocabulary size before padding (default: the tokenizer's)")
    make_vocab_size_divisible_by: int = opt(
        128, "pad the vocabulary to a multiple of this times tp"
    )
    hidden_dropout: float = opt(0.0, "dropout on the residual branches")
    attention_dropout: float = opt(0.0, "dropout on attention probabilities")
    norm_epsilon: float = opt(1e-5, "epsilon of LayerNorm/RMSNorm", "--layernorm-epsilon")
    rotary_base: float = opt(10000.0, "RoPE base (llama)")
    kv_channels: int | None = opt(
        None, "head dim of q, k, v (default: hidden_size / num_attention_heads; Qwen3 sets it)"
    )
    # ---- RoPE scaling (model/rope.py): longer contexts than the model was trained on ----
    rope_scaling: str = opt(
        "none",
        "RoPE frequency scaling: none, linear (positions / factor), llama3 (Llama 3.1: low "
        "frequencies / factor, a smooth ramp between) or yarn (NTK-by-parts with attention "
        "factor)",
        choices=("none", "linear", "llama3", "yarn"),
    )
    rope_scaling_factor: float = opt(8.0, "RoPE scaling: the context extension factor")
    rope_original_max_position_embeddings: int = opt(
        8192, "RoPE scaling (llama3, yarn): the context length of pretraining"
    )
    rope_low_freq_factor: float = opt(1.0, "llama3 RoPE scaling: low_freq_factor")
    rope_high_freq_factor: float = opt(4.0, "llama3 RoPE scaling: high_freq_factor")
    yarn_beta_fast: float = opt(32.0, "yarn RoPE scaling: beta_fast (extrapolation bound)")
    yarn_beta_slow: float = opt(1.0, "yarn RoPE scaling: beta_slow (interpolation bound)")
    yarn_mscale: float | None = opt(None, "yarn RoPE scaling: mscale (with mscale_all_dim)")
    yarn_mscale_all_dim: float | None = opt(None, "yarn RoPE scaling: mscale_all_dim")
    yarn_attention_factor: float | None = opt(
        None, "yarn RoPE scaling: cos/sin multiplier (default: from factor and the mscales)"
    )
    yarn_truncate: bool = opt(True, "yarn RoPE scaling: round the correction range outwards")
    sliding_window: int | None = opt(
        None,
        "each query attends to the last W keys, itself included (Mistral; default: all earlier)",
    )
    # ---- multi-head latent attention (the deepseek_v3 flavour; model/mla.py) ----
    q_lora_rank: int | None = opt(
        None, "MLA: rank of the compressed query (default: a full-rank q projection)"
    )
    kv_lora_rank: int = opt(32, "MLA: rank of the compressed key/value latent (cached)")
    qk_nope_head_dim: int = opt(128, "MLA: per-head q/k dims without RoPE", "--qk-head-dim")
    qk_rope_head_dim: int = opt(
        64, "MLA: q/k dims with RoPE (the key's shared by all heads)", "--qk-pos-emb-head-dim"
    )
    v_head_dim: int = opt(128, "MLA: per-head value dims")
    # ---- multi-token prediction (DeepSeek-V3's MTP; model/mtp.py) ----
    mtp_num_layers: int = opt(
        0, "MTP: modules predicting tokens 2, 3, ... ahead (one transformer layer each)"
    )
    mtp_loss_scaling_factor: float = opt(0.1, "MTP: weight of the mean MTP loss")
    init_method_std: float = opt(0.02, "std of the normal initialisation")
    untie_embeddings_and_output_weights: bool | None = opt(
        None, "separate output layer (default: tied for gpt2, untied for llama)"
    )
    # ---- mixture of experts (docs/moe.md); dense when num_experts is None ----
    num_experts: int | None = opt(None, "MoE: experts per MoE layer (default: dense MLPs)")
    moe_router_topk: int = opt(2, "MoE: experts each token is routed to (k)")
    moe_ffn_hidden_size: int | None = opt(None, "MoE: width of each expert (default: ffn)")
    moe_shared_expert_intermediate_size: int | None = opt(
        None, "MoE: width of a shared expert every token also passes through (default: none)"
    )
    moe_layer_freq: int = opt(1, "MoE: every k-th layer is an MoE layer (layers 0, k, 2k, ...)")
    moe_aux_loss_coeff: float = opt(
        0.0, "MoE: load-balancing loss coefficient (Switch/GShard: E * sum_e f_e P_e)"
    )
    moe_z_loss_coeff: float = opt(0.0, "MoE: router z-loss coefficient (mean logsumexp^2)")
    moe_router_pre_softmax: bool = opt(
        False,
        "MoE: weights are the softmax over all experts, not renormalised over the top-k "
        "(default: renormalised, as Mixtral)",
    )
    moe_router_enable_expert_bias: bool = opt(
        False,
        "MoE: auxiliary-loss-free balancing: a per-expert bias on the top-k choice (DeepSeek-V3)",
    )
    moe_router_bias_update_rate: float = opt(
        1e-3, "MoE: expert bias step per optimizer step, towards the mean load"
    )
    moe_expert_capacity_factor: float | None = opt(
        None,
        "MoE: drop routed tokens past capacity_factor * tokens * k / experts per expert "
        "(default: dropless)",
    )
    moe_token_drop_policy: str = opt(
        "position",
        "MoE: which assignments past capacity are dropped: position (first choices before "
        "second ones, then earlier sequence positions first)",
        choices=("position",),
    )
    moe_router_score_function: str = opt(
        "softmax",
        "MoE: router scores: softmax over the experts, or sigmoid of each logit (DeepSeek-V3)",
        choices=("softmax", "sigmoid"),
    )
    moe_router_num_groups: int | None = opt(
        None, "MoE: node-limited routing: experts in this many groups (DeepSeek-V3's n_group)"
    )
    moe_router_group_topk: int | None = opt(
        None,
        "MoE: node-limited routing: the groups with the best sum of their top-2 scores a token "
        "may use (DeepSeek-V3's topk_group)",
    )
    moe_router_topk_scaling_factor: float | None = opt(
        None, "MoE: the top-k weights times this (DeepSeek-V3's routed_scaling_factor)"
    )
    moe_dense_layers: list[int] = opt(
        list,
        "MoE: layers that keep a dense MLP (Qwen3-MoE's mlp_only_layers; DeepSeek-V3's first "
        "first_k_dense_replace layers)",
    )
    swiglu_limit: float = opt(7.0, "clamped SwiGLU (gpt-oss experts): the clamp of gate and up")
    window_attn_skip_freq: int | None = opt(
        None,
        "with --sliding-window: every N-th layer (the N-th, 2N-th, ... counting from 1) attends "
        "over the whole sequence (gpt-oss's alternating layers: 2)",
    )

    @property
    def features(self) -> ModelFeatures:
        return FLAVOURS[self.flavour]

    @property
    def heads_kv(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def ffn(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        return self.features.default_ffn(self.hidden_size)

    @property
    def tied(self) -> bool:
        if self.untie_embeddings_and_output_weights is None:
            return self.features.tied
        return not self.untie_embeddings_and_output_weights

    @property
    def moe_ffn(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn

    def is_moe_layer(self, i: int) -> bool:
        """Layer i holds experts instead of a dense MLP."""
        dense = i % self.moe_layer_freq or i in self.moe_dense_layers
        return bool(self.num_experts) and not dense

    def window_of(self, i: int) -> int | None:
        """The sliding window of layer i (None: it attends over every earlier token)."""
        n = self.window_attn_skip_freq
        return None if n and (i + 1) % n == 0 else self.sliding_window

    def layer_config(self, i: int) -> "ModelConfig":
        """What layer i is built from: this config with the layer's own window."""
        window = self.window_of(i)
        return (
            self
            if window == self.sliding_window
            else dataclasses.replace(self, sliding_window=window)
        )

    def padded_vocab_size(self, tp: int = 1) -> int:
        m = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // m) * m
