"""training/preemption.py: the stop conditions, read from the flags summed over the world."""

import os
import signal
from types import SimpleNamespace

import pytest

from megalite.training.preemption import Preemption


def _training(duration=None, interval=None):
    return SimpleNamespace(exit_duration_in_mins=duration, exit_interval=interval)


def test_reasons_from_the_summed_flags():
    p = Preemption(_training(duration=5, interval=4), catch_signals=True)
    assert p.flags() == {"signal": 0.0, "time_up": 0.0}
    assert p.reason({"signal": 0.0, "time_up": 0.0}, 3) is None
    assert p.reason({"signal": 0.0, "time_up": 0.0}, 8) == "reached --exit-interval 4"
    assert p.reason({"signal": 0.0, "time_up": 2.0}, 3) == "trained for --exit-duration-in-mins 5"
    # another rank was signalled: this one stops too, naming no signal of its own
    assert p.reason({"signal": 1.0, "time_up": 2.0}, 8) == "received a signal on another rank"
    assert Preemption(_training(duration=0), False).flags()["time_up"] == 1.0


def test_sigterm_is_caught_then_a_second_ctrl_c_stops_at_once():
    p = Preemption(_training(), catch_signals=True)
    before = signal.getsignal(signal.SIGTERM)
    with p.catching():
        os.kill(os.getpid(), signal.SIGTERM)
        assert p.signalled and p.flags()["signal"] == 1.0
        assert p.reason(p.flags(), 1) == "received SIGTERM"
        os.kill(os.getpid(), signal.SIGINT)  # a first Ctrl-C after SIGTERM: still a stop flag
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is before
    off = Preemption(_training(), catch_signals=False)  # without --save: handlers untouched
    with off.catching():
        assert signal.getsignal(signal.SIGTERM) is before
