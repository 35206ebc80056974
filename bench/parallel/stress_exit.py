"""Exit stress: run the tiny tp=2 and pp=2 jobs (with checkpoint saves) many times under
torchrun and count the runs that fail: a non-zero exit, or "terminate called" in the output.

    .venv/bin/python bench/parallel/stress_exit.py [--runs 50] [--jobs tp pp] [--hidden-size 64]
        [--wandb-mode disabled] [--load 0]

A finished run used to abort now and then at interpreter exit, more often on a loaded machine
(see `destroy` in megalite/parallel/groups.py); --load N adds N busy-loop processes meanwhile.
Each run works in a directory of its own; a failed run's directory (its output, and a core file
where `ulimit -c` allows one) is kept and named.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOBS = {"tp": ["--tp", "2"], "pp": ["--pp", "2"]}


def run_once(layout: list[str], args) -> tuple[bool, bool, str]:
    """One run of a job: (failed, printed "terminate called", its directory)."""
    d = tempfile.mkdtemp(prefix="stress_exit.")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "pretrain_gpt.py"), *layout, "--hidden-size", str(args.hidden_size),
           "--num-layers", "4", "--num-attention-heads", "4", "--seq-length", "32",
           "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "8",
           "--save", f"{d}/ckpt", "--save-interval", "2", "--wandb-mode", args.wandb_mode,
           "--wandb-dir", f"{d}/wandb", "--data-cache-dir", f"{ROOT}/data_cache"]  # fmt: skip
    # this checkout's megalite, whatever is installed; faulthandler: Python stacks on SIGABRT
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    with open(f"{d}/output.log", "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=d, env=env, stdout=log, stderr=subprocess.STDOUT,
                                timeout=600).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = "timeout (600 s)"
        print(f"stress_exit: exit status {rc}", file=log)
    ok = rc == 0
    aborted = "terminate called" in open(f"{d}/output.log", errors="replace").read()
    if ok and not aborted:
        shutil.rmtree(d)
    return not ok or aborted, aborted, d


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=50, help="runs of each job")
    ap.add_argument("--jobs", nargs="+", choices=sorted(JOBS), default=["tp", "pp"])
    ap.add_argument("--hidden-size", type=int, default=64)
    ap.add_argument("--wandb-mode", default="disabled", choices=("disabled", "offline"))
    ap.add_argument("--load", type=int, default=0, help="busy-loop processes alongside")
    args = ap.parse_args()

    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        for job in args.jobs:
            start, failed, aborted = time.monotonic(), [], 0
            for _ in range(args.runs):
                bad, abort, d = run_once(JOBS[job], args)
                aborted += abort
                if bad:
                    failed.append(d)
            per_run = (time.monotonic() - start) / args.runs
            print(f"{job}: {len(failed)} of {args.runs} runs failed ({aborted} with 'terminate "
                  f"called'); {per_run:.1f} s per run, {args.load} busy loops, load average "
                  f"{os.getloadavg()[0]:.1f}" + "".join(f"\n  kept {d}" for d in failed), flush=True)  # fmt: skip
    finally:
        for h in hogs:
            h.kill()
            h.wait()


if __name__ == "__main__":
    main()
