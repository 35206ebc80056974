"""The optimizer section of the config (`Config.optimizer`): learning-rate schedule, AdamW or
Muon, ZeRO stage, fp16 loss scaling."""

from dataclasses import dataclass

from megalite.model_config import opt


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
