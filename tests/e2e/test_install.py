"""`pip install .` into a fresh virtual environment, then the installed commands from a
directory outside the repository: `megalite-train --help` and a short run under
`torchrun -m megalite.train`.

To avoid reinstalling torch the new environment sees this one's site-packages through a .pth
line (appended after its own site-packages, whose .pth files, the editable install's among
them, are not processed); megalite itself is installed into the new environment from a copy of
the sources and must be imported from there."""

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.e2e.conftest import ROOT, TINY

pytestmark = pytest.mark.slow

COMMANDS = ("train", "preprocess", "convert", "generate", "plan", "serve", "diagnose-hang", "run")


def _run(cmd, cwd, timeout=300):
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                       env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(cwd)})  # fmt: skip
    assert r.returncode == 0, f"{cmd}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def test_pip_install_gives_working_commands(tiny_data, tmp_path):
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for d in ("megalite", "kernels"):
        shutil.copytree(ROOT / d, src / d, ignore=ignore)
    for f in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, src / f)
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path)
    py = venv / "bin" / "python"
    site = _run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path
    )
    Path(site.strip(), "outer.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
          "--no-build-isolation", "--ignore-installed", str(src)], tmp_path)  # fmt: skip
    where = _run([str(py), "-c", "import megalite.train as m; print(m.__file__)"], tmp_path)
    assert where.startswith(str(venv)), where  # the installed copy, not the repository
    for name in COMMANDS:
        assert (venv / "bin" / f"megalite-{name}").is_file(), name
    assert "--tensor-model-parallel-size" in _run(
        [str(venv / "bin" / "megalite-train"), "--help"], tmp_path
    )
    prefix, model = tiny_data
    metrics = tmp_path / "m.jsonl"
    _run([str(py), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
          "-m", "megalite.train", *TINY, "--data-path", prefix, "--tokenizer-model", model,
          "--train-iters", "2", "--tp", "2", "--metrics-file", str(metrics)], tmp_path)  # fmt: skip
    assert len(metrics.read_text().splitlines()) == 2
