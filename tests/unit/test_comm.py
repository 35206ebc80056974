"""The communication ledger (parallel/comm.py): a timeline is recorded into only inside
`recording`, which hands it back also when the block fails; `span` times a wait into it."""

import pytest

from megalite.parallel.ledger import CommLedger


class Timeline:  # what the ledger needs of training/timeline.py's Timeline
    def __init__(self):
        self.spans, self.now = [], 0.0
        self.clock = self

    def mark(self):
        self.now += 1.0
        return self.now

    def record(self, kind, start, end):
        self.spans.append((kind, start, end))


def test_a_ledger_records_only_while_recording():
    ledger, tl = CommLedger(), Timeline()
    with ledger.span("cp"):  # nothing to record into: a plain block
        pass
    with ledger.recording(tl):
        assert ledger.timeline is tl
        with ledger.span("cp"):
            pass
    assert ledger.timeline is None and tl.spans == [("cp", 1.0, 2.0)]
    with pytest.raises(ZeroDivisionError), ledger.recording(tl):
        raise ZeroDivisionError
    assert ledger.timeline is None
    with ledger.recording(None), ledger.span("cp"):  # an unprofiled step records nothing
        pass
    assert len(tl.spans) == 1
    with pytest.raises(AttributeError):
        ledger.timeline = tl  # only `recording` lends it
