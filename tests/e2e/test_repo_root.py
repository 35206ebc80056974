"""Python started in the repository root (`python -c`, a REPL, a notebook) has the root on
sys.path, where kernels/ (installed as megalite.kernels) would hide the installed package named
`kernels` that transformers imports: kernels/__init__.py hands such an import over to it, or
without one is an empty namespace package, as a folder without __init__.py would be."""

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.e2e.conftest import ROOT

pytestmark = pytest.mark.slow


def _python(code, *flags, env=None):
    return subprocess.run([sys.executable, *flags, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=env)  # fmt: skip


def test_transformers_loads_an_export_from_the_repository_root(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tests.unit.test_checkpoint_hf import convert, hf_model

    hf_model("llama", seed=0).save_pretrained(tmp_path / "hf", safe_serialization=True)
    convert.main([str(tmp_path / "hf"), str(tmp_path / "ml"), "--to", "megalite"])
    convert.main([str(tmp_path / "ml"), str(tmp_path / "export"), "--to", "hf"])  # the README's
    code = (
        "import torch; from transformers import AutoModelForCausalLM; "
        f"m = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'export')!r}); "
        "print(type(m).__name__, m(torch.tensor([[1, 2, 3]])).logits.shape[-1])"
    )
    r = _python(code)
    assert r.returncode == 0, r.stderr[-3000:]
    want = transformers.AutoConfig.from_pretrained(tmp_path / "hf").vocab_size
    assert r.stdout.split() == ["LlamaForCausalLM", str(want)]


def test_an_installed_kernels_package_wins(tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("WHO = 'installed'\n")
    (tmp_path / "kernels" / "sub.py").write_text("WHO = 'installed.sub'\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)}  # after the root ('')
    code = "import kernels, kernels.sub; print(kernels.WHO, kernels.sub.WHO)"
    r = _python(code, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["installed", "installed.sub"]
    # megalite's own package is unaffected beside it
    r = _python("import kernels, megalite.kernels as k; print(kernels.WHO, k.select.__name__)",
                env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["installed", "select"]


def test_without_an_installed_kernels_it_is_as_if_absent(tmp_path):
    """This environment's packages but `kernels` (links to each, `python -S` adding them): from
    the root, `kernels` is an empty namespace package, as the folder would be without its
    __init__.py, and transformers finds no kernels, as it does elsewhere."""
    pytest.importorskip("transformers")
    site = Path(sysconfig.get_paths()["purelib"])
    farm = tmp_path / "site"
    farm.mkdir()
    for p in site.iterdir():
        if p.name != "kernels" and not p.name.startswith("kernels-"):
            (farm / p.name).symlink_to(p)
    setup = f"import site; site.addsitedir({str(farm)!r}); "
    code = setup + (
        "import kernels; print(kernels.__file__, list(kernels.__path__))\n"
        "try:\n    from kernels import select\nexcept ImportError:\n    print('ImportError')"
    )
    r = _python(code, "-S")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["None", "[]", "ImportError"]
    check = (
        setup + "from transformers.utils import import_utils as u; print(u.is_kernels_available())"
    )
    here = _python(check, "-S")
    elsewhere = subprocess.run([sys.executable, "-S", "-c", check], cwd=tmp_path,
                               capture_output=True, text=True, timeout=300)  # fmt: skip
    assert here.stdout.split() == elsewhere.stdout.split() == ["False"], here.stderr[-3000:]


def test_no_other_name_of_the_root_hides_an_installed_one():
    """What the root provides as top-level modules (packages with __init__.py, *.py files) and
    installed distributions also provide: only `kernels`, which hands over (above)."""
    from importlib.metadata import packages_distributions

    installed = packages_distributions()
    ours = {p.parent.name for p in ROOT.glob("*/__init__.py")} | {p.stem for p in ROOT.glob("*.py")}
    clashes = {n: installed[n] for n in ours if set(installed.get(n, [])) - {"megalite"}}
    assert set(clashes) <= {"kernels"}, clashes
