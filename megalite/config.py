"""Typed configuration: nested dataclasses filled from defaults, then YAML, then CLI flags.

Every field carries its documentation (shown by `--help`) and its flag names: the field name
with dashes (`--micro-batch-size`) plus Megatron-LM's long names and short aliases.
`megalite/config_read.py` fills one from YAML, flags or a dict (this module is data only and
imports nothing of megalite); `megalite.shape.validate()` rejects impossible combinations with
one clear sentence before any process group exists and derives the run's shape; nothing writes
into a Config afterwards.
"""

import dataclasses
from dataclasses import dataclass, field

# The rank order of the parallel axes, fastest-varying first; parallel/topology.py takes its
# default from here. An axis of size 1 takes no place: tp-dp-pp ranks unchanged.
DEFAULT_ORDER = "tp-cp-dp-pp"


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

    @property
    def rms_norm(self) -> bool:
        return self.norm == "rmsnorm"

    @property
    def rotary(self) -> bool:
        return self.position == "rotary"

    @property
    def learned_positions(self) -> bool:
        return self.position == "learned"

    def default_ffn(self, h: int) -> int:
        """MLP width without --ffn-hidden-size: 4h, or 8h/3 rounded up to 64 when gated (the
        same weights as 4h split over gate and up, as Llama sizes it)."""
        return -(-8 * h // 3 // 64) * 64 if self.gated_mlp else 4 * h


FLAVOURS = {
    "gpt2": ModelFeatures(
        "layernorm", "learned", gated_mlp=False, qkv_bias=True, linear_bias=True, tied=True,
        hf_model_type="gpt2", doc="LayerNorm, GELU, learned positions, biases, tied embeddings",
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
    max_position_embeddings: int | None = opt(None, "learned positions (gpt2; default: seq_length)")
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


@dataclass
class ParallelConfig:
    tp: int = opt(1, "tensor-parallel size", "--tensor-model-parallel-size")
    pp: int = opt(1, "pipeline-parallel size", "--pipeline-model-parallel-size")
    vpp: int = opt(
        1,
        "virtual pipeline chunks per rank (interleaved 1F1B when >= 2)",
        "--num-virtual-stages-per-pipeline-rank",
        "--virtual-pipeline-model-parallel-size",
    )
    dp: int | None = opt(
        None, "data-parallel size (default: world size / (tp*cp*pp))", "--data-parallel-size"
    )
    cp: int = opt(
        1,
        "context-parallel size: each sample's sequence split over cp ranks (long contexts)",
        "--context-parallel-size",
    )
    cp_comm_type: str = opt(
        "p2p",
        "context-parallel attention: p2p (ring: K/V blocks passed round the cp ranks) or a2a "
        "(all-to-all: heads exchanged for the sequence, Ulysses)",
        choices=("p2p", "a2a"),
    )
    order: str = opt(
        DEFAULT_ORDER,
        "rank order of the parallel axes, fastest-varying first (TP adjacent keeps it in a node)",
    )
    sequence_parallel: bool = opt(
        False, "shard norm/dropout activations along the sequence over TP"
    )
    ep: int = opt(
        1,
        "expert-parallel size: experts split over ep ranks of tp*dp (it divides tp*dp, not the "
        "world)",
        "--expert-model-parallel-size",
    )
    etp: int = opt(
        1, "expert tensor-parallel size (only 1: experts whole)", "--expert-tensor-parallel-size"
    )
    pp_schedule: str | None = opt(
        None,
        # the names are the pipeline registry's; validate() refuses an unknown one, naming them
        "pipeline schedule, by its registered name (default: interleaved when vpp >= 2, else 1f1b)",
    )
    distributed_timeout_minutes: float = opt(
        10.0, "collectives waiting longer than this fail the run"
    )


@dataclass
class OptimizerConfig:
    lr: float = opt(3e-4, "peak learning rate")
    min_lr: float = opt(0.0, "learning rate at the end of decay")
    lr_warmup_iters: int = opt(0, "linear warmup steps")
    lr_decay_iters: int | None = opt(None, "decay steps (default: train_iters)")
    lr_decay_style: str = opt(
        "cosine", "decay after warmup", choices=("cosine", "linear", "constant")
    )
    weight_decay: float = opt(0.1, "AdamW weight decay (not applied to norms and biases)")
    adam_beta1: float = opt(0.9, "Adam beta1")
    adam_beta2: float = opt(0.95, "Adam beta2")
    adam_eps: float = opt(1e-8, "Adam epsilon")
    clip_grad: float = opt(1.0, "clip the global gradient norm to this (0: off)")
    zero_stage: int = opt(
        0,
        "0: replicated optimizer; 1: sharded optimizer state; 2: also sharded gradients; "
        "3: also sharded parameters, gathered layer by layer",
        choices=(0, 1, 2, 3),
    )
    zero3_keep_params: bool = opt(
        False,
        "ZeRO-3: keep each layer's gathered parameters from its forward to its backward "
        "(less traffic, more memory); with pp they are kept for the whole step",
    )
    bucket_size_mb: float = opt(25.0, "gradient bucket size for the data-parallel reduction")
    overlap_param_gather: bool = opt(
        True,
        "ZeRO >= 1: gather updated parameters while the next forward runs (each bucket waited "
        "for by the first layer that reads it)",
    )
    initial_loss_scale: float = opt(2.0**16, "fp16: starting loss scale")
    loss_scale_window: int = opt(1000, "fp16: steps without overflow before the scale doubles")
    min_loss_scale: float = opt(1.0, "fp16: the scale never falls below this")
    optimizer: str = opt(
        "adamw",
        "adamw, or muon: Newton-Schulz orthogonalised momentum for the hidden matrices, AdamW "
        "for embeddings, output layer, norms, biases and routers (docs/optimizers.md)",
        choices=("adamw", "muon"),
    )
    muon_momentum: float = opt(0.95, "muon: momentum of the matrices")
    muon_nesterov: bool = opt(True, "muon: Nesterov momentum")
    muon_ns_steps: int = opt(5, "muon: Newton-Schulz iterations")
    muon_scale: str = opt(
        "rms",
        "muon: update scale; rms: 0.2 sqrt(max(m, n)), the update's RMS near AdamW's "
        "(Moonlight; AdamW's lr and weight decay carry over); shape: sqrt(max(1, m/n))",
        choices=("rms", "shape"),
    )


@dataclass
class DataConfig:
    data_path: list[str] = opt(
        list,
        "indexed dataset prefixes, optionally weighted: 0.7 a 0.3 b (default: built-in corpus)",
    )
    tokenizer_model: str | None = opt(
        None,
        "sentencepiece .model, Hugging Face tokenizer.json or a directory holding one "
        "(default: a sentencepiece model trained on the built-in corpus)",
    )
    tokenizer_type: str | None = opt(
        None,
        "sentencepiece or huggingface (Megatron's GPTSentencePieceTokenizer, "
        "SentencePieceTokenizer, HuggingFaceTokenizer too; GPT2BPETokenizer with --vocab-file "
        "and --merge-file); default: from --tokenizer-model's path",
        choices=(
            "sentencepiece",
            "huggingface",
            "GPTSentencePieceTokenizer",
            "SentencePieceTokenizer",
            "HuggingFaceTokenizer",
            "GPT2BPETokenizer",
        ),
    )
    vocab_file: str | None = opt(None, "GPT2BPETokenizer: GPT-2's vocab.json")
    merge_file: str | None = opt(None, "GPT2BPETokenizer: GPT-2's merges.txt")
    split: str = opt("98,2,0", "train,valid,test proportions")
    tokenizer_vocab_size: int = opt(
        2048, "vocabulary of the tokenizer trained for the built-in corpus"
    )
    data_cache_dir: str = opt(
        "data_cache", "where the built-in corpus and its tokenizer are cached"
    )
    data_cache_path: str | None = opt(
        None, "where the built sample-order indices are cached as .npy (default: not cached)"
    )
    train_data_path: list[str] = opt(
        list, "the training split's own prefixes, optionally weighted (instead of --data-path)"
    )
    valid_data_path: list[str] = opt(
        list, "the validation split's own prefixes, optionally weighted"
    )
    test_data_path: list[str] = opt(list, "the test split's own prefixes, optionally weighted")
    reset_position_ids: bool = opt(False, "positions restart at 0 after each end-of-document token")
    reset_attention_mask: bool = opt(
        False, "tokens attend within their own document only (packed samples)"
    )
    eod_mask_loss: bool = opt(False, "no loss on the end-of-document tokens")


@dataclass
class TrainingConfig:
    micro_batch_size: int = opt(2, "samples per micro-batch per DP rank", "--mbs")
    global_batch_size: int = opt(8, "samples per optimizer step over all DP ranks", "--gbs")
    train_iters: int = opt(20, "optimizer steps")
    eval_interval: int = opt(0, "evaluate every N steps (0: never)")
    eval_iters: int = opt(2, "batches per evaluation")
    log_interval: int = opt(1, "console/metrics line every N steps")
    seed: int = opt(1234, "seed for initialisation, data order and dropout")
    precision: str = opt("fp32", "parameter/compute precision", choices=("fp32", "bf16", "fp16"))
    fp8_format: str | None = opt(
        None,
        "FP8 GEMMs in the transformer layers' linears (off when unset): e4m3 everywhere, or "
        "hybrid (e4m3 forward, e5m2 gradients); embedding, output layer, router, norms stay",
        "--fp8",
        choices=("e4m3", "hybrid"),
    )
    fp8_recipe: str = opt(
        "tensorwise",
        "how FP8 operands are scaled (docs/fp8.md)",
        choices=("tensorwise", "rowwise", "delayed", "mxfp8"),
    )
    fp8_amax_history_len: int = opt(1024, "delayed scaling: steps of amax history kept")
    fp8_amax_compute_algo: str = opt(
        "max", "delayed scaling: scale from the history's max or newest amax",
        choices=("max", "most_recent"),
    )  # fmt: skip
    fp8_margin: int = opt(0, "delayed scaling: scales divided by 2^margin (headroom)")
    fp8_first_last_layers_bf16: bool = opt(
        False, "with FP8: the first and last transformer layers' linears stay in high precision",
        "--first-last-layers-bf16",
    )  # fmt: skip
    recompute: str = opt(
        "none",
        "activation recomputation",
        "--recompute-granularity",
        choices=("none", "selective", "full"),
    )
    kernels: str = opt(
        "auto", "auto: Triton on CUDA, torch elsewhere", choices=("auto", "triton", "torch")
    )
    compile: bool = opt(
        False, "torch.compile each transformer layer's math (docs/compile.md; inductor: C++ on CPU)"
    )
    max_skipped_steps: int = opt(5, "stop after this many non-finite steps in a row")
    eval_only: bool = opt(False, "with --load: compute eval_loss on the valid split and exit")
    dry_run: bool = opt(False, "print the memory/communication plan and exit (no process group)")
    fake_world: bool = opt(
        False,
        "with --dry-run: run chosen ranks' training step on fake tensors over a fake process "
        "group (one process each) and print matched collectives, host syncs and memory",
    )
    profile_steps: str | None = opt(None, "A:B records a per-rank timeline of steps A..B-1")
    debug: bool = opt(False, "show full tracebacks on errors")
    exit_duration_in_mins: float | None = opt(
        None,
        "save and exit 0 once the run has trained this long (set it below the job's time limit "
        "minus a save's duration; a resubmitted job resumes)",
    )
    exit_interval: int | None = opt(None, "save and exit 0 at the first iteration divisible by N")
    spike_threshold: float = opt(
        0.0,
        "skip a step whose loss is more than Z standard deviations above the mean of the recent "
        "steps, like a non-finite step (0: off)",
    )
    spike_window: int = opt(50, "recent steps the loss-spike guard compares with")
    spike_min_steps: int = opt(10, "steps of history before the loss-spike guard acts")
    spike_rerun: bool = opt(
        False,
        "re-run a spiking step once: the same loss again is a data spike (skipped), another "
        "one points at a hardware fault (warned about, the re-run's step kept)",
    )
    straggler_threshold: float = opt(
        1.2,
        "warn when a rank's compute time per step is at least this many times its peers' median "
        "at every one of --straggler-window logging steps (0: off)",
    )
    straggler_window: int = opt(3, "consecutive logging steps a straggler must be slow at")


@dataclass
class CheckpointConfig:
    save: str | None = opt(
        None, "checkpoint directory (resumes from its latest when --load is absent)"
    )
    load: str | None = opt(None, "checkpoint directory to resume from")
    save_interval: int = opt(0, "save every N steps (0: only at the end)")
    keep_checkpoints: int = opt(2, "checkpoints kept in --save (oldest removed)")
    async_save: bool = opt(
        False,
        "gather and copy to host in the step, write the files in the background (one save in "
        "flight; the next save and the end of training wait for it)",
    )
    finetune: bool = opt(
        False,
        "load --load's weights only: iteration 0, fresh optimizer and data position (a restart "
        "with a checkpoint in --save resumes from that instead)",
    )
    load_optim: bool = opt(True, "load the optimizer state (--no-load-optim: a fresh one)")
    load_rng: bool = opt(True, "restore the RNG states (--no-load-rng: re-seed)")
    use_checkpoint_args: bool = opt(
        False,
        "accepted for Megatron compatibility: the model architecture is always taken from the "
        "loaded checkpoint where no model flag gives it",
    )


@dataclass
class LoggingConfig:
    metrics_file: str | None = opt(None, "append one JSON object per logged step")
    wandb_project: str = opt("megalite", "Weights & Biases project")
    wandb_run_name: str | None = opt(None, "Weights & Biases run name")
    wandb_mode: str = opt(
        "offline", "offline needs no account; sync later", choices=("offline", "online", "disabled")
    )
    wandb_dir: str = opt("runs", "where W&B writes its files")
    tensorboard_dir: str | None = opt(
        None, "also write the logged scalars as TensorBoard event files here (needs tensorboard)"
    )
    hang_report_dir: str | None = opt(
        None,
        "where each surviving rank writes hang-rank<N>.json when a peer stalls (default: beside "
        "--metrics-file, else --save)",
    )


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
