"""Typed configuration: nested dataclasses filled from defaults, then YAML, then CLI flags.

Every field carries its documentation (shown by `--help`) and its flag names: the field name
with dashes (`--micro-batch-size`) plus Megatron-LM's long names and short aliases.
`megalite.shape.validate()` rejects impossible combinations with one clear sentence before any
process group exists and derives the run's shape; nothing writes into a Config afterwards.
"""

import argparse
import dataclasses
import difflib
import os
import sys
import typing
from dataclasses import dataclass, field

import yaml

from megalite.errors import MegaliteError
from megalite.parallel.topology import DEFAULT_ORDER
from megalite.pipeline import schedules


def opt(default, doc, *aliases, choices=None):
    """A config field: its default, its documentation and any extra flag names. `choices` may
    be a function returning them (a registry that grows after import)."""
    kw = {"default_factory": default} if callable(default) else {"default": default}
    return field(**kw, metadata={"doc": doc, "aliases": aliases, "choices": choices})


@dataclass
class ModelConfig:
    flavour: str = opt(
        "gpt2",
        "gpt2: LayerNorm, GELU, learned positions, biases, tied embeddings; "
        "llama: RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases, untied",
        choices=("gpt2", "llama"),
    )
    num_layers: int = opt(2, "transformer layers")
    hidden_size: int = opt(64, "model width h")
    num_attention_heads: int = opt(4, "attention heads")
    num_query_groups: int | None = opt(
        None, "key/value heads for grouped-query attention (default: heads)"
    )
    ffn_hidden_size: int | None = opt(
        None, "MLP width (default: 4h for gpt2, 8h/3 rounded up to 64 for llama)"
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

    @property
    def heads_kv(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def ffn(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if self.flavour == "llama":
            return -(-8 * self.hidden_size // 3 // 64) * 64
        return 4 * self.hidden_size

    @property
    def tied(self) -> bool:
        if self.untie_embeddings_and_output_weights is None:
            return self.flavour == "gpt2"
        return not self.untie_embeddings_and_output_weights

    @property
    def moe_ffn(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn

    def is_moe_layer(self, i: int) -> bool:
        """Layer i holds experts instead of a dense MLP."""
        return bool(self.num_experts) and i % self.moe_layer_freq == 0

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
        "pipeline schedule (default: interleaved when vpp >= 2, else 1f1b)",
        choices=lambda: tuple(schedules.SCHEDULES),
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
        "HuggingFaceTokenizer too); default: from --tokenizer-model's path",
        choices=(
            "sentencepiece",
            "huggingface",
            "GPTSentencePieceTokenizer",
            "HuggingFaceTokenizer",
        ),
    )
    split: str = opt("98,2,0", "train,valid,test proportions")
    tokenizer_vocab_size: int = opt(
        2048, "vocabulary of the tokenizer trained for the built-in corpus"
    )
    data_cache_dir: str = opt(
        "data_cache", "where the built-in corpus and its tokenizer are cached"
    )
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
    recompute: str = opt(
        "none",
        "activation recomputation",
        "--recompute-granularity",
        choices=("none", "selective", "full"),
    )
    kernels: str = opt(
        "auto", "auto: Triton on CUDA, torch elsewhere", choices=("auto", "triton", "torch")
    )
    max_skipped_steps: int = opt(5, "stop after this many non-finite steps in a row")
    eval_only: bool = opt(False, "with --load: compute eval_loss on the valid split and exit")
    dry_run: bool = opt(False, "print the memory/communication plan and exit (no process group)")
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

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        cfg = cls()
        _apply(cfg, d, source="config")
        return cfg


SECTIONS = [f.name for f in dataclasses.fields(Config)]


def _fields(section_obj):
    hints = typing.get_type_hints(type(section_obj))
    for f in dataclasses.fields(section_obj):
        yield f, hints[f.name]


def _choices(f):
    c = f.metadata.get("choices")
    return c() if callable(c) else c


def _base_type(tp):
    """(scalar type, is_list) of an annotation like int, int | None, list[str]."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is list:
        return args[0], True
    if args:
        return _base_type(args[0])
    return tp, False


def _coerce(value, tp, where):
    scalar, is_list = _base_type(tp)
    if value is None:
        return None
    if is_list:
        items = value if isinstance(value, list) else str(value).split()
        return [str(v) for v in items]
    try:
        if scalar is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("true", "1", "yes"):
                return True
            if str(value).lower() in ("false", "0", "no"):
                return False
            raise ValueError
        if scalar is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        return scalar(value)
    except (TypeError, ValueError):
        raise MegaliteError(f"{where}: {value!r} is not a valid {scalar.__name__}") from None


def _apply(cfg: Config, d: dict, source: str):
    if not isinstance(d, dict):
        raise MegaliteError(f"{source}: expected a mapping of sections ({', '.join(SECTIONS)})")
    for sec, values in d.items():
        if sec not in SECTIONS:
            hint = difflib.get_close_matches(str(sec), SECTIONS, n=1)
            raise MegaliteError(
                f"{source}: unknown section {sec!r}"
                + (
                    f"; did you mean {hint[0]!r}?"
                    if hint
                    else f"; sections are {', '.join(SECTIONS)}"
                )
            )
        obj = getattr(cfg, sec)
        if not isinstance(values, dict):
            raise MegaliteError(f"{source}: section {sec!r} must be a mapping of field: value")
        fields = {f.name: (f, t) for f, t in _fields(obj)}
        for key, value in values.items():
            if key not in fields:
                hint = difflib.get_close_matches(str(key), list(fields), n=1)
                raise MegaliteError(
                    f"{source}: unknown field {sec}.{key}"
                    + (f"; did you mean {hint[0]!r}?" if hint else "")
                )
            f, tp = fields[key]
            v = _coerce(value, tp, f"{source}: {sec}.{key}")
            choices = _choices(f)
            if choices and v not in choices and v is not None:
                raise MegaliteError(
                    f"{source}: {sec}.{key}={v!r} must be one of {', '.join(map(str, choices))}"
                )
            setattr(obj, key, v)


def load_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise MegaliteError(
            f"config file {path} does not exist; pass an existing YAML file to --config"
        )
    try:
        with open(path) as fh:
            d = yaml.safe_load(fh)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise MegaliteError(
            f"config file {path} is not valid YAML{where}; fix its syntax"
        ) from None
    return d or {}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise MegaliteError(message)


def build_parser(prog="pretrain_gpt.py") -> argparse.ArgumentParser:
    p = _Parser(
        prog=prog,
        usage="torchrun --nproc_per_node N %(prog)s [--config FILE.yaml] [flags]",
        description="megalite: 3D-parallel GPT pretraining. Flags override the YAML, which overrides defaults.",
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument("--config", help="YAML preset (sections as in configs/tiny.yaml)")
    defaults = Config()
    for sec in SECTIONS:
        obj = getattr(defaults, sec)
        g = p.add_argument_group(sec)
        for f, tp in _fields(obj):
            names = ["--" + f.name.replace("_", "-"), *f.metadata["aliases"]]
            doc = f.metadata["doc"]
            default = getattr(obj, f.name)
            kw = {"dest": f"{sec}.{f.name}", "help": f"{doc} [{default}]"}
            scalar, is_list = _base_type(tp)
            if scalar is bool:
                g.add_argument(*names, action=argparse.BooleanOptionalAction, **kw)
            else:
                if is_list:
                    kw["nargs"] = "+"
                if _choices(f):
                    kw["choices"] = _choices(f)
                g.add_argument(*names, type=scalar, metavar=f.name.upper(), **kw)
    return p


def parse_args(argv=None, given: set | None = None) -> Config:
    """Defaults, then the YAML of --config, then the flags given. `given`, when passed, receives
    the fields set by the YAML or a flag ("model.hidden_size", ...), as opposed to defaults."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    ns, unknown = parser.parse_known_args(argv)
    if unknown:
        bad = next((u for u in unknown if u.startswith("-")), unknown[0])
        flag = bad.split("=")[0]
        known = [s for a in parser._actions for s in a.option_strings]
        hint = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
        raise MegaliteError(
            f"unknown flag {flag}" + (f"; did you mean {hint[0]}?" if hint else "; see --help")
            if bad.startswith("-")
            else f"unexpected argument {bad!r}; flags look like --name value"
        )
    cfg = Config()
    args = vars(ns)
    if "config" in args:
        path = args.pop("config")
        d = load_yaml(path)
        _apply(cfg, d, source=f"config file {path}")
        if given is not None:
            given.update(f"{sec}.{k}" for sec, v in d.items() for k in v)
    if given is not None:
        given.update(args)
    for dest, value in args.items():
        sec, name = dest.split(".")
        setattr(getattr(cfg, sec), name, value)
    return cfg
