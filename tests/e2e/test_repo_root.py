"""Python started in the repository root (`python -c`, a REPL, a notebook) has the root on
sys.path, where kernels/ (installed as megalite.kernels) would hide the installed package named
`kernels` that transformers imports: kernels/__init__.py hands such an import over to it."""

import subprocess
import sys

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


def test_without_an_installed_kernels_the_import_fails_as_if_absent():
    r = _python("import kernels", "-S")  # -S: no site-packages, so no installed `kernels`
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == (
        "ModuleNotFoundError: No module named 'kernels' (the repository's kernels/ is "
        "megalite.kernels)"
    )


def test_no_other_name_of_the_root_hides_an_installed_one():
    """What the root provides as top-level modules (packages with __init__.py, *.py files) and
    installed distributions also provide: only `kernels`, which hands over (above)."""
    from importlib.metadata import packages_distributions

    installed = packages_distributions()
    ours = {p.parent.name for p in ROOT.glob("*/__init__.py")} | {p.stem for p in ROOT.glob("*.py")}
    clashes = {n: installed[n] for n in ours if set(installed.get(n, [])) - {"megalite"}}
    assert set(clashes) <= {"kernels"}, clashes
