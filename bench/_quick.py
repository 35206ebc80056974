"""The benchmarks `make bench` runs (bench/run_all.py) and the small settings of each.

QUICK: script -> (arguments for a small run, what the small run leaves out). A name is a path
under bench/, then optionally a word that tells two runs of one script apart (its subcommand);
each script keeps its full-size defaults for whoever has the time. Every script in bench/ is
in QUICK or in HELPERS (run_all.py fails otherwise: a benchmark nobody runs rots).
"""

QUICK = {
    "model/bench_model.py": (
        "--shapes tiny tiny-llama --rounds 6 --warmup 1".split(),
        "the GPT-2-124M shape (about a minute per step per side)",
    ),
    "parallel/bench_tp.py": (
        "--layers 2 --hidden 128 --heads 4 --groups 2 --vocab 1024 --seq 64 --mbs 2 --micro 4 "
        "--warmup 1 --rounds 3".split(),
        "full shape: 8 layers, h 256, s 256, gbs 32",
    ),
    "parallel/bench_dp.py": (
        "--layers 2 --hidden 128 --seq 64 --vocab 1024 --gbs 16 --mbs 2 --bucket-mb 0.25 "
        "--rounds 3".split(),
        "full shape: 8 layers, h 256, s 256, gbs 32",
    ),
    "parallel/zero3_timeline.py": (
        "--layers 2 --hidden 128 --seq 64 --vocab 1024 --gbs 16 --mbs 2 --bucket-mb 0.25 "
        "--steps 1 --contention-iters 2".split(),
        "full shape: 8 layers, h 256, s 256, gbs 32",
    ),
    "parallel/bench_deepspeed.py": (
        "--layers 2 --hidden 128 --seq 64 --vocab 1024 --gbs 16 --mbs 2 --bucket-mb 0.25 "
        "--rounds 3".split(),
        "full shape: 8 layers, h 256, s 256, gbs 32 (the first run also creates .venv-peers)",
    ),
    "pipeline/bench_pipeline.py": (
        "--layers 4 --hidden 128 --seq 64 --vocab 1024 --microbatches 4 --micro-batch 2 "
        "--steps 3".split(),
        "full shape: 8 layers, h 256, s 256, m 8 x 4",
    ),
    "checkpoint/bench_checkpoint.py": (
        "--layers 2 --hidden 384".split(),
        "full size: GPT-2-124M (12 layers, h 768)",
    ),
    "checkpoint/bench_save.py": (
        "--layers 2 --rounds 3".split(),
        "full size: 6 layers, 4 rounds (1.7 GB)",
    ),
    "checkpoint/bench_convert.py": (
        "--layers 2 --hidden 256 --ffn 512 --heads 4 --groups 2 --vocab 2048".split(),
        "full size: Llama-3.2-3B's shape (6.4 GB; docs/benchmarks.md)",
    ),
    "model/bench_generate.py": (
        "--layers 2 --hidden 192 --heads 4 --groups 2 --vocab 1024 --seq 512 --prompt 32 "
        "--new 16 --rounds 2 --contexts 64 256 --steps 8 --real-size --real-rounds 1".split(),
        "full shape: 4 layers, h 256, contexts 64 and 512; --real-rounds 2",
    ),
    "parallel/bench_muon.py": (
        "--layers 1 --hidden 128 --ffn 512 --steps 2 --repeats 1".split(),
        "2 layers of 384, ffn 1536, 5 steps x 3 repeats",
    ),
    "model/bench_compile.py": (
        "--layers 2 --hidden 128 --seq 128 --rounds 3 --warmup 1".split(),
        "the shape 4 x 256, s 256, 8 rounds",
    ),
    "data/bench_data.py": (
        "--repeats 1 --corpus-mb 16".split(),
        "5 interleaved rounds; a 1 GB corpus beside Megatron-LM's tool (--megatron-lm PATH)",
    ),
    "data/bench_index.py": (
        "--samples 2000000 --docs 100000 --rounds 1".split(),
        "10^8 samples over 2M documents, 2 rounds (docs/benchmarks.md)",
    ),
    "checkpoint/bench_recovery.py": (
        "--iters 8 --kill-after 5 --overhead-iters 0".split(),
        "the local save's cost on the step (--overhead-iters)",
    ),
    "plan/plan_calibration.py": (["--only", "GPT 1.7B"], "the other published rows"),
    "checkpoint/bench_async_save.py": (
        "--layers 1 --hidden 192 --seq 32 --steps 2 --every 2 --zero 1".split(),
        "full size: GPT-2-124M, 12 steps, ZeRO 0 and 1",
    ),
    "pipeline/bench_zero_bubble.py": (
        ["--rounds", "2"],
        "3 rounds (stages sleep instead of computing: cheap at any size)",
    ),
    "parallel/bench_moe.py": (
        "--hidden 128 --ffn 256 --tokens 512 --rounds 3".split(),
        "full shape: h 256, ffn 512, 2048 tokens, 7 rounds",
    ),
    "parallel/bench_context_parallel.py": (
        "--seq 512 --layers 1 --hidden 128 --heads 4 --groups 2 --cps 1,2 --rounds 2".split(),
        "full shape: s 4096, 2 layers, h 256, cp 1, 2 and 4",
    ),
    "parallel/bench_zero3.py": (
        "--layers 2 --hidden 128 --heads 4 --seq 64 --vocab 1024 --steps 2 --repeats 1".split(),
        "full shape: 8 layers, h 384, s 256, 2 repeats of 3 steps",
    ),
    "model/bench_nanogpt.py": (
        "--iters 150 --block 25".split(),
        "the full 2000 iterations of nanoGPT's recipe (about 5 minutes)",
    ),
    "parallel/profile_tp.py": (
        "--layers 2 --hidden 128 --heads 4 --groups 2 --vocab 1024 --seq 64 --mbs 2 --micro 4 "
        "--steps 1".split(),
        "bench_tp.py's full shape, 2 profiled steps",
    ),
    "parallel/profile_peers.py pp": (
        "pp --layers 4 --hidden 128 --seq 64 --vocab 1024 --microbatches 4 --micro-batch 2 "
        "--profile-steps 1".split(),
        "bench_pipeline.py's full shape, 2 profiled steps",
    ),
    "parallel/stress_exit.py": (["--runs", "1"], "50 runs per job"),
    "gpu/gpu_trainer_check.py multirank": (
        "multirank --device cpu --timeout 120".split(),
        "on CPU; the GPU run is gpu_check.sh's",
    ),
    "gpu/gpu_trainer_check.py syncs": (
        "syncs --device cpu --steps 2".split(),
        "on CPU (counts reads of device values only); the GPU run is gpu_check.sh's",
    ),
    "gpu/kernels.py": (["--dry-run"], "needs a GPU: only lists its cases"),
    "gpu/gpu_large_check.py kernels": (
        "kernels --smoke --device cpu".split(),
        "tiny sizes on CPU, the references only; the GPU run is gpu_check.sh's",
    ),
    "../tools/check_kernels.py": ("--full --write docs/kernels.md".split(), "nothing (sm_86/89)"),
}
# scripts that need longer than --timeout: the full kernel sweep compiles ~750 kernels (about
# 20 minutes cold on 2 busy cores; its ptxas reports are cached after)
TIMEOUTS = {"../tools/check_kernels.py": 3600}
# scripts of bench/ that are not benchmarks
HELPERS = {
    "run_all.py",
    "_quick.py",
    "_common.py",
    "parallel/_tp_torch.py",
    "parallel/_tp_traffic.py",
    "parallel/_dp_sides.py",
    "model/_load_at_size.py",
    "gpu/_gloo_cuda.py",
    "data/text_corpus.py",
}
# scripts that take --summary PATH (their headline figures for the table)
SUMMARY = {"model/bench_model.py", "parallel/bench_tp.py", "parallel/bench_dp.py",
           "pipeline/bench_pipeline.py", "parallel/bench_deepspeed.py",
           "checkpoint/bench_checkpoint.py", "model/bench_generate.py", "data/bench_data.py",
           "parallel/bench_context_parallel.py", "parallel/bench_zero3.py",
           "model/bench_nanogpt.py", "checkpoint/bench_save.py", "data/bench_index.py",
           "checkpoint/bench_convert.py"}  # fmt: skip
