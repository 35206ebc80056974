"""bench/gpu_check.sh's pieces, which only a lent GPU runs for real: each judgement tested here
with planted numbers, each Python script's CLI run on CPU (a smoke mode) or at least parsed."""

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _bench(name):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    "counts, ok",
    [([1, 1, 1], True), ([0, 1, 0], True), ([1, 3, 1], False), ([3, 3, 3], False), ([], False)],
)
def test_syncs_fails_above_one_sync_per_non_logging_step(counts, ok):
    check = _bench("gpu_trainer_check")
    assert check.SYNCS_PER_STEP == 1
    assert check.syncs_ok(counts) is ok
