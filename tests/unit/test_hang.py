"""Hang reports and their diagnosis (training/hang.py) on reports written by hand; the whole
path, a run that really stalls, is tests/e2e/test_hang_report.py."""

import json
from types import SimpleNamespace

import pytest

from megalite.config import Config
from megalite.errors import MegaliteError
from megalite.parallel.groups import single_process_groups
from megalite.shape import validate
from megalite.training import hang


def _report(rank, sizes, phase="schedule", iteration=3, action=None, entered=None, **kw):
    order = "-".join(a for a, _ in sizes)
    schedule = kw.pop("schedule", {"name": "1f1b", "pp": 2, "vpp": 1, "microbatches": 4})
    return {"rank": rank, "world_size": 2, "sizes": sizes, "order": order, "schedule": schedule,
            "iteration": iteration, "phase": phase, "action": action, "entered": entered or {},
            "error": f"rank {rank} timed out", "time": 0.0, **kw}  # fmt: skip


def _write(tmp_path, *reports):
    for r in reports:
        (tmp_path / hang.PATTERN.format(r["rank"])).write_text(json.dumps(r))
    return tmp_path


def test_report_dir_precedence(tmp_path):
    cfg = Config()
    assert hang.report_dir(cfg) is None  # nowhere to write: no reports
    cfg.checkpoint.save = str(tmp_path / "ckpt")
    assert hang.report_dir(cfg) == tmp_path / "ckpt"
    cfg.logging.metrics_file = str(tmp_path / "logs" / "m.jsonl")
    assert hang.report_dir(cfg) == tmp_path / "logs"
    cfg.logging.hang_report_dir = str(tmp_path / "hangs")
    assert hang.report_dir(cfg) == tmp_path / "hangs"


def test_recorder_writes_where_the_rank_is(tmp_path):
    cfg = Config()
    cfg.logging.hang_report_dir = str(tmp_path)
    shape = validate(cfg, 1)
    rec = hang.HangRecorder(cfg, shape, single_process_groups(), shape.microbatches)
    rec.at(2, "schedule")
    rec.observe(5, SimpleNamespace(kind="F", chunk=0, mb=1, peer=None))  # the executor's
    path = rec.write("boom")
    r = json.loads(path.read_text())
    assert path.name == "hang-rank00000.json"
    assert (r["rank"], r["iteration"], r["phase"], r["error"]) == (0, 2, "schedule", "boom")
    assert r["action"] == {"index": 5, "kind": "F", "chunk": 0, "mb": 1, "peer": None}
    assert r["schedule"] == {"name": "1f1b", "pp": 1, "vpp": 1, "microbatches": 4}
    rec.at(2, "optimizer")
    assert json.loads(rec.write("again").read_text())["phase"] == "optimizer"
    rec.at(3, "schedule")  # a new schedule forgets the last step's action
    assert rec.record("x")["action"] is None
    rec.schedule_runs(2)  # a step of a batch-size ramp-up: the schedule it ran is replayed
    assert rec.record("x")["schedule"]["microbatches"] == 2
    cfg.logging.hang_report_dir = None
    assert hang.HangRecorder(cfg, shape, single_process_groups(), 4).write("x") is None


def test_load_reports_refuses_what_is_not_one(tmp_path):
    with pytest.raises(MegaliteError, match="is not a directory"):
        hang.load_reports(tmp_path / "nope")
    with pytest.raises(MegaliteError, match="holds no hang-rank"):
        hang.load_reports(tmp_path)
    (tmp_path / "hang-rank00000.json").write_text("{not json")
    with pytest.raises(MegaliteError, match="is not a hang report"):
        hang.load_reports(tmp_path)


def test_every_rank_reported_names_the_furthest_behind(tmp_path):
    dp = [["dp", 2]]
    one = {"name": "1f1b", "pp": 1, "vpp": 1, "microbatches": 4}
    ahead = _report(0, dp, phase="optimizer", iteration=2, schedule=one)
    behind = _report(1, dp, iteration=2, schedule=one,
                     action={"index": 3, "kind": "F", "chunk": 0, "mb": 1, "peer": None})  # fmt: skip
    text = hang.diagnose(_write(tmp_path, ahead, behind))
    assert text.startswith("rank 1 (") and "is the rank the others wait on: it is furthest " in text
    assert "at action 3 (F of chunk 0, micro-batch 1) of iteration 2" in text
    assert text.endswith("its error: rank 1 timed out. 2 of 2 ranks wrote a report.")


def test_a_silent_pipeline_rank_is_placed_by_its_peer(tmp_path):
    """Stage 0 of 1F1B (pp 2, 4 micro-batches) waits at action 10 for micro-batch 1's gradient:
    stage 1, which wrote nothing, never finished the send of it (its action 9)."""
    waiting = _report(0, [["pp", 2]],
                      action={"index": 10, "kind": "WAIT_B", "chunk": 0, "mb": 1, "peer": None})  # fmt: skip
    text = hang.diagnose(_write(tmp_path, waiting))
    assert text.startswith("rank 1 (") and "it wrote no report (stopped or dead)" in text
    assert "place it at action 9 (SEND_B of chunk 0, micro-batch 1) of iteration 3" in text
    assert "pipeline rank 0 waits at its action 10 (WAIT_B of chunk 0, micro-batch 1)" in text
    assert text.endswith("1 of 2 ranks wrote a report; no report from 1.")


def test_a_silent_rank_no_report_places(tmp_path):
    """A data-parallel peer inside a compute says nothing of where the silent rank is."""
    one = {"name": "1f1b", "pp": 1, "vpp": 1, "microbatches": 4}
    r = _report(0, [["dp", 2]], schedule=one,
                action={"index": 2, "kind": "F", "chunk": 0, "mb": 1, "peer": None})  # fmt: skip
    text = hang.diagnose(_write(tmp_path, r))
    assert text.startswith("rank 1 (") and "no peer's report places it" in text


def test_nccl_raises_in_the_host_thread_and_gloo_is_left_alone(tmp_path):
    """Issue 32, finding 6: NCCL's watchdog kills the process by default, before any report;
    on CUDA the launcher asks it to abort the communicators and let the host thread raise."""
    cfg = Config()
    env = {}
    assert hang.prepare_nccl(cfg, cuda=False, env=env) == {} and env == {}  # gloo
    got = hang.prepare_nccl(cfg, cuda=True, env=env)
    assert got == env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}  # no report dir: no trace
    cfg.logging.hang_report_dir = str(tmp_path / "hangs")
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}  # the user's own setting wins
    got = hang.prepare_nccl(cfg, cuda=True, env=env)
    assert got["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert got["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and (tmp_path / "hangs").is_dir()
    assert got["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "hangs" / "nccl-trace-rank")
