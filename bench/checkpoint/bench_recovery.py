"""Recovery from a lost node, local tier against persistent, and what local saves cost a step.

    .venv/bin/python bench/checkpoint/bench_recovery.py [--iters 12] [--kill-after 7] [--layers 2]
        [--hidden 64] [--overhead-iters 30] [--overhead-hidden 256] [--overhead-layers 4]
        [--overhead-only] [--summary PATH]

Two torchrun agents on 127.0.0.1 play two nodes of 4 CPU ranks each (tp2, dp4), each with its
own --non-persistent-local-ckpt-dir, local saves every 2 steps replicated to the other node
(--replication-factor 2 --replication-jump 4), persistent saves every 4 (--save, shared).

1. an uninterrupted run of --iters steps: the reference losses;
2. the same run, node 1 killed (SIGKILL to its agent and workers) once iteration --kill-after
   is logged and the replicas of the local save before it are on node 0; node 1's local
   directory deleted. Detect: kill -> node 0's agent has exited (its ranks saw the peer go);
3. restarts from that state (each from its own copy of the directories):
   - local, 8 ranks: both agents again; node 1's shards come from node 0's replicas;
   - local, 4 ranks: node 0 alone continues at the smaller world (dp 4 -> 2);
   - persistent, 8 ranks: the local directories emptied, so --save's checkpoint is taken.
   Each restart is timed by phase, from the launch to its first step (`_phases`): start
   (processes up to the rendezvous), rendezvous, groups, build (data index, model build),
   locate + agree, fetch, load (resume minus fetch), first step; and its losses are compared
   with the reference's (max relative difference);
4. the local saves' cost on the step (`overhead`; --overhead-only runs just this): a wider
   model, --overhead-iters steps with no local save, one every step and one every 5, 8 ranks,
   twice in turn: the mean step time of each (best round), and per save the step's own wait
   (the copy to host) and the background's time (write, sha256, copy to the peer).

Absolute seconds depend on the machine (2 cores for 8 ranks here); the ratios and the phase
split are the figures of docs/reliability.md.
"""

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench._common import figure, machine, write_summary  # noqa: E402


def _data(tmp: Path) -> tuple[str, str]:
    import sysconfig

    text = tmp / "text"
    text.mkdir()
    lib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("json/encoder.py", "json/decoder.py", "textwrap.py", "heapq.py", "copy.py"):
        (text / name.replace("/", "_")).write_text((lib / name).read_text())
    subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", str(text),
                    "--output-prefix", str(tmp / "tiny"), "--train-tokenizer", "--vocab-size",
                    "512", "--workers", "1", "--quiet"], cwd=ROOT, check=True)  # fmt: skip
    return str(tmp / "tiny"), str(tmp / "tiny.model")


