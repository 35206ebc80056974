"""W&B and TensorBoard settings (training/run_settings.py, training/logger.py): a flag given
wins, W&B's environment variables next, megalite's defaults last; a resumed job continues the
W&B run and the TensorBoard directory its checkpoint saved."""

import pytest

from megalite.config import Config
from megalite.training import run_settings
from megalite.training.logger import Logger


def _log(**given):
    cfg = Config()
    for k, v in given.items():
        setattr(cfg.logging, k, v)
    return cfg


def test_flag_then_environment_then_default():
    env = {"WANDB_MODE": "disabled", "WANDB_PROJECT": "p-env", "WANDB_ENTITY": "team",
           "WANDB_RUN_GROUP": "sweep", "WANDB_DIR": "/scratch/wb"}  # fmt: skip
    log = _log().logging
    kw = run_settings.wandb_init_kwargs(log, "abc", env)
    assert kw == {"mode": "disabled", "project": "p-env", "entity": "team", "group": "sweep",
                  "dir": "/scratch/wb", "id": "abc", "resume": "allow"}  # fmt: skip
    log = _log(wandb_mode="offline", wandb_project="p-flag", wandb_run_name="n").logging
    kw = run_settings.wandb_init_kwargs(log, "abc", {**env, "WANDB_RESUME": "must"})
    assert (kw["mode"], kw["project"], kw["name"], kw["entity"]) == (
        "offline",
        "p-flag",
        "n",
        "team",
    )
    assert "resume" not in kw  # W&B's own WANDB_RESUME is left to wandb
    kw = run_settings.wandb_init_kwargs(_log().logging, "abc", {})
    assert kw == {"mode": "offline", "project": "megalite", "dir": "runs", "id": "abc",
                  "resume": "allow"}  # fmt: skip
    assert (
        run_settings.wandb_setting(_log().logging, "mode", {"WANDB_DISABLED": "true"}) == "disabled"
    )


def test_run_id_flag_then_environment_then_checkpoint():
    log = _log().logging
    assert run_settings.wandb_run_id(log, "saved", {"WANDB_RUN_ID": "env"}) == "env"
    assert run_settings.wandb_run_id(log, "saved", {}) == "saved"
    fresh = run_settings.wandb_run_id(log, None, {})
    assert len(fresh) == 8 and fresh != run_settings.wandb_run_id(log, None, {})
    flag = _log(wandb_run_id="flag").logging
    assert run_settings.wandb_run_id(flag, "saved", {"WANDB_RUN_ID": "env"}) == "flag"


def test_wandb_mode_disabled_in_the_environment_writes_no_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    log = Logger(_log(), enabled=True)
    log.write({"iteration": 1, "loss": 1.0})
    assert log.wandb is None and not (tmp_path / "wb").exists()
    log.finish()


def test_resumed_job_continues_the_saved_run(tmp_path, monkeypatch):
    """The ids a checkpoint saves (Logger.run_ids) make the resumed job's Logger open the same
    W&B run (wandb.init's id) and TensorBoard directory, dropping the events logged after the
    checkpoint by the job that died."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    inits = []
    monkeypatch.setattr("wandb.init", lambda **kw: inits.append(kw))  # records, writes nothing
    for var in ("WANDB_MODE", "WANDB_RUN_ID", "WANDB_DIR"):
        monkeypatch.delenv(var, raising=False)
    first = Logger(_log(wandb_dir=str(tmp_path / "wb"), tensorboard_dir=str(tmp_path / "tb")), True)
    for i in (1, 2, 3):  # the checkpoint is at 2; step 3 was logged, then the job died
        first.write({"iteration": i, "loss": float(i)})
    saved = first.run_ids()
    first.tensorboard.close()
    assert saved["wandb_run_id"] == inits[0]["id"] and inits[0]["resume"] == "allow"

    resumed = Logger(_log(wandb_dir=str(tmp_path / "wb")), True)  # no --tensorboard-dir now
    resumed.resume(saved, iteration=2)
    for i in (3, 4):
        resumed.write({"iteration": i, "loss": 10.0 * i})
    resumed.tensorboard.close()
    assert inits[1]["id"] == saved["wandb_run_id"] and resumed.run_ids() == saved
    loss = EventAccumulator(str(tmp_path / "tb")).Reload().Scalars("loss")
    assert [(e.step, e.value) for e in loss] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]

    other = Logger(_log(wandb_run_id="mine"), True)  # --wandb-run-id wins over the checkpoint
    other.resume(saved, iteration=2)
    assert other.run_ids()["wandb_run_id"] == "mine"
