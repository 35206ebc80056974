"""Typed configuration: nested dataclasses filled from defaults, then YAML, then CLI flags.

Every field carries its documentation (shown by `--help`) and its flag names: the field name
with dashes (`--micro-batch-size`) plus Megatron-LM's long names and short aliases.
`megalite/config_read.py` fills one from YAML, flags or a dict (this module is data only and
imports nothing of megalite but model_config); `megalite.shape.validate()` rejects impossible combinations with
one clear sentence before any process group exists and derives the run's shape; nothing writes
into a Config afterwards. The model's part (`ModelConfig`, the `FLAVOURS` table) is
megalite/model_config.py.
"""

import dataclasses
from dataclasses import dataclass, field

from megalite.model_config import ModelConfig, opt

# The rank order of the parallel axes, fastest-varying first; parallel/topology.py takes its
# default from here. An axis of size 1 takes no place: tp-dp-pp ranks unchanged. dpr (the copies
# of a ZeRO shard group, --dp-replicate) after dp: a shard group stays inside a node.
DEFAULT_ORDER = "tp-cp-dp-dpr-pp"


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
    decoder_first_pipeline_num_layers: int | None = opt(
        None, "layers on the first pipeline rank (the rest split evenly over the others)"
    )
    decoder_last_pipeline_num_layers: int | None = opt(
        None, "layers on the last pipeline rank (the rest split evenly over the others)"
    )
    account_for_embedding_in_pipeline_split: bool = opt(
        False, "count the embedding as a layer: the first virtual stage one layer short"
    )
    account_for_loss_in_pipeline_split: bool = opt(
        False, "count the head and loss as a layer: the last virtual stage one layer short"
    )
    pipeline_model_parallel_layout: str | None = opt(
        None,
        'every virtual stage spelled out, Megatron\'s layout string: "Et*3|(tt|)*29,m|L" (E '
        "embedding, t layer, m MTP, L loss, | between stages, (...)*n repeats)",
        "--pp-layout",
    )
    dp: int | None = opt(
        None, "data-parallel size (default: world size / (tp*cp*pp))", "--data-parallel-size"
    )
    dp_replicate: int = opt(
        1,
        "hybrid sharding (HSDP): the dp ranks form this many copies of a ZeRO shard group of "
        "dp/dp_replicate ranks; gradients are reduce-scattered inside a group, then each shard "
        "all-reduced over the copies (needs --zero-stage >= 1)",
        "--num-distributed-optimizer-instances",
    )
    cp: int = opt(
        1,
        "context-parallel size: each sample's sequence split over cp ranks (long contexts)",
        "--context-parallel-size",
    )
    cp_comm_type: str = opt(
        "p2p",
        "context-parallel attention: p2p (ring: K/V blocks passed round the cp ranks) or a2a "
        "(all-to-all: heads exchanged for the sequence, Ulysses) or a2a+p2p (all-to-all within "
        "groups of adjacent cp ranks, the ring across them: --hierarchical-context-parallel-sizes)",
        choices=("p2p", "a2a", "a2a+p2p"),
    )
    hierarchical_context_parallel_sizes: list[int] | None = opt(
        None,
        "a2a+p2p's two levels A P of cp = A*P: all-to-all among A adjacent cp ranks (a node's), "
        "the ring over the P groups of them",
    )
    order: str = opt(
        DEFAULT_ORDER,
        "rank order of the parallel axes, fastest-varying first (TP adjacent keeps it in a node)",
    )
    sequence_parallel: bool = opt(
        False, "shard norm/dropout activations along the sequence over TP"
    )
    tp_comm_overlap: bool = opt(
        False,
        "with --sequence-parallel: the q/k/v and gate/up matmuls run chunk by chunk behind their "
        "input's all-gather, the row-parallel ones ahead of their output's reduce-scatter "
        "(tp chunks along the sequence; docs/architecture.md)",
    )
    ep: int = opt(
        1,
        "expert-parallel size: experts split over ep ranks of tp*dp (it divides tp*dp, not the "
        "world)",
        "--expert-model-parallel-size",
    )
    etp: int = opt(
        1,
        "expert tensor-parallel size: each expert's width split over etp ranks of an ep slot "
        "(ep*etp divides the ranks of a stage)",
        "--expert-tensor-parallel-size",
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
    # The schedule is megatron-core's OptimizerParamScheduler, counted in samples (lr_schedule.py)
    lr: float = opt(3e-4, "peak learning rate")
    min_lr: float = opt(0.0, "learning rate at the end of decay")
    lr_warmup_iters: int = opt(
        0, "linear warmup steps (--lr-warmup-init at step 0, lr at the last)"
    )
    lr_warmup_samples: int = opt(0, "with --train-samples: linear warmup over this many samples")
    lr_warmup_fraction: float | None = opt(
        None, "warmup over this fraction of the decay (instead of --lr-warmup-iters/-samples)"
    )
    lr_warmup_init: float = opt(0.0, "learning rate at the start of warmup")
    lr_decay_iters: int | None = opt(None, "decay steps (default: train_iters)")
    lr_decay_samples: int | None = opt(
        None, "with --train-samples: decay over this many samples (default: train_samples)"
    )
    lr_decay_style: str = opt(
        "cosine",
        "decay after warmup (WSD: constant, then --lr-wsd-decay-style over the last "
        "--lr-wsd-decay-iters/-samples)",
        choices=("cosine", "linear", "constant", "inverse-square-root", "WSD"),
    )
    lr_wsd_decay_style: str = opt(
        "exponential", "WSD's annealing phase",
        choices=("exponential", "linear", "cosine", "minus_sqrt"),
    )  # fmt: skip
    lr_wsd_decay_iters: int | None = opt(None, "WSD: steps of the annealing phase")
    lr_wsd_decay_samples: int | None = opt(
        None, "WSD with --train-samples: samples of the annealing phase"
    )
    decoupled_lr: float | None = opt(
        None, "peak learning rate of the embedding and output layer (default: --lr)"
    )
    decoupled_min_lr: float | None = opt(
        None, "with --decoupled-lr: their minimum learning rate (default: --min-lr)"
    )
    weight_decay: float = opt(0.1, "AdamW weight decay (not applied to norms and biases)")
    weight_decay_incr_style: str = opt(
        "constant",
        "weight decay over the run: constant (--weight-decay), or linear/cosine from "
        "--start-weight-decay to --end-weight-decay",
        choices=("constant", "linear", "cosine"),
    )
    start_weight_decay: float | None = opt(None, "weight decay at the start (linear/cosine)")
    end_weight_decay: float | None = opt(None, "weight decay at the end (linear/cosine)")
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
    bucket_size_mb: float | None = opt(
        None,
        "gradient bucket size for the data-parallel reduction (default: 25 MB, or 2^20 elements "
        "per data-parallel rank when larger, so collectives at large dp stay bandwidth-bound)",
    )
    overlap_param_gather: bool = opt(
        True,
        "ZeRO >= 1: gather updated parameters while the next forward runs (each bucket waited "
        "for by the first layer that reads it)",
    )
    initial_loss_scale: float = opt(2.0**32, "fp16: starting loss scale (dynamic)")
    loss_scale_window: int = opt(1000, "fp16: steps without overflow before the scale doubles")
    min_loss_scale: float = opt(1.0, "fp16: the scale never falls below this")
    hysteresis: int = opt(2, "fp16: overflowing steps in a row before the scale halves")
    loss_scale: float | None = opt(
        None, "a static loss scale instead of the dynamic one (fp16, or bf16 if given)"
    )
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
        "data_cache",
        "where the built-in corpus and its tokenizer are cached (and the sample-order indices "
        "when the data's directory cannot be written)",
    )
    data_cache_path: str | None = opt(
        None,
        "where the built sample-order indices are cached as .npy (default: megalite_indices/ "
        "beside the data, else under --data-cache-dir)",
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
    train_iters: int | None = opt(
        None, "optimizer steps (default 20; with --train-samples: counted from it)"
    )
    train_samples: int | None = opt(
        None, "train this many samples (instead of --train-iters; a partial last batch dropped)"
    )
    rampup_batch_size: list[int] | None = opt(
        None,
        "START INCR SAMPLES: the global batch starts at START and grows by INCR over SAMPLES "
        "samples to --global-batch-size (needs --train-samples)",
    )
    step_batch_size_schedule: str | None = opt(
        None,
        '"THRESHOLD:SIZE ...": the global batch is SIZE from THRESHOLD tokens on (suffixes K M '
        "B T; the first threshold 0, the last SIZE --global-batch-size)",
    )
    eval_interval: int = opt(0, "evaluate every N steps (0: never)")
    eval_iters: int = opt(2, "batches per evaluation")
    log_interval: int = opt(1, "console/metrics line every N steps")
    manual_gc: bool = opt(
        False,
        "turn Python's automatic garbage collection off; collect on the same steps on every "
        "rank (--manual-gc-interval) and after evaluations, so no rank stalls the others",
    )
    manual_gc_interval: int = opt(
        0, "--manual-gc: collect every N steps (0: only after evaluations)"
    )
    seed: int = opt(1234, "seed for initialisation, data order and dropout")
    precision: str = opt("fp32", "parameter/compute precision", choices=("fp32", "bf16", "fp16"))
    bf16: bool = opt(False, "Megatron's name for --precision bf16")
    fp16: bool = opt(False, "Megatron's name for --precision fp16 (dynamic loss scaling)")
    grad_reduce_in_bf16: bool = opt(
        False, "with --bf16: accumulate and reduce gradients in bf16 (Megatron's bf16 main_grad; "
        "default fp32), the optimizer's norm, clipping and update on fp32 copies",
    )  # fmt: skip
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
    fp8_scale_pow2: bool = opt(
        True, "tensorwise/delayed FP8: scales rounded down to a power of two (--no-fp8-scale-pow2: "
        "448/amax exactly, as torchao's default)",
    )  # fmt: skip
    fp8_first_last_layers_bf16: bool = opt(
        False, "with FP8: the first and last transformer layers' linears stay in high precision",
        "--first-last-layers-bf16",
    )  # fmt: skip
    fp8_param_gather: bool = opt(
        False, "ZeRO-3 with FP8 (tensorwise, delayed): gather the FP8 linears' weights in FP8 "
        "(1 byte per element; docs/zero3.md)",
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
    fake_world_device: str = opt(
        "cpu",
        "the device the fake world's tensors claim: cpu (any torch) or cuda (takes the CUDA "
        "branches; needs a CUDA build of torch and a visible GPU, docs/fake_world.md)",
        choices=("cpu", "cuda"),
    )
    profile_steps: str | None = opt(None, "A:B records a per-rank timeline of steps A..B-1")
    profile: bool = opt(
        False,
        "torch.profiler traces (Chrome JSON) of the steps after --profile-step-start up to "
        "--profile-step-end (Megatron's numbering: steps done), one per rank of --profile-ranks",
    )
    profile_step_start: int = opt(10, "--profile: steps done when the trace starts")
    profile_step_end: int = opt(12, "--profile: steps done when the trace stops")
    profile_ranks: list[int] = opt(lambda: [0], "--profile: the ranks that trace")
    profile_dir: str | None = opt(
        None, "where --profile writes trace-rank<R>.json (default: --tensorboard-dir, else profile)"
    )
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

    def __setattr__(self, name, value):
        # --bf16 / --fp16 (Megatron's switches) set the precision where they are read, so YAML,
        # flags and dicts agree on it; shape.validate() refuses the two together
        object.__setattr__(self, name, value)
        if name in ("bf16", "fp16") and value:
            object.__setattr__(self, "precision", name)


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
    ckpt_format: str = opt(
        "megalite",
        "torch_dist (or torch: legacy files at this run's layout): each save also writes "
        "Megatron-LM's files (weights, iteration, consumed samples) into its directory, so "
        "Megatron --loads --save (with --no-load-optim --no-load-rng); --load reads Megatron "
        "checkpoints whatever this says",
        choices=("megalite", "torch_dist", "torch"),
    )
    megatron_layernorm_1p: bool = opt(
        False,
        "Megatron's files of --ckpt-format saves hold each norm weight as its offset from 1, "
        "as a Megatron run with --apply-layernorm-1p stores it (megalite keeps the weight)",
    )
    use_checkpoint_args: bool = opt(
        False,
        "accepted for Megatron compatibility: the model architecture is always taken from the "
        "loaded checkpoint where no model flag gives it",
    )
    # node-local checkpoints replicated to peers (checkpoint/local_tier.py)
    non_persistent_save_interval: int = opt(
        0, "save node-locally every N steps, in the background (0: off)"
    )
    non_persistent_ckpt_type: str | None = opt(
        None, "local: node-local checkpoints (the only kind)", choices=("local",)
    )
    non_persistent_local_ckpt_dir: str | None = opt(
        None, "node-local directory of the local checkpoints (local disk or /dev/shm)"
    )
    replication: bool = opt(False, "copy each rank's local checkpoint to peers")
    replication_factor: int = opt(2, "copies of each local shard, the rank's own included")
    replication_jump: int = opt(
        1, "ranks between a shard's copies (ranks per node: the copies on other nodes)"
    )


@dataclass
class LoggingConfig:
    metrics_file: str | None = opt(None, "append one JSON object per logged step")
    # W&B settings left unset (None) take W&B's own environment variables (WANDB_PROJECT, ...),
    # then the defaults in training/logger.py WANDB_DEFAULTS: a flag given wins over both.
    wandb_project: str | None = opt(
        None, "Weights & Biases project (else $WANDB_PROJECT, megalite)"
    )
    wandb_entity: str | None = opt(None, "Weights & Biases entity (else $WANDB_ENTITY)")
    wandb_run_name: str | None = opt(None, "Weights & Biases run name (else $WANDB_NAME)")
    wandb_group: str | None = opt(None, "Weights & Biases run group (else $WANDB_RUN_GROUP)")
    wandb_run_id: str | None = opt(
        None,
        "continue this Weights & Biases run (else $WANDB_RUN_ID, else the id the resumed "
        "checkpoint saved, else a new run)",
    )
    wandb_mode: str | None = opt(
        None,
        "offline needs no account; sync later (else $WANDB_MODE, offline)",
        choices=("offline", "online", "disabled"),
    )
    wandb_dir: str | None = opt(None, "where W&B writes its files (else $WANDB_DIR, runs)")
    tensorboard_dir: str | None = opt(
        None,
        "also write the logged scalars as TensorBoard event files here (needs tensorboard; a "
        "resumed run without it writes where the checkpoint's run did)",
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