class Job:
    """One agent per node, each started in a session of its own (a node)."""

    def __init__(self, nodes: int, args: list[str], metrics: Path, port: int, elastic=False):
        self.procs = []
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for n in range(nodes):
            where = ["--nnodes", str(nodes), "--node_rank", str(n), "--master_addr", "127.0.0.1",
                     "--master_port", str(port)]  # fmt: skip
            if elastic:  # --nnodes 1:2; node 0's agent hosts the rendezvous store (started first)
                where = ["--nnodes", f"1:{nodes}", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                         f"127.0.0.1:{port}", "--rdzv-id", "bench", "--max-restarts", "3",
                         "--rdzv-conf", "last_call_timeout=5"]  # fmt: skip
            cmd = [sys.executable, "-m", "torch.distributed.run", *where, "--nproc_per_node", "4",
                   "pretrain_gpt.py", *args(n), "--metrics-file", str(metrics)]  # fmt: skip
            log = open(f"{metrics}.node{n}.log", "w")
            self.procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                               env=env, start_new_session=True))  # fmt: skip
            if elastic and n == 0:
                time.sleep(3)
        self.started = time.monotonic()

    def wait(self, timeout=900) -> list[int]:
        return [p.wait(timeout=timeout) for p in self.procs]

    def kill_node(self, n: int):
        p = self.procs[n]
        workers = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True)
        os.killpg(p.pid, signal.SIGKILL)
        for pid in map(int, workers.stdout.split()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _rows(metrics: Path) -> list[dict]:
    return [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []


def _restart_line(metrics: Path) -> str:
    log = Path(f"{metrics}.node0.log").read_text()
    return next((x for x in log.splitlines() if "restart from" in x), "(no restart line)")


def _phases(launch: dict, to_first: float, fetch: float) -> dict:
    """A restart's phases from its launch summary (the slowest rank's seconds): start (the
    processes up to the rendezvous: to_first less the launch's total), rendezvous, groups,
    build (data index and model build), locate, fetch, load (resume less fetch), first step."""
    at = {k: v["max"] for k, v in launch.items()}
    return {"start": to_first - at["total"], "rendezvous": at["rendezvous"], "groups": at["groups"],
            "build": at.get("data index", 0) + at.get("model build", 0),
            "locate": at.get("locate", 0), "fetch": fetch, "load": at["resume"] - fetch,
            "first step": at["first step"]}  # fmt: skip


def overhead(a, base, tiers, port) -> list:
    """The local saves' cost: --overhead-iters steps of a wider model (--overhead-hidden,
    --overhead-layers) with no local save, one every step and one every 5, in turn, twice: the
    mean step time of each (best round), and from rank 0's log the step's own wait per save (the
    copy to host) and the background's time per save (write, sha256, replication)."""
    wide = [*base, "--hidden-size", str(a.overhead_hidden), "--num-layers", str(a.overhead_layers),
            "--train-iters", str(a.overhead_iters)]  # fmt: skip
    steps, waits, background = {}, {}, {}
    for rnd in range(2):
        for every in (0, 1, 5):
            metrics = a.tmp / f"overhead-{every}-{rnd}.jsonl"
            port += 2
            args = tiers(a.tmp / f"overhead-{every}-{rnd}", every)

            def wider(n, args=args):
                return [*args(n), *wide]

            assert Job(2, wider, metrics, port).wait() == [0, 0]
            steps.setdefault(every, []).append(
                statistics.mean(r["step_time_s"] for r in _rows(metrics)[3:])
            )
            log = Path(f"{metrics}.node0.log").read_text()
            for line in log.splitlines():
                if line.startswith("local checkpoint of iteration"):
                    background.setdefault(every, []).append(
                        float(line.split(" in ")[1].split(" s")[0])
                    )
                    waits.setdefault(every, []).append(
                        float(line.split("waited ")[1].split(" s")[0])
                    )
    base_s = min(steps[0])
    print(f"\nmean step time, 8 ranks, h{a.overhead_hidden} x {a.overhead_layers} layers, best of 2 "
          f"rounds: {base_s * 1e3:.1f} ms without local saves")  # fmt: skip
    figures = []
    for every in (1, 5):
        s = min(steps[every])
        w, b = statistics.mean(waits[every]), statistics.mean(background[every])
        print(f"  a local save every {every} step(s): {s * 1e3:.1f} ms per step, ratio "
              f"{s / base_s:.3f}; per save the step waited {w * 1e3:.2f} ms ({w / base_s:.1%} "
              f"of a step), the background took {b * 1e3:.0f} ms")  # fmt: skip
        figures.append(figure(f"step time with a local save every {every}", round(s / base_s, 3)))
        figures.append(figure(f"step's own wait per local save (every {every})",
                              round(w / base_s, 4)))  # fmt: skip
    return figures


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--kill-after", type=int, default=7)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--overhead-iters", type=int, default=30, help="0: skip the overhead runs")
    ap.add_argument("--overhead-hidden", type=int, default=256)
    ap.add_argument("--overhead-layers", type=int, default=4)
    ap.add_argument("--overhead-only", action="store_true")
    ap.add_argument("--port", type=int, default=29613)
    ap.add_argument("--summary", default=None)
    a = ap.parse_args()
    print(machine())
    tmp = a.tmp = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    prefix, model = _data(tmp)
    base = ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads",
            "4", "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "16",
            "--lr", "3e-3", "--lr-warmup-iters", "2", "--eval-interval", "0", "--log-interval",
            "1", "--wandb-mode", "disabled", "--data-path", prefix, "--tokenizer-model", model,
            "--tp", "2", "--train-iters", str(a.iters), "--distributed-timeout-minutes", "0.5"]  # fmt: skip

    def tiers(run: Path, local_every=2):
        def args(n):
            return [*base, "--save", str(run / "ckpt"), "--save-interval", "4",
                    "--non-persistent-save-interval", str(local_every),
                    "--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir",
                    str(run / f"node{n}"), "--replication", "--replication-factor", "2",
                    "--replication-jump", "4"]  # fmt: skip

        return args

    port = a.port
    if a.overhead_only:
        write_summary(
            a.summary, "bench_recovery", overhead(a, base, tiers, port), " ".join(sys.argv)
        )
        return
    ref = tmp / "ref.jsonl"
    assert Job(2, tiers(tmp / "ref"), ref, port).wait() == [0, 0]
    want = {r["iteration"]: r["loss"] for r in _rows(ref)}

    def crash(run, m, port, elastic=False):
        """Start the job, kill node 1 once it is due; (the job, its iteration, the local
        iteration to resume, the kill's time)."""
        job = Job(2, tiers(run), m, port, elastic)
        local_it = (a.kill_after - 1) // 2 * 2
        replicas = [run / "node0" / f"rank{r:05d}" / f"replica-{r + 4:05d}" /
                    f"iter_{local_it:07d}" / "part.json" for r in range(4)]  # fmt: skip
        while not (any(r["iteration"] >= a.kill_after for r in _rows(m))
                   and all(p.is_file() for p in replicas)):  # fmt: skip
            assert all(p.poll() is None for p in job.procs), "the job ended before the kill"
            time.sleep(0.05)
        killed_at = max(r["iteration"] for r in _rows(m))
        t_kill = time.monotonic()
        job.kill_node(1)
        shutil.rmtree(run / "node1")
        return job, killed_at, local_it, t_kill

    crashed, m = tmp / "crash", tmp / "crash.jsonl"
    job, killed_at, local_it, t_kill = crash(crashed, m, port + 1)
    job.procs[0].wait(timeout=300)
    detect = time.monotonic() - t_kill
    persistent_it = int((crashed / "ckpt" / "latest").read_text().split("_")[1])
    print(f"node 1 killed after iteration {killed_at} (local save {local_it}, persistent "
          f"{persistent_it}); node 0's agent exited {detect:.2f} s later")  # fmt: skip

    results = {}
    for name, nodes, empty in [("local, 8 ranks", 2, False), ("local, 4 ranks (node 0 only)", 1, False),
                               ("persistent, 8 ranks", 2, True)]:  # fmt: skip
        run = tmp / name.split(",")[0] / str(nodes)
        shutil.copytree(crashed, run, symlinks=True)
        for n in (0, 1):
            if empty:
                shutil.rmtree(run / f"node{n}", ignore_errors=True)
        metrics = tmp / f"{name.split(',')[0]}-{nodes}.jsonl"
        port += 2
        job = Job(nodes, tiers(run), metrics, port)
        while not _rows(metrics):
            assert all(p.poll() in (None, 0) for p in job.procs), Path(
                f"{metrics}.node0.log"
            ).read_text()[-3000:]
            time.sleep(0.02)
        to_first = time.monotonic() - job.started
        assert job.wait() == [0] * nodes
        rows = _rows(metrics)
        line = _restart_line(metrics)
        launch = rows[0]["launch"]
        fetch = float(line.split("fetched in ")[1].split(" s")[0]) if "fetched in" in line else 0.0
        phases = {"detect": detect, **_phases(launch, to_first, fetch)}
        resumed = rows[0]["iteration"] - 1
        diff = max(abs(r["loss"] - want[r["iteration"]]) / abs(want[r["iteration"]]) for r in rows)
        results[name] = (phases, resumed, diff, line)
        print(f"\n{name}: {line}")
        print(f"  resumed from {resumed} ({killed_at - resumed} steps redone), losses within "
              f"{diff:.1e} of the uninterrupted run")  # fmt: skip
        print("  " + ", ".join(f"{k} {v:.2f} s" for k, v in phases.items())
              + f"; kill -> first step {sum(phases.values()):.2f} s")  # fmt: skip

    # torchrun --nnodes 1:2: node 0's agent restarts its workers at 4 ranks by itself
    m = tmp / "elastic.jsonl"
    port += 2
    job, killed_at, local_it, t_kill = crash(tmp / "elastic", m, port, elastic=True)
    while not [r for r in _rows(m) if "launch" in r and r["iteration"] <= killed_at][1:]:
        assert job.procs[0].poll() is None, Path(f"{m}.node0.log").read_text()[-3000:]
        time.sleep(0.02)
    to_first = time.monotonic() - t_kill
    assert job.procs[0].wait(timeout=900) == 0
    rows = _rows(m)
    after = [i for i, r in enumerate(rows) if "launch" in r][1]
    launch, line = rows[after]["launch"], _restart_line(m)
    fetch = float(line.split("fetched in ")[1].split(" s")[0])
    phases = _phases(launch, to_first, fetch)  # to_first counts from the kill here
    phases = {"detect + agent restart": phases.pop("start"), **phases}
    diff = max(
        abs(r["loss"] - want[r["iteration"]]) / abs(want[r["iteration"]]) for r in rows[after:]
    )
    name = "elastic --nnodes 1:2, 4 ranks"
    results[name] = (phases, rows[after]["iteration"] - 1, diff, line)
    print(f"\n{name}: {line}")
    print(f"  resumed from {rows[after]['iteration'] - 1} ({killed_at + 1 - rows[after]['iteration']} steps "
          f"redone), losses within {diff:.1e} of the uninterrupted run")  # fmt: skip
    print("  " + ", ".join(f"{k} {v:.2f} s" for k, v in phases.items())
          + f"; kill -> first step {to_first:.2f} s")  # fmt: skip

    figures = overhead(a, base, tiers, port + 2) if a.overhead_iters else []
    for name, (phases, _, _, _) in results.items():
        figures.append(figure(f"kill -> first step, {name}", round(sum(phases.values()), 2), "s"))
    write_summary(a.summary, "bench_recovery", figures, " ".join(sys.argv))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
