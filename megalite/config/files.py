"""The sections of the config that name what a run reads and writes: its data and tokenizer
(`Config.data`), its checkpoints (`Config.checkpoint`) and its logs (`Config.logging`)."""

from dataclasses import dataclass

from megalite.model_config import opt


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
