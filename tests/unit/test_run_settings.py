"""W&B and TensorBoard settings (training/run_settings.py, training/logger.py): a flag given
wins, W&B's environment variables next, megalite's defaults last; a resumed job continues the
W&B run and the TensorBoard directory its checkpoint saved."""

import pytest

from megalite.config import Config
from megalite.errors import MegaliteError
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


def _wandb_finds_a_key(env: dict) -> bool:
    """wandb's own answer (its sign-in code, asked not to prompt): the oracle."""
    from wandb.sdk.lib.wbauth import authenticate

    base = env.get("WANDB_BASE_URL", "https://api.wandb.ai")
    return authenticate.authenticate_session(host=base, source="test", prompt=False,
                                             update_session=False) is not None  # fmt: skip


def test_online_without_credentials_is_refused_in_one_line(tmp_path, monkeypatch):
    """Where wandb.init finds a key (environment, netrc) run_settings finds it too, reading
    files only; --wandb-mode online without one is refused before anything starts."""
    pytest.importorskip("wandb.sdk.lib.wbauth")
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "NETRC", "WANDB_BASE_URL",
                "WANDB_MODE"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    online = _log(wandb_mode="online").logging
    cases = [
        ({}, False),
        ({"WANDB_API_KEY": "k" * 40}, True),
        ({"NETRC": str(tmp_path / "other")}, False),
    ]
    (tmp_path / "netrc-wb").write_text("machine api.wandb.ai\n  login user\n  password " + "p" * 40)
    cases.append(({"NETRC": str(tmp_path / "netrc-wb")}, True))
    (tmp_path / "netrc-elsewhere").write_text("machine example.com login u password " + "p" * 40)
    cases.append(({"NETRC": str(tmp_path / "netrc-elsewhere")}, False))
    cases.append(({"NETRC": str(tmp_path / "netrc-elsewhere"),
                   "WANDB_BASE_URL": "https://example.com"}, True))  # fmt: skip
    for env, has in cases:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert _wandb_finds_a_key(env) == has, env
        assert (run_settings.wandb_credentials() is not None) == has, env
        if has:
            run_settings.check_wandb_online(online)
        else:
            with pytest.raises(MegaliteError) as e:
                run_settings.check_wandb_online(online)
            assert "\n" not in str(e.value) and "wandb login" in str(e.value)
            run_settings.check_wandb_online(_log(wandb_mode="offline").logging)  # needs none
        for k in env:
            monkeypatch.delenv(k)
    (tmp_path / ".netrc").write_text("machine api.wandb.ai login user password " + "p" * 40)
    assert _wandb_finds_a_key({}) and run_settings.wandb_credentials() == str(tmp_path / ".netrc")
    monkeypatch.setenv("WANDB_MODE", "online")  # W&B's variable asks for it too
    (tmp_path / ".netrc").unlink()
    with pytest.raises(MegaliteError):
        run_settings.check_wandb_online(_log().logging)
