"""The training section of the config (`Config.training`): batch, steps, precision and FP8,
recomputation, kernels, profiling and the run's guards (spikes, stragglers, time limits)."""

from dataclasses import dataclass

from megalite.model_config import opt


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
