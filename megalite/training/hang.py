"""Hang reports: what each surviving rank was doing when a peer stalled, and the diagnosis.

When a collective or a pipeline wait times out (--distributed-timeout-minutes) or its peer
goes away, every rank that notices (on NCCL: once its watchdog aborts the communicators, see
`prepare_nccl`) writes `hang-rank<N>.json` into the run's directory
(--hang-report-dir, else beside --metrics-file, else --save) before it exits:

  {"rank": 4, "world_size": 8, "sizes": [["tp", 2], ["dp", 2], ["pp", 2]], "order": "tp-dp-pp",
   "schedule": {"name": "1f1b", "pp": 2, "vpp": 1, "microbatches": 4},
   "iteration": 2, "phase": "schedule",            # or optimizer, logging, evaluation, checkpoint
   "action": {"index": 6, "kind": "F", "chunk": 0, "mb": 2, "peer": null},
   "entered": {"tp": [37, "all_reduce"], "pp": [3, "all_reduce"], ...},
   "error": "...", "time": 1700000000.0}

`action` is the last one the executor started (its `observe` hook); `entered` is the ledger's
count of collectives entered per group kind and the last one's name (ledger.CommLedger.enter),
which the members of a group can compare. A rank that is stopped or dead writes nothing.

`diagnose(DIR)` (tools/diagnose_hang.py, megalite-diagnose-hang) merges the reports and replays
them against the schedule the ranks run (`schedules.get_schedule`, with the verifier's rule
that the k-th send from one rank to another meets the other's k-th receive from it) to name
the rank everyone waits on and the action it never finished.

On NCCL the host runs ahead of the device, so `entered` says what was queued, not what the
device reached: `prepare_nccl` turns on torch's NCCL flight recorder
(TORCH_NCCL_TRACE_BUFFER_SIZE), which dumps each rank's recent collectives on a timeout into
the same directory (`nccl-trace-rank<N>`, read with torch's `torchfrtrace`); a report also
carries the recorder's last entries (`flight_recorder`) wherever torch keeps them (gloo too,
with TORCH_FR_BUFFER_SIZE set).
"""

import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from megalite.errors import MegaliteError

PATTERN = "hang-rank{:05d}.json"
PHASES = {"schedule": 0, "optimizer": 1, "logging": 2, "evaluation": 3, "checkpoint": 4}
COMPUTE_KINDS = ("F", "B", "I", "W")


def report_dir(cfg) -> Path | None:
    """--hang-report-dir, else the metrics file's directory, else --save (None: no reports)."""
    log = cfg.logging
    if log.hang_report_dir:
        return Path(log.hang_report_dir)
    if log.metrics_file:
        return Path(os.path.abspath(log.metrics_file)).parent
    return Path(cfg.checkpoint.save) if cfg.checkpoint.save else None


