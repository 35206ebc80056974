"""Megatron-LM's training flags that megalite's own parser does not take as they are, each with
its handling in one table (`MEGATRON`), applied to the command line before it is parsed
(config_read.parse_args):

- meaning: the flag becomes megalite flags (`--use-distributed-optimizer` is `--zero-stage 1`);
- note: accepted, one line (rank 0) saying what megalite does instead;
- refused: one line naming megalite's counterpart, or saying that it is not supported.

Architecture flags (`--swiglu`, `--normalization`, `--position-embedding-type`, ...) describe a
model from Megatron's defaults (LayerNorm, learned positions, GELU, biases, tied embeddings): the
flavour of model_config.FLAVOURS with exactly those features is chosen, else the combination is
refused in one line naming the nearest flavour (megatron_translate.py applies the table).
docs/megatron.md lists every flag. Imports nothing of megalite but errors."""

import dataclasses
import re
from collections.abc import Callable

from megalite.errors import MegaliteError


@dataclasses.dataclass(frozen=True)
class Handling:
    kind: str  # "meaning", "note" or "refused"
    nargs: int | str  # values the flag takes: 0, 1 or "+" (up to the next flag)
    doc: str  # what megalite does (the note line, the refusal, or the meaning)
    to: Callable | None = None  # meaning: (values, translation) -> megalite argv


def meaning(doc, to, nargs=0):
    return Handling("meaning", nargs, doc, to)


def note(doc, nargs=0):
    return Handling("note", nargs, doc)


def refused(doc, nargs=0):
    return Handling("refused", nargs, doc)


def flags(*argv):
    """A meaning that is these megalite flags, whatever the values."""
    return lambda values, tr: list(argv)


def value_as(flag):
    """A meaning that is megalite's `flag` with the same value(s)."""
    return lambda values, tr: [flag, *values]


def arch(**features):
    """An architecture flag of no value: these features."""

    def to(values, tr):
        tr.arch.update(features)
        return []

    return to


def _normalization(values, tr):
    norms = {"LayerNorm": "layernorm", "RMSNorm": "rmsnorm"}
    if values[0] not in norms:
        raise MegaliteError(f"--normalization {values[0]}: megalite has LayerNorm and RMSNorm")
    tr.arch["norm"] = norms[values[0]]
    return []


def _position(values, tr):
    kinds = {"rope": "rotary", "learned_absolute": "learned"}
    if values[0] not in kinds:
        raise MegaliteError(
            f"--position-embedding-type {values[0]} is not supported: megalite has rope and "
            "learned_absolute"
        )
    tr.arch["position"] = kinds[values[0]]
    return []


def _no_position_embedding(values, tr):
    if "--position-embedding-type" not in tr.argv:  # Megatron: deprecated, refused unless rope
        raise MegaliteError(
            "--no-position-embedding is deprecated in Megatron-LM too: use "
            "--position-embedding-type rope"
        )
    return []


def _rotary_percent(values, tr):
    if float(values[0]) != 1.0:
        raise MegaliteError(
            f"--rotary-percent {values[0]} is not supported: megalite rotates every q/k channel "
            "(1.0)"
        )
    return []


def _rope_type(values, tr):
    return ["--rope-scaling", "yarn"] if values[0] == "yarn" else []


def _rotary_scaling_factor(values, tr):
    if not tr.arch.get("latent_attention") and "yarn" not in tr.argv:
        raise MegaliteError(
            "--rotary-scaling-factor scales YaRN RoPE (multi-latent attention, --rope-type "
            "yarn); for Llama 3's scaling use --rope-scaling llama3 --rope-scaling-factor F"
        )
    # megatron-core's MLA: YaRN over an original context of 4096 positions
    return ["--rope-scaling", "yarn", "--rope-scaling-factor", values[0],
            "--rope-original-max-position-embeddings", "4096"]  # fmt: skip


def _softmax_type(values, tr):
    if values[0] == "off-by-one":
        raise MegaliteError("--softmax-type off-by-one is not supported: megalite has vanilla "
                            "and learnable (gpt-oss's attention sinks)")  # fmt: skip
    tr.arch["attention_sinks"] = values[0] == "learnable"
    return []


def _glu_linear_offset(values, tr):
    if float(values[0]) == 1.0 and "--quick-geglu" in tr.argv:
        return []  # gpt-oss's (up + 1): the clamped SwiGLU
    if float(values[0]) != 0.0:
        raise MegaliteError(
            f"--glu-linear-offset {values[0]} is supported only as gpt-oss's 1.0 with --quick-geglu"
        )
    return []


