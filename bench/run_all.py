"""`make bench`: every benchmark in bench/ at small settings, one summary table.

    .venv/bin/python bench/run_all.py [--only NAME ...] [--logs DIR] [--timeout 600]

Each script runs in its own process with the small shapes below (QUICK), so the whole set
finishes in under 15 minutes on a 2-core CPU (12.6 min for 16 runs at load average 8-12 on the
development machine, docs/benchmarks.md); each script keeps its full-size defaults for
whoever has the time (`python bench/<subject>/<name>.py`, the commands in bench/README.md and
on the docs/bench_*.md pages). Names are paths under bench/.
The figures printed here come from those small shapes on whatever load the machine has: they
show that every benchmark runs and roughly where it stands, not the documented figures.

Not run here, because they need a GPU: bench/gpu_check.sh (its syntax is checked with bash -n)
and bench/gpu/kernels.py (only its --dry-run, which lists the cases).
bench/gpu/gpu_trainer_check.py, which gpu_check.sh runs on a GPU, runs here on CPU;
bench/gpu/gpu_large_check.py kernels in its --smoke mode (its memory check needs a run's metrics: tests/unit/test_gpu_check.py).

Exits non-zero when any benchmark fails, times out, or a script in bench/ has no entry in
QUICK (add one: a benchmark nobody runs rots).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent

# script -> (arguments for a small run, what the small run leaves out)
QUICK = {
    "model/bench_model.py": (
        ["--shapes", "tiny", "tiny-llama", "--rounds", "6", "--warmup", "1"],
        "the GPT-2-124M shape (about a minute per step per side)",
    ),
    "parallel/bench_tp.py": (
        [
            "--layers",
            "2",
            "--hidden",
            "128",
            "--heads",
            "4",
            "--groups",
            "2",
            "--vocab",
            "1024",
            "--seq",
            "64",
            "--mbs",
            "2",
            "--micro",
            "4",
            "--warmup",
            "1",
            "--rounds",
            "3",
        ],
        "full shape: 8 layers, h 256, s 256, gbs 32",
    ),  # fmt: skip
    "parallel/bench_dp.py": (
        [
            "--layers",
            "2",
            "--hidden",
            "128",
            "--seq",
            "64",
            "--vocab",
            "1024",
            "--gbs",
            "16",
            "--mbs",
            "2",
            "--bucket-mb",
            "0.25",
            "--rounds",
            "3",
        ],
        "full shape: 8 layers, h 256, s 256, gbs 32",
    ),  # fmt: skip
    "parallel/zero3_timeline.py": (
        "--layers 2 --hidden 128 --seq 64 --vocab 1024 --gbs 16 --mbs 2 --bucket-mb 0.25 "
        "--steps 1 --contention-iters 2".split(),
        "full shape: 8 layers, h 256, s 256, gbs 32",
    ),
    "parallel/bench_deepspeed.py": (
        [
            "--layers",
            "2",
            "--hidden",
            "128",
            "--seq",
            "64",
            "--vocab",
            "1024",
            "--gbs",
            "16",
            "--mbs",
            "2",
            "--bucket-mb",
            "0.25",
            "--rounds",
            "3",
        ],
        "full shape: 8 layers, h 256, s 256, gbs 32 (the first run also creates .venv-peers)",
    ),  # fmt: skip
    "pipeline/bench_pipeline.py": (
        [
            "--layers",
            "4",
            "--hidden",
            "128",
            "--seq",
            "64",
            "--vocab",
            "1024",
            "--microbatches",
            "4",
            "--micro-batch",
            "2",
            "--steps",
            "3",
        ],
        "full shape: 8 layers, h 256, s 256, m 8 x 4",
    ),  # fmt: skip
    "checkpoint/bench_checkpoint.py": (
        ["--layers", "2", "--hidden", "384"],
        "full size: GPT-2-124M (12 layers, h 768)",
    ),
    "checkpoint/bench_save.py": (
        ["--layers", "2", "--rounds", "3"],
        "full size: 6 layers, 4 rounds (1.7 GB)",
    ),
    "checkpoint/bench_convert.py": (
        [
            "--layers",
            "2",
            "--hidden",
            "256",
            "--ffn",
            "512",
            "--heads",
            "4",
            "--groups",
            "2",
            "--vocab",
            "2048",
        ],
        "full size: Llama-3.2-3B's shape (6.4 GB; docs/benchmarks.md)",
    ),  # fmt: skip
    "model/bench_generate.py": (
        [
            "--layers",
            "2",
            "--hidden",
            "192",
            "--heads",
            "4",
            "--groups",
            "2",
            "--vocab",
            "1024",
            "--seq",
            "512",
            "--prompt",
            "32",
            "--new",
            "16",
            "--rounds",
            "2",
            "--contexts",
            "64",
            "256",
            "--steps",
            "8",
            "--real-size",
            "--real-rounds",
            "1",
        ],
        "full shape: 4 layers, h 256, contexts 64 and 512; --real-rounds 2",
    ),  # fmt: skip
    "parallel/bench_muon.py": (
        ["--layers", "1", "--hidden", "128", "--ffn", "512", "--steps", "2", "--repeats", "1"],
        "2 layers of 384, ffn 1536, 5 steps x 3 repeats",
    ),  # fmt: skip
    "model/bench_compile.py": (
        ["--layers", "2", "--hidden", "128", "--seq", "128", "--rounds", "3", "--warmup", "1"],
        "the shape 4 x 256, s 256, 8 rounds",
    ),  # fmt: skip
    "data/bench_data.py": (
        ["--repeats", "1", "--corpus-mb", "16"],
        "5 interleaved rounds; a 1 GB corpus beside Megatron-LM's tool (--megatron-lm PATH)",
    ),
    "data/bench_index.py": (
        ["--samples", "2000000", "--docs", "100000", "--rounds", "1"],
        "10^8 samples over 2M documents, 2 rounds (docs/benchmarks.md)",
    ),
    "checkpoint/bench_recovery.py": (
        ["--iters", "8", "--kill-after", "5", "--overhead-iters", "0"],
        "the local save's cost on the step (--overhead-iters)",
    ),
    "plan/plan_calibration.py": (["--only", "GPT 1.7B"], "the other published rows"),
    "checkpoint/bench_async_save.py": (
        [
            "--layers",
            "1",
            "--hidden",
            "192",
            "--seq",
            "32",
            "--steps",
            "2",
            "--every",
            "2",
            "--zero",
            "1",
        ],
        "full size: GPT-2-124M, 12 steps, ZeRO 0 and 1",
    ),  # fmt: skip
    "pipeline/bench_zero_bubble.py": (
        ["--rounds", "2"],
        "3 rounds (stages sleep instead of computing: cheap at any size)",
    ),
    "parallel/bench_moe.py": (
        ["--hidden", "128", "--ffn", "256", "--tokens", "512", "--rounds", "3"],
        "full shape: h 256, ffn 512, 2048 tokens, 7 rounds",
    ),
    "parallel/bench_context_parallel.py": (
        [
            "--seq",
            "512",
            "--layers",
            "1",
            "--hidden",
            "128",
            "--heads",
            "4",
            "--groups",
            "2",
            "--cps",
            "1,2",
            "--rounds",
            "2",
        ],
        "full shape: s 4096, 2 layers, h 256, cp 1, 2 and 4",
    ),  # fmt: skip
    "parallel/bench_zero3.py": (
        [
            "--layers",
            "2",
            "--hidden",
            "128",
            "--heads",
            "4",
            "--seq",
            "64",
            "--vocab",
            "1024",
            "--steps",
            "2",
            "--repeats",
            "1",
        ],
        "full shape: 8 layers, h 384, s 256, 2 repeats of 3 steps",
    ),  # fmt: skip
    "model/bench_nanogpt.py": (
        ["--iters", "150", "--block", "25"],
        "the full 2000 iterations of nanoGPT's recipe (about 5 minutes)",
    ),
    "parallel/profile_tp.py": (
        [
            "--layers",
            "2",
            "--hidden",
            "128",
            "--heads",
            "4",
            "--groups",
            "2",
            "--vocab",
            "1024",
            "--seq",
            "64",
            "--mbs",
            "2",
            "--micro",
            "4",
            "--steps",
            "1",
        ],
        "bench_tp.py's full shape, 2 profiled steps",
    ),  # fmt: skip
    "parallel/profile_peers.py pp": (
        [
            "pp",
            "--layers",
            "4",
            "--hidden",
            "128",
            "--seq",
            "64",
            "--vocab",
            "1024",
            "--microbatches",
            "4",
            "--micro-batch",
            "2",
            "--profile-steps",
            "1",
        ],
        "bench_pipeline.py's full shape, 2 profiled steps",
    ),  # fmt: skip
    "parallel/stress_exit.py": (["--runs", "1"], "50 runs per job"),
    "gpu/gpu_trainer_check.py multirank": (
        ["multirank", "--device", "cpu", "--timeout", "120"],
        "on CPU; the GPU run is gpu_check.sh's",
    ),
    "gpu/gpu_trainer_check.py syncs": (
        ["syncs", "--device", "cpu", "--steps", "2"],
        "on CPU (counts reads of device values only); the GPU run is gpu_check.sh's",
    ),
    "gpu/kernels.py": (["--dry-run"], "needs a GPU: only lists its cases"),
    "gpu/gpu_large_check.py kernels": (
        ["kernels", "--smoke", "--device", "cpu"],
        "tiny sizes on CPU, the references only; the GPU run is gpu_check.sh's",
    ),
    "../tools/check_kernels.py": (["--full", "--write", "docs/kernels.md"], "nothing (sm_86/89)"),
}
# scripts that need longer than --timeout: the full kernel sweep compiles ~750 kernels (about
# 20 minutes cold on 2 busy cores; its ptxas reports are cached after)
TIMEOUTS = {"../tools/check_kernels.py": 3600}
# scripts of bench/ that are not benchmarks
HELPERS = {
    "run_all.py",
    "_common.py",
    "parallel/_tp_torch.py",
    "model/_load_at_size.py",
    "data/text_corpus.py",
}
# scripts that take --summary PATH (their headline figures for the table)
SUMMARY = {"model/bench_model.py", "parallel/bench_tp.py", "parallel/bench_dp.py",
           "pipeline/bench_pipeline.py", "parallel/bench_deepspeed.py",
           "checkpoint/bench_checkpoint.py", "model/bench_generate.py", "data/bench_data.py",
           "parallel/bench_context_parallel.py", "parallel/bench_zero3.py",
           "model/bench_nanogpt.py", "checkpoint/bench_save.py", "data/bench_index.py",
           "checkpoint/bench_convert.py"}  # fmt: skip


def check_coverage() -> list[str]:
    """Scripts in bench/ that QUICK does not run."""
    covered = {name.split()[0] for name in QUICK} | HELPERS
    found = (p.relative_to(BENCH).as_posix() for p in BENCH.rglob("*.py"))
    return sorted(name for name in found if name not in covered)


def run_one(name: str, args: list[str], logs: Path, timeout: float) -> dict:
    script = name.split()[0]
    summary = logs / f"{name.replace(' ', '_').replace('/', '_')}.summary.json"
    summary.unlink(missing_ok=True)
    cmd = [sys.executable, "-u", str(BENCH / script), *args]
    if script in SUMMARY:
        cmd += ["--summary", str(summary)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           # gpu_trainer_check on CPU: stage p2p through host copies as on a GPU (tests it)
           "MEGALITE_CHECK_STAGE_P2P": "1", "OUT": str(logs)}  # fmt: skip
    log = logs / f"{name.replace(' ', '_').replace('/', '_')}.log"
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = "timeout"
    figures = json.loads(summary.read_text()).get("figures", []) if summary.exists() else []
    return {"name": name, "rc": rc, "seconds": time.perf_counter() - t0, "log": str(log),
            "figures": figures}  # fmt: skip


def _fmt(f: dict) -> str:
    v = f["value"]
    unit = {"x": "x", "share": "", "": ""}.get(f["unit"], " " + f["unit"])
    value = f"{v:.1%}" if f["unit"] == "share" else f"{v}{unit}"
    target = (
        ""
        if not f.get("target")
        else f" (target {f['target']}: {'met' if f['met'] else 'NOT met'})"
    )
    return f"{f['what']}: {value}{target}"


def main(argv=None):
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="+", help="run only these (names as in the table)")
    ap.add_argument("--logs", help="directory for each run's log (default: a temporary one)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per benchmark")
    a = ap.parse_args(argv)
    missing = check_coverage()
    logs = Path(a.logs or tempfile.mkdtemp(prefix="megalite_bench_"))
    logs.mkdir(parents=True, exist_ok=True)
    try:
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        load = "unknown"
    print(f"bench/run_all.py: small settings on {os.cpu_count()} cores (load average {load}); "
          f"logs in {logs}", flush=True)  # fmt: skip
    print("skipped: bench/gpu_check.sh (needs a GPU; run it on one); bench/gpu/kernels.py runs only "
          "--dry-run (its timings need a GPU)", flush=True)  # fmt: skip
    gpu_sh = subprocess.run(
        ["bash", "-n", str(BENCH / "gpu_check.sh")], capture_output=True, text=True
    )
    results = []
    for name, (args, left_out) in QUICK.items():
        if a.only and name not in a.only and name.split()[0] not in a.only:
            continue
        if not (BENCH / name.split()[0]).exists():
            print(f"-- {name}: not in this checkout, skipped", flush=True)
            continue
        print(f"-- {name} ({left_out})", flush=True)
        r = run_one(name, args, logs, max(a.timeout, TIMEOUTS.get(name, 0)))
        r["left_out"] = left_out
        results.append(r)
        state = "ok" if r["rc"] == 0 else f"FAILED ({r['rc']})"
        print(f"   {state} in {r['seconds']:.0f} s", flush=True)
        for f in r["figures"]:
            print(f"   {_fmt(f)}", flush=True)
        if r["rc"] != 0:
            tail = Path(r["log"]).read_text().splitlines()[-15:]
            print("   " + "\n   ".join(tail), flush=True)

    print("\n| benchmark | status | seconds | headline figures at the small settings |")
    print("| --- | --- | --- | --- |")
    for r in results:
        state = "ok" if r["rc"] == 0 else f"**FAILED** ({r['rc']})"
        figs = "; ".join(_fmt(f) for f in r["figures"]) or "-"
        print(f"| {r['name']} | {state} | {r['seconds']:.0f} | {figs} |")
    print(f"| gpu_check.sh | {'syntax ok' if gpu_sh.returncode == 0 else '**bash -n FAILED**'} "
          "(not run: needs a GPU) | - | - |")  # fmt: skip
    failed = [r["name"] for r in results if r["rc"] != 0]
    if gpu_sh.returncode != 0:
        failed.append("gpu_check.sh (bash -n): " + gpu_sh.stderr.strip())
    if missing:
        failed.append(f"not covered by run_all.py QUICK: {', '.join(missing)}")
    total = sum(r["seconds"] for r in results)
    print(
        f"\n{len(results)} run in {total / 60:.1f} min; "
        + ("all ok" if not failed else "failed: " + "; ".join(failed))
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