# NCCL's watchdog, on a collective past the process group's timeout, by default kills the
# process (TORCH_NCCL_ASYNC_ERROR_HANDLING=3): no hang report, no one-line error, since the host
# thread never sees an exception (`wait()` on NCCL only orders the streams). 2 (CleanUpOnly)
# aborts the communicators instead and lets the host thread raise: the stuck host sync returns
# once the aborted kernels exit, and the next collective or wait fails with the timeout, which
# the trainer turns into its report and message. TORCH_NCCL_BLOCKING_WAIT=1 (every wait a host
# wait, raising at the timeout) is the stronger, slower form, left to the user for debugging.
NCCL_ERROR_HANDLING = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def prepare_nccl(cfg, cuda: bool | None = None, env=None) -> dict:
    """On CUDA (the NCCL backend), before the process group exists: a stalled collective
    raises in the host thread (NCCL_ERROR_HANDLING), and torch's flight recorder keeps recent
    NCCL collectives and dumps them on a timeout into the report directory. A user's own
    settings win. Returns the variables in effect; nothing on gloo (whose waits raise)."""
    import torch

    env = os.environ if env is None else env
    if not (torch.cuda.is_available() if cuda is None else cuda):
        return {}
    wanted = dict(NCCL_ERROR_HANDLING)
    directory = report_dir(cfg)
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        wanted["TORCH_NCCL_TRACE_BUFFER_SIZE"] = "2000"  # read into the reports too
        wanted["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
        wanted["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = str(directory / "nccl-trace-rank")
    for k, v in wanted.items():
        env.setdefault(k, v)
    return {k: env[k] for k in wanted}


class HangRecorder:
    """The trainer's note of where this rank is (`at`, `observe`: plain assignments, cheap
    enough for every action) and the report it writes when a peer is lost (`write`)."""

    def __init__(self, cfg, shape, groups, microbatches: int):
        self.dir, self.groups = report_dir(cfg), groups
        self.meta = {
            "rank": groups.rank,
            "world_size": groups.topo.world_size,
            "sizes": [[a, n] for a, n in groups.topo.sizes.items()],
            "order": groups.topo.order,
            "schedule": {"name": shape.schedule, "pp": shape.pp, "vpp": shape.vpp,
                         "microbatches": microbatches},
        }  # fmt: skip
        self.iteration, self.phase, self.position = 0, "setup", None

    def at(self, iteration: int, phase: str):
        self.iteration, self.phase = iteration, phase
        if phase == "schedule":
            self.position = None

    def schedule_runs(self, microbatches: int):
        """The step's schedule runs `microbatches` (the report replays that schedule)."""
        self.meta["schedule"]["microbatches"] = microbatches

    def observe(self, index: int, action):  # the executor's hook, before each action
        self.position = (index, action)

    @staticmethod
    def flight_recorder(last: int = 32) -> list | None:
        """The last entries of torch's flight recorder (NCCL, or gloo with TORCH_FR_BUFFER_SIZE
        set), as {name, group, sequence number, state}; None where torch records none."""
        try:
            import torch._C._distributed_c10d as c10d

            dump = getattr(c10d, "_dump_nccl_trace_json", None) or c10d._dump_fr_trace_json
            entries = json.loads(dump()).get("entries") or []
        except Exception:  # an older torch, or nothing recorded: the report stands without it
            return None
        keys = ("profiling_name", "process_group", "collective_seq_id", "p2p_seq_id", "state")
        return [{k: e.get(k) for k in keys} for e in entries[-last:]] or None

    def record(self, error: str) -> dict:
        action = None
        if self.position is not None:
            i, a = self.position
            action = {"index": i, "kind": str(a.kind), "chunk": a.chunk, "mb": a.mb,
                      "peer": a.peer}  # fmt: skip
        return {**self.meta, "iteration": self.iteration, "phase": self.phase, "action": action,
                "entered": dict(self.groups.ledger.entered), "error": error,
                "time": time.time(), "flight_recorder": self.flight_recorder()}  # fmt: skip

    def write(self, error: str) -> Path | None:
        """Write this rank's report; its path, or None without a directory or on failure (a
        report must never hide the error it reports)."""
        if self.dir is None:
            return None
        path = self.dir / PATTERN.format(self.groups.rank)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(self.record(error), indent=1))
            os.replace(tmp, path)
        except OSError:
            return None
        return path

    @contextmanager
    def reporting(self):
        """A collective or p2p wait in the block that timed out or lost its peer: this rank
        writes its report and stops with one line saying so (other errors pass through)."""
        try:
            yield
        except (RuntimeError, MegaliteError) as e:
            cause = e.__cause__ if isinstance(e, MegaliteError) else e
            if not isinstance(cause, RuntimeError) or not lost_peer(cause):
                raise
            message = str(e) if isinstance(e, MegaliteError) else self.collective_failure(e)
            path = self.write(message)
            if path is not None:
                message += (f"; hang report {path}: once every rank has stopped, "
                            f"tools/diagnose_hang.py {path.parent} names the rank the others "
                            "waited on")  # fmt: skip
            raise MegaliteError(message, every_rank=True) from e

    def collective_failure(self, e: Exception) -> str:
        g = self.groups
        where = g.topo.label(g.rank, skip=("pp",))
        reason = (str(e).strip().splitlines() or ["no reason given"])[0][-160:]
        return (
            f"rank {g.rank} ({where}, pipeline stage {g.pp.rank}) gave up in a collective "
            f"of iteration {self.iteration}: another rank died or stalled ({reason}); see its "
            "log, or raise --distributed-timeout-minutes if it was only slow"
        )


def lost_peer(e: RuntimeError) -> bool:
    """A collective that timed out or whose peer went away (gloo and NCCL wordings)."""
    import torch

    if isinstance(e, torch.distributed.DistError):
        return True
    text = str(e)
    return any(k in text for k in ("Timed out", "timed out", "Connection closed", "pair closure",
                                   "Connection reset", "Broken pipe"))  # fmt: skip


# ---- the diagnosis ------------------------------------------------------------------------------


def load_reports(directory) -> dict[int, dict]:
    d = Path(directory)
    if not d.is_dir():
        raise MegaliteError(
            f"{d} is not a directory; pass the run directory holding hang-rank*.json"
        )
    reports = {}
    for p in sorted(d.glob("hang-rank*.json")):
        try:
            r = json.loads(p.read_text())
            reports[int(r["rank"])] = r
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise MegaliteError(f"{p} is not a hang report ({e}); remove it") from None
    if not reports:
        raise MegaliteError(
            f"{d} holds no hang-rank*.json; pass the directory of --hang-report-dir, the "
            "metrics file or --save of the run that hung"
        )
    return reports


def _key(iteration, phase, index=None):
    """Progress, comparable: (iteration, phase, action index)."""
    return (iteration, PHASES.get(phase, 9), index if index is not None else 1 << 30)


def _where(r: dict) -> tuple:
    a = r.get("action") if r["phase"] == "schedule" else None
    return _key(r["iteration"], r["phase"], a and a["index"])


def _act(a) -> str:
    kind = a["kind"] if isinstance(a, dict) else str(a.kind)
    chunk, mb = (a["chunk"], a["mb"]) if isinstance(a, dict) else (a.chunk, a.mb)
    return f"{kind} of chunk {chunk}, micro-batch {mb}"


def _send_index(tables, src: int, dst: int, n: int) -> int | None:
    """Index in stage src's table of its n-th send (0-based) to stage dst."""
    sends = [
        i for i, a in enumerate(tables[src]) if str(a.kind).startswith("SEND") and a.peer == dst
    ]
    return sends[n] if n < len(sends) else None


def _batch_start(table, i: int) -> int:
    """The first action of the run of send/recv actions holding action i (posted together)."""
    comm = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
    while i > 0 and str(table[i - 1].kind) in comm:
        i -= 1
    return i


def _bounds(x: int, topo, reports: dict, tables) -> list[tuple]:
    """(progress bound, reason) for rank x from its peers' reports: where x must still be."""
    from megalite.pipeline.actions import WAITS

    cx, out = topo.coords(x), []
    for rank, r in sorted(reports.items()):
        c = topo.coords(rank)
        differ = [a for a in c if c[a] != cx[a]]
        a = r.get("action")
        if "pp" not in differ and "dp" not in differ and r["phase"] == "schedule" and a:
            if a["kind"] in COMPUTE_KINDS:  # same schedule; it waits inside a compute's collective
                kinds = [k for k in differ if k in r["entered"]]
                held = " and ".join(f"{k} collective #{r['entered'][k][0]} ({r['entered'][k][1]})"
                                    for k in kinds)  # fmt: skip
                out.append((_where(r), f"its {'/'.join(differ)} peer rank {rank} waits inside "
                            f"that action" + (f", in {held}" if held else "")))  # fmt: skip
        elif differ == ["pp"] and r["phase"] == "schedule" and a and a["kind"] in WAITS:
            s, table = c["pp"], tables[c["pp"]]
            recv = next(i for i, b in enumerate(table) if str(b.kind) == str(WAITS[a["kind"]])
                        and (b.chunk, b.mb) == (a["chunk"], a["mb"]))  # fmt: skip
            peer = table[recv].peer
            if peer != cx["pp"]:
                continue
            n = sum(1 for b in table[:recv] if str(b.kind).startswith("RECV") and b.peer == peer)
            j = _send_index(tables, peer, s, n)
            if j is not None:
                start = _batch_start(tables[peer], j)
                out.append((_key(r["iteration"], "schedule", start),
                            f"pipeline rank {rank} waits at its action {a['index']} ({a['kind']} "
                            f"of chunk {a['chunk']}, micro-batch {a['mb']}) for the tensor rank "
                            f"{x} sends at action {j}"))  # fmt: skip
        elif r["phase"] != "schedule":
            out.append((_key(r["iteration"], r["phase"]), f"rank {rank} waits in the {r['phase']}"))
    return out


def diagnose(directory) -> str:
    """One paragraph: the rank the others wait on and the action it never finished."""
    from megalite.parallel.topology import Topology
    from megalite.pipeline.schedules import get_schedule

    reports = load_reports(directory)
    any_report = next(iter(reports.values()))
    topo = Topology(any_report["order"], **dict(any_report["sizes"]))
    s = any_report["schedule"]
    tables = [
        get_schedule(s["name"], s["pp"], s["vpp"], s["microbatches"], r) for r in range(s["pp"])
    ]
    missing = [r for r in range(topo.world_size) if r not in reports]

    def name(rank):
        return f"rank {rank} ({topo.label(rank)})"

    tail = f" {len(reports)} of {topo.world_size} ranks wrote a report"
    tail += f"; no report from {', '.join(map(str, missing))}." if missing else "."
    if not missing:
        rank = min(
            reports,
            key=lambda q: (_where(reports[q]), sum(v[0] for v in reports[q]["entered"].values())),
        )
        r = reports[rank]
        at = (
            f"action {r['action']['index']} ({_act(r['action'])})"
            if r["phase"] == "schedule" and r["action"]
            else f"the {r['phase']}"
        )
        return (f"{name(rank)} is the rank the others wait on: it is furthest behind, at {at} of "
                f"iteration {r['iteration']}; its error: {r['error']}." + tail)  # fmt: skip
    found = []
    for x in missing:
        bounds = _bounds(x, topo, reports, tables)
        if bounds:
            found.append((min(b for b, _ in bounds), x, bounds))
    if not found:
        return (f"{name(missing[0])} wrote no report and no peer's report places it: it stalled or "
                "died before its peers noticed (see its log)." + tail)  # fmt: skip
    bound, x, bounds = min(found)
    it, phase, index = bound
    pp = topo.coords(x)["pp"]
    if phase == PHASES["schedule"] and index < len(tables[pp]):
        a = tables[pp][index]
        at = f"action {index} ({_act(a)}) of iteration {it}"
    else:
        at = f"the {next(k for k, v in PHASES.items() if v == phase)} of iteration {it}"
    why = "; ".join(reason for b, reason in sorted(bounds) if b == bound)
    return (f"{name(x)} is the rank the others wait on: it wrote no report (stopped or dead), "
            f"and its peers' reports place it at {at}, which it never finished: {why}." + tail)  # fmt: skip


def main(argv=None):
    import argparse

    p = argparse.ArgumentParser(
        prog="megalite-diagnose-hang",
        allow_abbrev=False,
        description="Name the rank a hung run waited on, from its hang-rank*.json reports.",
    )
    p.add_argument("dir", help="the directory holding hang-rank*.json")
    p.add_argument("--debug", action="store_true", help="full tracebacks")
    args = p.parse_args(argv)
    print(diagnose(args.dir))


def cli():
    from megalite.errors import run_main

    run_main(main, sys.argv[1:])