def _window_size(values, tr):
    left, _, right = values[0].strip("()[] ").partition(",")
    if right.strip() not in ("0", ""):
        raise MegaliteError(f"--window-size {values[0]}: megalite's windows are causal (right 0)")
    return ["--sliding-window", str(int(left) + 1)]  # left keys before the query, and itself


def _moe_layer_freq(values, tr):
    """Megatron's "[0]*3+[1]*58" (1: MoE) as megalite's dense layers; an integer as it is."""
    v = values[0].replace(" ", "")
    if re.fullmatch(r"\d+", v):
        return ["--moe-layer-freq", v]
    pattern = []
    for term in v.split("+"):  # [a,b,...] or [a,b,...]*n
        m = re.fullmatch(r"\[([01](?:,[01])*)\](?:\*(\d+))?", term)
        if m is None:
            raise MegaliteError(f"--moe-layer-freq {values[0]}: an integer or a list like "
                                "[0]*3+[1]*58")  # fmt: skip
        pattern += [int(x) for x in m.group(1).split(",")] * int(m.group(2) or 1)
    dense = [str(i) for i, moe in enumerate(pattern) if not moe]
    return ["--moe-layer-freq", "1"] + (["--moe-dense-layers", *dense] if dense else [])


def _load_balancing(values, tr):
    if values[0] == "none":
        return ["--moe-aux-loss-coeff", "0"]
    if values[0] != "aux_loss":
        raise MegaliteError(
            f"--moe-router-load-balancing-type {values[0]} is not supported: megalite has "
            "aux_loss (with --moe-aux-loss-coeff) and none"
        )
    return []


def _router_dtype(values, tr):
    if values[0] != "fp32":
        raise MegaliteError(f"--moe-router-dtype {values[0]} is not supported: megalite routes "
                            "in fp32")  # fmt: skip
    return []


def _sharding(values, tr):
    stages = {"no_shard": "0", "optim": "1", "optim_grads": "2", "optim_grads_params": "3"}
    if values[0] not in stages:
        raise MegaliteError(f"--data-parallel-sharding-strategy {values[0]}: one of "
                            f"{', '.join(stages)}")  # fmt: skip
    tr.zero = stages[values[0]]
    return []


def _tokenizer_type(values, tr):
    if values[0] != "NullTokenizer":
        return ["--tokenizer-type", values[0]]
    if "--mock-data" not in tr.argv:
        raise MegaliteError("--tokenizer-type NullTokenizer is supported only with --mock-data")
    return []  # the built-in corpus with its tokenizer


def _recompute_modules(values, tr):
    if set(values) - {"core_attn"}:
        raise MegaliteError(
            f"--recompute-modules {' '.join(values)} is not supported: megalite's selective "
            "recomputation is the attention core (core_attn); --recompute-granularity full "
            "recomputes whole layers"
        )
    return []


def _ckpt_format(values, tr):
    if values[0] != "fsdp_dtensor":
        return ["--ckpt-format", values[0]]
    tr.notes.append(
        "--ckpt-format fsdp_dtensor: megalite saves its own topology-free checkpoints, which any "
        "layout loads (--ckpt-format torch_dist writes Megatron's format beside them)"
    )
    return []


