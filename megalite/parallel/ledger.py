"""The communication ledger: bytes, calls and seconds per group kind, as comm.py's collectives
and p2p.py's exchanges record them, and the clock that times them (host time on CPU, CUDA
events on the device)."""

import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class CommLedger:
    """Bytes, calls and seconds per group kind ("tp", "pp", "dp", ...) since the last reset.

    Seconds are those the caller's stream spent in a collective (or blocked in a p2p wait): on
    CPU tensors host time; on CUDA tensors the time between two CUDA events on the current
    stream around the call, since NCCL returns before the device has done anything (host time
    would be the enqueue, ~0). The events are read when the ledger is (`snapshot`, a logging
    step, one host sync). An asynchronous collective counts only its launch: its time shows in
    the wait that needs it.

    `entered` is kept apart and never reset: per group kind, how many collectives this rank has
    entered since the start and the last one's name. It is bumped before the collective can
    block, so a rank stuck in one names it, and the members of a group can be compared by
    sequence number (a hang report: megalite/training/hang.py).

    While a profiled schedule runs (`with ledger.recording(timeline):`, the executor), waits
    inside a layer (context parallelism's ring hops, `with ledger.span("cp"):`) are recorded
    into that timeline: anything with a `clock` (`mark()`) and `record(kind, start, end)`."""

    bytes: dict = field(default_factory=lambda: defaultdict(int))
    calls: dict = field(default_factory=lambda: defaultdict(int))
    seconds: dict = field(default_factory=lambda: defaultdict(float))
    entered: dict = field(default_factory=dict)  # kind -> [sequence number, op name]
    _spans: list = field(default_factory=list, init=False, repr=False)  # (kind, start, end) events
    _timeline: object = field(default=None, init=False, repr=False)

    @property
    def timeline(self):
        """The timeline being recorded into, or None (outside `recording`)."""
        return self._timeline

    @contextmanager
    def recording(self, timeline):
        """Record spans into `timeline` (None: record nothing) until the block ends, also when
        it fails: a later, unprofiled step must not record into this step's timeline."""
        outer, self._timeline = self._timeline, timeline
        try:
            yield timeline
        finally:
            self._timeline = outer

    @contextmanager
    def span(self, kind: str):
        """Time the block as a `kind` span of the timeline being recorded, if any."""
        timeline = self._timeline
        if timeline is None:
            yield
            return
        t0 = timeline.clock.mark()
        yield
        timeline.record(kind, t0, timeline.clock.mark())

    def enter(self, kind: str, op: str):
        seq = self.entered.get(kind, (0, None))[0] + 1
        self.entered[kind] = [seq, op]

    def add(self, kind: str, nbytes: float, seconds: float = 0.0):
        self.bytes[kind] += int(nbytes)
        self.calls[kind] += 1
        self.seconds[kind] += seconds

    def add_span(self, kind: str, start):
        """Add the seconds since `start` (from `clock_start`: a host time, or a CUDA event)."""
        if isinstance(start, float):
            self.seconds[kind] += time.perf_counter() - start
            return
        end = _device_event()
        end.record()
        self._spans.append((kind, start, end))
        if len(self._spans) > 4096:  # never logged for a while: fold in what has completed
            self._settle(block=False)

    def _settle(self, block: bool = True):
        """Fold the event spans into `seconds` (`block`: waiting for them; else those done)."""
        pending = []
        for kind, start, end in self._spans:
            if block:
                end.synchronize()
            if block or end.query():
                self.seconds[kind] += start.elapsed_time(end) / 1e3
            else:
                pending.append((kind, start, end))
        self._spans = pending

    def reset(self):
        self.bytes.clear()
        self.calls.clear()
        self.seconds.clear()
        self._spans = []

    def snapshot(self) -> dict:
        self._settle()
        return {
            k: {
                "bytes": self.bytes[k],
                "calls": self.calls[k],
                "seconds": round(self.seconds[k], 6),
            }
            for k in sorted(self.bytes)
        }


def _device_event():
    return torch.cuda.Event(enable_timing=True)


def clock_start(t: torch.Tensor | None = None):
    """The start of a span the ledger times (`CommLedger.add_span`): with a CUDA tensor an
    event recorded on the current stream, else the host clock."""
    if t is not None and t.device.type == "cuda" and torch.cuda.is_available():  # (not fake)
        event = _device_event()
        event.record()
        return event
    return time.perf_counter()
