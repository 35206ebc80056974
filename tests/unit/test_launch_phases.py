"""training/launch_phases.py: the launch's phases, timed and summed, on a world of one."""

import pytest
import torch

from megalite.parallel.groups import single_process_groups
from megalite.training.launch_phases import LaunchPhases, format_summary


def test_phases_are_timed_summed_and_summarised(capsys):
    launch = LaunchPhases(echo=True)
    with launch.phase("rendezvous"):
        pass
    launch.add("groups", 0.25)
    launch.add("groups", 0.25)  # a phase timed twice adds up
    launch.add("first step", 1.5)
    assert capsys.readouterr().out.splitlines()[0].startswith("launch: rendezvous ")
    s = launch.summary(single_process_groups().world)
    assert list(s) == ["rendezvous", "groups", "first step", "total"] and launch.reported
    assert s["groups"] == {"max": 0.5, "min": 0.5}
    assert s["total"]["max"] == pytest.approx(2.0 + launch.seconds["rendezvous"], abs=1e-3)
    assert "groups 0.50 s" in format_summary(s)
    with pytest.raises(ValueError, match="unknown launch phase"):
        with launch.phase("warm-up"):
            pass


def test_a_process_takes_one_thread_as_torchrun_gives_each(monkeypatch):
    """torchrun sets OMP_NUM_THREADS=1 for each of several processes; a world of one started
    without it (python pretrain_gpt.py) gets the same, printed; a user's OMP_NUM_THREADS wins."""
    from megalite.training.launch import set_threads

    before = torch.get_num_threads()
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(n))
    calls, env = [], {}
    line = set_threads(env)
    assert calls == [1] and env == {"OMP_NUM_THREADS": "1"}
    assert line.startswith("threads: 1 intra-op thread") and "OMP_NUM_THREADS" in line
    calls, env = [], {"OMP_NUM_THREADS": "3"}
    line = set_threads(env)
    assert calls == [] and env == {"OMP_NUM_THREADS": "3"} and "OMP_NUM_THREADS=3" in line
    assert torch.get_num_threads() == before
