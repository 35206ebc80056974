"""The ledger's seconds on CUDA come from CUDA events around the call, not the host clock: NCCL
returns as soon as it has enqueued (issue 32, finding 6). Shown here with fake CUDA tensors and
a fake event class, the collective itself a stub."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from megalite.parallel import comm, ledger, p2p
from megalite.parallel.comm import Group
from megalite.parallel.ledger import CommLedger


class _Event:
    """A CUDA event stand-in on a made-up device clock."""

    now = 0.0
    made: list = []

    def __init__(self):
        self.at = None
        _Event.made.append(self)

    def record(self):
        self.at = _Event.now
        _Event.now += 0.25  # the device runs 250 ms between any two records

    def query(self):
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, end):  # milliseconds, as torch's
        return (end.at - self.at) * 1e3


def _fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ledger, "_device_event", _Event)
    _Event.made.clear()


def test_collectives_on_cuda_are_timed_by_events(monkeypatch):
    _fake_cuda(monkeypatch)
    monkeypatch.setattr(comm.dist, "all_reduce", lambda *a, **k: None)
    g = Group("tp", [0, 1], 0, pg=object(), ledger=CommLedger())
    with FakeTensorMode():
        t = torch.empty(4, device="cuda")
        assert t.device.type == "cuda"
        comm.all_reduce(t, g)
        comm.all_reduce(t, g)
    assert len(_Event.made) == 4  # a start and an end on the stream per call
    snap = g.ledger.snapshot()["tp"]
    assert snap["calls"] == 2 and snap["seconds"] == 0.5  # device time, not the host's ~0


def test_cpu_collectives_keep_the_host_clock(monkeypatch):
    monkeypatch.setattr(ledger, "_device_event", _Event)
    _Event.made.clear()
    monkeypatch.setattr(comm.dist, "all_reduce", lambda *a, **k: None)
    g = Group("tp", [0, 1], 0, pg=object(), ledger=CommLedger())
    comm.all_reduce(torch.zeros(4), g)
    assert not _Event.made and 0 <= g.ledger.snapshot()["tp"]["seconds"] < 1


def test_p2p_waits_on_cuda_are_timed_by_events(monkeypatch):
    _fake_cuda(monkeypatch)

    class Work:
        def wait(self):
            pass

    g = Group("pp", [0, 1], 0, pg=object(), ledger=CommLedger())
    with FakeTensorMode():
        batch = p2p.Batch([(False, torch.empty(2, device="cuda"), 1)], [Work()], g)
        host = batch.wait()
    assert host < 1 and len(_Event.made) == 2
    g.ledger.snapshot()  # reads the events (the bytes are post()'s, not made here)
    assert g.ledger.seconds["pp"] == 0.25
