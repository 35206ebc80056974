"""`make bench`: every benchmark in bench/ at small settings, one summary table.

    .venv/bin/python bench/run_all.py [--only NAME ...] [--logs DIR] [--timeout 600]

Each script runs in its own process with the small shapes of bench/_quick.py (QUICK, the
table; this file is the runner), so the whole set finishes in under 15 minutes on a 2-core CPU
(12.6 min for 16 runs at load average 8-12 on the development machine, docs/benchmarks.md);
each script keeps its full-size defaults for whoever has the time (`python
bench/<subject>/<name>.py`, the commands in bench/README.md and on the docs/bench_*.md pages).
Names are paths under bench/.
The figures printed here come from those small shapes on whatever load the machine has: they
show that every benchmark runs and roughly where it stands, not the documented figures.

Not run here, because they need a GPU: bench/gpu_check.sh (its syntax is checked with bash -n)
and bench/gpu/kernels.py (only its --dry-run, which lists the cases).
bench/gpu/gpu_trainer_check.py, which gpu_check.sh runs on a GPU, runs here on CPU;
bench/gpu/gpu_large_check.py kernels in its --smoke mode (its memory check needs a run's metrics: tests/unit/test_gpu_check.py).

Exits non-zero when any benchmark fails, times out, or a script in bench/ has no entry in
QUICK or HELPERS (add one: a benchmark nobody runs rots).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))

from bench._common import timed  # noqa: E402
from bench._quick import HELPERS, QUICK, SUMMARY, TIMEOUTS  # noqa: E402


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
    with timed() as t, open(log, "w") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = "timeout"
    figures = json.loads(summary.read_text()).get("figures", []) if summary.exists() else []
    return {"name": name, "rc": rc, "seconds": t.wall, "log": str(log),
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
