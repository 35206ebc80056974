"""Helpers shared by the benchmarks: the machine line, the one timer (`timed`), the one reader
of resident memory (`memory`, `measured_run`), TCP byte counters, the summary file.

Every benchmark prints its own tables; with `--summary PATH` it also writes its headline
figures as JSON (`write_summary`), which `bench/run_all.py` collects into one table.
"""

import json
import os
import platform
import resource
import socket
import struct
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

# struct tcp_info (linux/tcp.h): tcpi_bytes_received at byte 128, tcpi_bytes_sent at byte 200
# (Linux >= 4.19). Both count TCP payload, headers excluded; bytes_sent includes retransmits.
_TCP_INFO_LEN = 256
_BYTES_RECEIVED, _BYTES_SENT = 128, 200


def machine() -> str:
    """One line: the processor, cores, load average, torch version."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(
                (line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")),
                cpu,
            )
    except OSError:
        pass
    try:
        load = "load average " + ", ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        load = "load average unknown"
    gpu = "no GPU" if not torch.cuda.is_available() else torch.cuda.get_device_name()
    return f"{cpu}, {os.cpu_count()} cores, {gpu}, {load}; torch {torch.__version__}"


def sync(device=None):
    """Wait until the device has run what was queued (CUDA); nothing on the CPU. (torch is
    imported only when a device is named: a timed block must not pay for, or hold, its import.)"""
    if device is None:
        return
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Timing:
    wall: float = 0.0  # seconds
    cpu: float = 0.0  # this process's CPU seconds


@contextmanager
def timed(device=None, barrier=None):
    """`with timed(device) as t: ...`, then `t.wall` and `t.cpu`: the block's wall seconds and
    this process's CPU seconds (all threads, user and system). With a CUDA `device` its queue is
    drained on entering and on leaving, so the time is the device's work too; `barrier` (e.g.
    torch.distributed.barrier) is called before the clock starts, so that the ranks start
    together."""
    t = Timing()
    if barrier is not None:
        barrier()
    sync(device)
    wall, cpu = time.perf_counter(), time.process_time()
    yield t
    sync(device)
    t.wall, t.cpu = time.perf_counter() - wall, time.process_time() - cpu


def seconds(fn, device=None, barrier=None) -> float:
    """The wall seconds of `fn()`, as `timed` measures them."""
    with timed(device, barrier) as t:
        fn()
    return t.wall


def memory(pid="self") -> dict[str, int]:
    """The memory lines of /proc/PID/status in bytes: VmRSS (resident), VmHWM (its peak, see
    `reset_peak`), RssAnon (the anonymous part: no mapped file's pages), ..."""
    out = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if value.strip().endswith(" kB"):
                out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak():
    """Set this process's VmHWM to its current VmRSS: the peak from here on (Linux clear_refs)."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants now, from /proc's children lists."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    todo += [int(c) for c in fh.read().split()]
        except OSError:
            pass
    return out


def measured_run(cmd: list, cwd=None, env=None, every: float = 0.05) -> dict:
    """Run `cmd`: its wall seconds, CPU seconds (the process tree's, reaped children included)
    and the peaks of the tree's summed VmRSS and RssAnon (sampled every `every` seconds), as
    {"wall_s", "cpu_s", "peak_rss", "peak_anon"}. A failed run: SystemExit with its stderr."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [str(c) for c in cmd], cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    peak, done = [0, 0], threading.Event()

    def sample():
        while not done.wait(every):
            rss = anon = 0
            for p in process_tree(proc.pid):
                try:
                    m = memory(p)
                except (OSError, ValueError):
                    continue
                rss, anon = rss + m.get("VmRSS", 0), anon + m.get("RssAnon", 0)
            peak[0], peak[1] = max(peak[0], rss), max(peak[1], anon)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    err = proc.stderr.read().decode(errors="replace")
    proc.wait()
    wall = time.perf_counter() - t0
    done.set()
    sampler.join()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed:\n{err[-3000:]}")
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return {"wall_s": wall, "cpu_s": cpu, "peak_rss": peak[0], "peak_anon": peak[1]}


def tcp_bytes() -> tuple[int, int]:
    """(bytes sent, bytes received) so far over this process's TCP sockets (gloo's connections:
    with a file:// rendezvous they are the only ones), read from the kernel's per-socket
    counters (TCP_INFO). The difference around a step is its traffic on the wire, per rank."""
    sent = received = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.fromfd(int(fd), socket.AF_INET, socket.SOCK_STREAM)  # a duplicate fd
        except OSError:
            continue
        try:
            if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
            if len(info) >= _BYTES_SENT + 8:
                received += struct.unpack_from("Q", info, _BYTES_RECEIVED)[0]
                sent += struct.unpack_from("Q", info, _BYTES_SENT)[0]
        except OSError:
            pass
        finally:
            s.close()
    return sent, received


def figure(what: str, value, unit: str = "x", target: str | None = None, met=None,
           how: str = "") -> dict:  # fmt: skip
    """One headline figure for the summary: `met` True/False/None (no target)."""
    return {"what": what, "value": value, "unit": unit, "target": target, "met": met, "how": how}


def write_summary(path: str | None, bench: str, figures: list[dict], command: str = ""):
    """Write the headline figures of one benchmark run as JSON (for bench/run_all.py)."""
    if not path:
        return
    with open(path, "w") as fh:
        json.dump({"bench": bench, "machine": machine(), "command": command,
                   "figures": figures}, fh, indent=1)  # fmt: skip
