"""bench/gpu_check.sh's pieces, which only a lent GPU runs for real: each judgement tested here
with planted numbers, each Python script's CLI run on CPU (a smoke mode) or at least parsed."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _bench(name):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / "gpu" / f"{name}.py")
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


def test_memory_verdict_on_planted_numbers():
    check = _bench("gpu_large_check")
    planned = {"params": 1000, "grads": 1000, "optimizer": 2000, "total": 10_000}
    measured = {"param_bytes": 1000, "grad_bytes": 1000, "optimizer_state_bytes": 2000,
                "peak_memory_bytes": 10_900}  # fmt: skip
    assert check.memory_verdict(planned, measured)["ok"]  # peak 9% over: within 10%
    assert not check.memory_verdict(planned, {**measured, "peak_memory_bytes": 11_100})["ok"]
    assert not check.memory_verdict(planned, {**measured, "grad_bytes": 1100})["ok"]
    assert not check.memory_verdict(planned, {})["ok"]  # nothing measured: no pass


def test_kernel_tolerances_judge():
    check = _bench("gpu_large_check")
    assert check.within({"loss": 1e-3, "grad": 1e-2})
    assert not check.within({"loss": 1.0, "grad": 1e-2})  # an overflowed offset's wrong loss


def test_large_kernel_check_runs_in_smoke_mode(tmp_path):
    check = _bench("gpu_large_check")
    assert check.main(["kernels", "--smoke", "--device", "cpu", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "kernels_large.json").read_text())
    assert set(res["checks"]) == {"cross_entropy", "attention", "rms_norm"} and res["ok"]


def test_gpu_check_script_pieces_run_on_cpu(tmp_path):
    """gpu_check.sh is valid bash, names only scripts that exist, and its eager MFU run's
    flags (a timeline of the last step) and the memory check work on the tiny config."""
    script = (BENCH / "gpu_check.sh").read_text()
    assert subprocess.run(["bash", "-n", str(BENCH / "gpu_check.sh")]).returncode == 0
    for name in re.findall(r"bench/([\w/]+\.py)", script):
        assert (BENCH / name).exists(), name
    for piece in ("kernels_large", "memory", "--profile-steps", "syncs", "mfu_torch"):
        assert piece in script
    metrics = tmp_path / "m.jsonl"
    flags = ["--config", "configs/tiny.yaml", "--train-iters", "2", "--log-interval", "1",
             "--eval-interval", "0", "--wandb-mode", "disabled", "--kernels", "torch"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MASTER_ADDR", None)
    run = subprocess.run(
        [sys.executable, "pretrain_gpt.py", *flags, "--profile-steps", "2:3",
         "--metrics-file", str(metrics)],
        cwd=BENCH.parent, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "timeline.json").exists()
    check = _bench("gpu_large_check")
    argv = ["memory", "--smoke", "--metrics", str(metrics), "--out", str(tmp_path), *flags]
    assert check.main(argv) == 0
    rows = json.loads((tmp_path / "memory.json").read_text())["rows"]
    assert all(rows[k]["ok"] for k in ("params", "grads", "optimizer"))  # states: as planned
