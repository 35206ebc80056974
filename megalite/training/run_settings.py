"""Where a run's W&B and TensorBoard logs go, resolved as their users expect.

A megalite flag given wins; else W&B's own environment variable (what SLURM scripts set:
WANDB_MODE, WANDB_PROJECT, ...); else megalite's default. W&B settings megalite has no flag for
(WANDB_TAGS, WANDB_NOTES, WANDB_JOB_TYPE, ...) are never passed, so wandb reads them itself.

A resumed job continues the run it resumes: the W&B run id and the TensorBoard directory are
saved in the checkpoint (`TrainState.run_ids`) and reused unless a flag (--wandb-run-id,
--tensorboard-dir) or WANDB_RUN_ID says otherwise.
"""

import netrc
import os
import uuid
from pathlib import Path
from urllib.parse import urlsplit

from megalite.errors import MegaliteError

# field of LoggingConfig -> (W&B's environment variable, megalite's default)
WANDB_SETTINGS = {
    "mode": ("WANDB_MODE", "offline"),
    "project": ("WANDB_PROJECT", "megalite"),
    "entity": ("WANDB_ENTITY", None),
    "name": ("WANDB_NAME", None),
    "group": ("WANDB_RUN_GROUP", None),
    "dir": ("WANDB_DIR", "runs"),
}
_FIELD = {"name": "wandb_run_name"}  # the others are wandb_<key>


def _given(log, key: str):
    return getattr(log, _FIELD.get(key, f"wandb_{key}"))


def wandb_setting(log, key: str, env=os.environ):
    """One W&B setting: the flag, else W&B's environment variable, else megalite's default."""
    var, default = WANDB_SETTINGS[key]
    if _given(log, key) is not None:
        return _given(log, key)
    if (
        key == "mode"
        and not env.get(var)
        and env.get("WANDB_DISABLED", "").lower() in ("true", "1")
    ):
        return "disabled"  # W&B's older switch, still honoured by wandb itself
    return env.get(var) or default


def wandb_init_kwargs(log, run_id: str, env=os.environ) -> dict:
    """The arguments of wandb.init, bar config: the settings above, and the run to continue
    (resume="allow": a new id starts a run, a known one continues it; $WANDB_RESUME wins)."""
    kw = {k: wandb_setting(log, k, env) for k in WANDB_SETTINGS}
    kw = {k: v for k, v in kw.items() if v is not None}
    kw["id"] = run_id
    if not env.get("WANDB_RESUME"):
        kw["resume"] = "allow"
    return kw


def wandb_run_id(log, saved: str | None, env=os.environ) -> str:
    """--wandb-run-id, else $WANDB_RUN_ID, else the id the resumed checkpoint saved, else new
    (W&B's form: 8 lowercase letters and digits)."""
    return log.wandb_run_id or env.get("WANDB_RUN_ID") or saved or uuid.uuid4().hex[:8]


def tensorboard_dir(log, saved: str | None) -> str | None:
    """--tensorboard-dir, else the directory the resumed run wrote to, else none."""
    return log.tensorboard_dir or saved


def wandb_credentials(env=os.environ) -> str | None:
    """Where W&B would find an API key without asking, or None: where wandb.init itself looks
    (wandb/sdk/lib/wbauth): $WANDB_API_KEY, $WANDB_IDENTITY_TOKEN_FILE, then the netrc file
    ($NETRC, else ~/.netrc or ~/_netrc) entry for the server ($WANDB_BASE_URL, else
    api.wandb.ai) that `wandb login` writes. Files only: nothing is sent anywhere."""
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        if env.get(var):
            return f"${var}"
    home = Path(env.get("HOME") or Path.home())
    path = Path(env["NETRC"]).expanduser() if env.get("NETRC") else home / ".netrc"
    if not env.get("NETRC") and not path.exists() and (home / "_netrc").exists():
        path = home / "_netrc"
    host = urlsplit(env.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc
    try:
        entry = netrc.netrc(str(path)).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return None
    return str(path) if entry and entry[2] else None


def check_wandb_online(log, env=os.environ):
    """--wandb-mode online (or WANDB_MODE=online) needs credentials W&B can read without a
    prompt; without them wandb.init would fail at the first logged step, after training ran.
    Refused here, in one line, before any process group exists."""
    if wandb_setting(log, "mode", env) != "online" or wandb_credentials(env):
        return
    host = urlsplit(env.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc
    raise MegaliteError(
        f"--wandb-mode online needs W&B credentials, and there are none (no $WANDB_API_KEY, no "
        f"entry for {host} in ~/.netrc); run `wandb login` or set WANDB_API_KEY, or log with "
        "--wandb-mode offline (`wandb sync` uploads it later)"
    )