NOTE_FUSION = "megalite fuses what its kernels fuse (--kernels), whatever this flag says"
MEGATRON = {
    # ---- architecture ----
    "--swiglu": meaning("SwiGLU MLP (the llama-style flavours)", arch(mlp="swiglu")),
    "--quick-geglu": meaning(
        "with --glu-linear-offset 1.0 and --activation-func-clamp-value: gpt-oss's clamped "
        "SwiGLU (the gpt_oss flavour)", arch(mlp="quick_geglu")),
    "--glu-linear-offset": meaning("1.0 with --quick-geglu (gpt-oss); else 0",
                                   _glu_linear_offset, 1),
    "--activation-func-clamp-value": meaning("--swiglu-limit", value_as("--swiglu-limit"), 1),
    "--normalization": meaning("LayerNorm or RMSNorm: the flavour's norm", _normalization, 1),
    "--position-embedding-type": meaning(
        "rope or learned_absolute: the flavour's positions; none refused", _position, 1),
    "--no-position-embedding": meaning(
        "with --position-embedding-type rope, nothing (Megatron: deprecated)",
        _no_position_embedding),
    "--disable-bias-linear": meaning("no biases on the linears (q/k/v included, as Megatron)",
                                     arch(linear_bias=False)),
    "--add-qkv-bias": meaning("biases on q, k, v (qwen2)", arch(qkv_bias=True)),
    "--qk-layernorm": meaning("RMSNorm on each head's q and k (qwen3); with "
                              "--multi-latent-attention the q/kv latent norms",
                              arch(qk_layernorm=True)),
    "--multi-latent-attention": meaning("the deepseek_v3 flavour (with --qk-layernorm)",
                                        arch(latent_attention=True)),
    "--softmax-type": meaning("vanilla, or learnable: gpt-oss's attention sinks",
                              _softmax_type, 1),
    "--window-size": meaning("L,0: --sliding-window L+1", _window_size, 1),
    "--group-query-attention": meaning(
        "nothing more: --num-query-groups alone sets grouped-query attention in megalite",
        flags()),
    "--rotary-percent": meaning("1.0 only (other values refused)", _rotary_percent, 1),
    "--rope-type": meaning("rope: plain RoPE; yarn: --rope-scaling yarn", _rope_type, 1),
    "--rotary-scaling-factor": meaning(
        "YaRN (MLA): --rope-scaling yarn --rope-scaling-factor F over 4096 original positions",
        _rotary_scaling_factor, 1),
    "--mscale": meaning("--yarn-mscale", value_as("--yarn-mscale"), 1),
    "--mscale-all-dim": meaning("--yarn-mscale-all-dim", value_as("--yarn-mscale-all-dim"), 1),
    "--apply-layernorm-1p": meaning(
        "megalite keeps each norm's weight itself (initialised to 1), not its offset from 1: "
        "the same function and, with no weight decay on norms, the same updates (up to rounding); "
        "--ckpt-format saves write the offset, as Megatron stores it (a Megatron checkpoint's "
        "own args say how --load reads it)",
        flags("--megatron-layernorm-1p")),
    "--moe-layer-freq": meaning(
        "an integer: the same; Megatron's list form [0]*3+[1]*58 becomes --moe-dense-layers",
        _moe_layer_freq, 1),
    # ---- MoE ----
    "--moe-router-load-balancing-type": meaning(
        "aux_loss: megalite's auxiliary loss (--moe-aux-loss-coeff); none: coefficient 0",
        _load_balancing, 1),
    "--moe-router-dtype": meaning("fp32: megalite routes in fp32 always", _router_dtype, 1),
    "--moe-token-dispatcher-type": note(
        "megalite dispatches tokens to their experts with all-to-all over ep (the same result "
        "for every dispatcher)", 1),
    "--moe-flex-dispatcher-backend": note("megalite's all-to-all dispatcher (no DeepEP/HybridEP)",
                                          1),
    "--moe-grouped-gemm": note("megalite runs each rank's experts as one grouped GEMM always"),
    "--moe-permute-fusion": note(NOTE_FUSION),
    "--moe-per-layer-logging": note(
        "megalite logs each MoE layer's expert loads (moe_load) at every logging step; its "
        "auxiliary and z-losses summed over the layers"),
    "--moe-router-force-load-balancing": refused(
        "--moe-router-force-load-balancing (random routing for benchmarks) is not supported"),
    # ---- data-parallel and optimizer sharding ----
    "--use-distributed-optimizer": meaning("--zero-stage 1 (sharded optimizer state)",
                                           lambda v, tr: tr.set_zero("1")),
    "--use-megatron-fsdp": meaning(
        "--zero-stage from --data-parallel-sharding-strategy (default optim_grads_params: 3)",
        lambda v, tr: tr.set_zero("fsdp")),
    "--data-parallel-sharding-strategy": meaning(
        "with --use-megatron-fsdp: no_shard/optim/optim_grads/optim_grads_params are "
        "--zero-stage 0/1/2/3", _sharding, 1),
    "--overlap-grad-reduce": note(
        "megalite always reduces gradient buckets while the backward runs"),
    "--calculate-per-token-loss": note(
        "megalite's loss is always the mean over the step's tokens with a loss (equal to "
        "Megatron's default unless --eod-mask-loss masks tokens)"),
    "--megatron-fsdp-grad-comm-dtype": refused(
        "--megatron-fsdp-grad-comm-dtype is not supported: megalite's counterpart is "
        "--grad-reduce-in-bf16", 1),
    "--megatron-fsdp-main-grads-dtype": refused(
        "--megatron-fsdp-main-grads-dtype is not supported: megalite keeps fp32 main gradients",
        1),
    "--init-model-with-meta-device": note(
        "megalite builds a model on the meta device only to load it; it initialises on the "
        "device"),
    "--use-nccl-ub": note("megalite uses NCCL's default buffers (no user buffer registration)"),
    "--fsdp-double-buffer": note("megalite's ZeRO-3 gathers into its own buffers"),
    "--fsdp-manual-registration": note("megalite uses NCCL's default buffers"),
    "--fp8-param-gather": meaning(
        "at ZeRO-3 (--use-megatron-fsdp): megalite's --fp8-param-gather; below it a note",
        lambda v, tr: setattr(tr, "fp8_param_gather", True) or []),
    # ---- logging and profiling ----
    "--log-throughput": note("megalite logs tokens/s (and MFU where the device's peak is known) at every logging step"),
    "--use-pytorch-profiler": note("megalite's --profile is torch.profiler's always"),
    "--wandb-exp-name": meaning("--wandb-run-name", value_as("--wandb-run-name"), 1),
    "--logging-level": note("megalite prints its own console lines (rank 0)", 1),
    "--log-timers-to-tensorboard": note(
        "megalite writes every logged scalar (step time included) to --tensorboard-dir"),
    "--log-memory-to-tensorboard": note(
        "megalite writes every logged scalar (peak memory included) to --tensorboard-dir"),
    "--log-validation-ppl-to-tensorboard": note(
        "megalite writes eval_loss and eval_ppl to --tensorboard-dir"),
    "--log-num-zeros-in-grad": refused("--log-num-zeros-in-grad is not supported"),
    "--log-params-norm": refused("--log-params-norm is not supported"),
    "--record-memory-history": refused(
        "--record-memory-history is not supported: megalite logs peak memory per step"),
    # ---- data ----
    "--mock-data": note("megalite trains on its built-in corpus (no --data-path) instead of "
                        "random tokens"),
    "--tokenizer-type": meaning(
        "megalite's types as they are; NullTokenizer with --mock-data: the built-in corpus' "
        "tokenizer", _tokenizer_type, 1),
    "--tiktoken-pattern": note("megalite uses no tiktoken tokenizer here", 1),
    "--no-create-attention-mask-in-dataloader": note(
        "megalite's attention is causal without a mask tensor"),
    "--no-mmap-bin-files": note("megalite memory-maps the .bin files always"),
    "--num-workers": note("megalite reads its samples in the training process", 1),
    # ---- recomputation ----
    "--recompute-activations": meaning("--recompute selective", flags("--recompute", "selective")),
    "--recompute-modules": meaning("core_attn only: megalite's selective recomputation",
                                   _recompute_modules, "+"),
    # ---- GPU libraries and fusions megalite does not use ----
    "--use-mcore-models": note("megalite's own model (there is no legacy one)"),
    "--attention-backend": note(
        "megalite's attention is torch's scaled_dot_product_attention or its Triton kernel "
        "(--kernels)", 1),
    "--transformer-impl": note("megalite's own layers (no Transformer Engine)", 1),
    "--use-flash-attn": note("megalite's attention is torch's scaled_dot_product_attention"),
    "--no-rope-fusion": note(NOTE_FUSION),
    "--cross-entropy-loss-fusion": note(NOTE_FUSION),
    "--no-masked-softmax-fusion": note(NOTE_FUSION),
    "--no-bias-gelu-fusion": note(
        "megalite's GELU is the flavour's (gpt2: tanh, as Megatron's fused one)"),
    "--no-bias-dropout-fusion": note(NOTE_FUSION),
    "--no-gradient-accumulation-fusion": note(NOTE_FUSION),
    "--attention-softmax-in-fp32": note("megalite's attention softmax accumulates in fp32"),
    "--accumulate-allreduce-grads-in-fp32": note(
        "megalite accumulates and reduces gradients in fp32 unless --grad-reduce-in-bf16"),
    "--disable-bf16-reduced-precision-matmul": note("megalite leaves torch's matmul defaults"),
    "--empty-unused-memory-level": note("megalite never empties the allocator's cache", 1),
    "--distributed-backend": note("megalite uses NCCL on GPUs, gloo on CPUs", 1),
    "--no-check-for-nan-in-loss-and-grad": note(
        "megalite skips a non-finite step and stops after --max-skipped-steps in a row"),
    "--enable-experimental": note("megalite has no experimental switch"),
    "--ckpt-format": meaning(
        "torch_dist and torch: Megatron's files at each save beside megalite's; fsdp_dtensor: a "
        "note (megalite's own checkpoints only)", _ckpt_format, 1),
    "--auto-detect-ckpt-format": note(
        "megalite reads its own, Megatron's legacy and torch_dist checkpoints, whichever --load "
        "holds"),
    "--dist-ckpt-strictness": note(
        "megalite loads strictly: a tensor missing from the checkpoint is refused in one line", 1),
    # ---- not Megatron-LM flags (its parser refuses them too) ----
    "--enable-gpt-oss": refused(
        "--enable-gpt-oss is not a Megatron-LM flag (Megatron-LM refuses it too): use "
        "--flavour gpt_oss or its architecture flags"),
    "--export-force-local-attention": refused(
        "--export-force-local-attention is not a Megatron-LM flag (Megatron-LM refuses it too)"),
    "--fp8-hybrid": refused("--fp8-hybrid is not a Megatron-LM flag: use --fp8-format hybrid"),
}  # fmt: skip
