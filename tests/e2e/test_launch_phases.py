"""The launch's phases (training/launch_phases.py) in a real run's console and metrics file."""

import pytest

from tests.e2e.conftest import TINY, pretrain

PHASES = ["rendezvous", "groups", "data index", "model build", "resume", "first step"]


@pytest.mark.slow
def test_console_and_first_metrics_row_carry_the_launch_phases(tiny_data, tmp_path):
    prefix, model = tiny_data
    args = [*TINY, "--data-path", prefix, "--tokenizer-model", model, "--train-iters", "1"]
    rows, r = pretrain(1, args, tmp_path)
    lines = r.stdout.splitlines()
    # the first two lines: the rendezvous and the groups, as they end
    assert [x.split(" ")[1] for x in lines[:2]] == ["rendezvous", "groups"], lines[:3]
    printed = [x.removeprefix("launch: ").rsplit(" ", 2)[0] for x in lines if x.endswith(" s")]
    assert [p for p in PHASES if p in printed] == PHASES, lines
    launch = rows[0]["launch"]  # the first row: slowest and fastest rank per phase
    assert list(launch) == [*PHASES, "total"] and launch["total"]["max"] > 0, launch
    assert "to the first step on the slowest rank" in r.stdout
