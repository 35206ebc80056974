"""training/dry_run.py and tools/plan.py: plans printed without a process group."""

from megalite.plan.ranking import Cluster
from megalite.shape import validate
from megalite.training import dry_run
from tests.unit.plan_configs import big


def test_print_plan_needs_no_process_group(capsys):
    cfg = big("gpt2", 12, 768, 12, 1024, 50257, mbs=4, gbs=256)
    cfg.parallel.dp = 8
    dry_run.print_plan(cfg, validate(cfg, 8), Cluster(gpus=8, gpu_memory_gib=80))
    out = capsys.readouterr().out
    assert "layout tp=1 pp=1 dp=8 zero=0" in out and "fastest first" in out
    assert "estimated step time" in out


def test_dry_run_plans_the_layout_given_from_a_laptop():
    """Outside torchrun (a world of one) --dry-run plans --tp/--pp/--dp as given."""
    import subprocess
    import sys
    from pathlib import Path

    argv = ["--dry-run", "--tp", "8", "--pp", "4", "--dp", "2", "--num-layers", "8",
            "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "128",
            "--vocab-size", "1000", "--precision", "bf16", "--mbs", "1", "--gbs", "64"]  # fmt: skip
    r = subprocess.run([sys.executable, "pretrain_gpt.py", *argv], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[2], timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("layout tp=8 pp=4 dp=2") and "64 GPUs" in r.stdout
    assert "schedule 1f1b pp=4 vpp=1 m=32 verified" in r.stdout


def test_the_schedule_is_verified_at_every_count_of_a_ramp_up(capsys, monkeypatch):
    """--dry-run proves the run's schedule as data at each micro-batch count it will step with
    (a ramp-up of 2, 4, then 6 samples a step at dp=1, mbs 2: 1, 2 and 3 micro-batches), and a
    schedule that fails the verifier stops it with the verifier's error."""
    import pytest

    from megalite.pipeline import verify
    from megalite.testing import tiny_config

    cfg = tiny_config()
    cfg.parallel.pp, cfg.parallel.pp_schedule = 2, "gpipe"
    t = cfg.training
    t.global_batch_size, t.micro_batch_size, t.train_samples, t.train_iters = 6, 2, 40, None
    t.rampup_batch_size = [2, 2, 8]
    dry_run.print_schedule(cfg, validate(cfg, 2))
    out = capsys.readouterr().out
    assert [line.split(" verified")[0] for line in out.splitlines()] == [
        f"schedule gpipe pp=2 vpp=1 m={m}" for m in (1, 2, 3)
    ]

    def broken(*args):
        raise verify.ScheduleError("rank 1: a send without its receive")

    monkeypatch.setattr(verify, "verify_table", broken)
    with pytest.raises(verify.ScheduleError, match="rank 1"):
        dry_run.print_schedule(cfg, validate(cfg, 2))


def test_plan_searches_layouts_the_default_one_cannot_split(capsys):
    """GPT-3 175B on 1024 GPUs at batch 1536: dp=1024 (the layout given by default) does not
    split the batch; the layouts that do are searched (it used to fail before the search)."""
    from megalite.cli.plan import main

    main(["--gpus", "1024", "--gpu-memory", "80", "--gpus-per-node", "8", "--num-layers", "96",
          "--hidden-size", "12288", "--num-attention-heads", "96", "--seq-length", "2048",
          "--global-batch-size", "1536", "--micro-batch-size", "1", "--top", "3"])  # fmt: skip
    out = capsys.readouterr().out
    assert out.startswith("the layout given does not run on 1024 GPUs: global_batch_size=1536")
    ranking = out.split("fastest first")[1].splitlines()
    first = ranking[2].split()
    assert first[0] == "1" and int(first[2].removeprefix("pp=")) > 1  # PP across nodes
    assert len([r for r in ranking if r.split()[:1] and r.split()[0].isdigit()]) == 3
    main(["--gpus", "1024", "--gpu-memory", "80"])  # no model flags: the defaults plan too
    out = capsys.readouterr().out
    assert "fastest first" in out and "none: no layout both splits the batch" in out
