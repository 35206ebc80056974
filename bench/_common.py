"""Helpers shared by the benchmarks: the machine line, TCP byte counters, the summary file.

Every benchmark prints its own tables; with `--summary PATH` it also writes its headline
figures as JSON (`write_summary`), which `bench/run_all.py` collects into one table.
"""

import json
import os
import platform
import socket
import struct

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
