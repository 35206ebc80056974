"""tests/README.md's table from module to test file stays true: every module of megalite/ and
kernels/ with a function or class of its own has a row, every row names a module that exists,
and every test file it names exists (read from the source with ast: nothing is imported)."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "tests" / "README.md"


def modules_with_logic(root: Path = ROOT) -> set[str]:
    """The .py files under megalite/ and kernels/ defining a function or class at top level."""
    out = set()
    for folder in ("megalite", "kernels"):
        for path in (root / folder).rglob("*.py"):
            body = ast.parse(path.read_text(), str(path)).body
            if any(
                isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) for n in body
            ):
                out.add(path.relative_to(root).as_posix())
    return out


def table(text: str) -> dict[str, list[str]]:
    """Module -> the test files (backticked, relative to tests/) of each `| `module` | ... |` row."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\|\s*`([^`]+\.py)`\s*\|(.*)\|\s*$", line)
        if m:
            rows[m.group(1)] = re.findall(r"`([^`]+\.py)`", m.group(2))
    return rows


def test_every_module_has_a_row():
    rows = table(README.read_text())
    assert sorted(modules_with_logic() - rows.keys()) == []  # add a row for each
    assert sorted(m for m in rows if not (ROOT / m).is_file()) == []  # rows of removed modules


def test_every_named_test_file_exists():
    rows = table(README.read_text())
    assert all(rows.values()), [m for m, tests in rows.items() if not tests]
    named = {t for tests in rows.values() for t in tests}
    assert sorted(t for t in named if not (ROOT / "tests" / t).is_file()) == []


def test_the_check_sees_a_missing_row(tmp_path):
    (tmp_path / "megalite" / "pkg").mkdir(parents=True)
    (tmp_path / "kernels").mkdir()
    (tmp_path / "megalite" / "__init__.py").write_text('"""no logic of its own"""\n')
    (tmp_path / "megalite" / "pkg" / "a.py").write_text("def f():\n    pass\n")
    (tmp_path / "megalite" / "pkg" / "b.py").write_text("X = 1\n")
    (tmp_path / "kernels" / "k.py").write_text("class K:\n    pass\n")
    assert modules_with_logic(tmp_path) == {"megalite/pkg/a.py", "kernels/k.py"}
    text = "| `megalite/pkg/a.py` | `unit/test_a.py`, `e2e/test_b.py` (slow) |\n| x | y |\n"
    assert table(text) == {"megalite/pkg/a.py": ["unit/test_a.py", "e2e/test_b.py"]}


def test_setup_py_ships_every_package():
    """A package added under megalite/ (a split module becoming a folder) is listed in setup.py's
    `packages`, or `pip install .` leaves it out (tests/e2e/test_install.py finds that slowly)."""
    listed = set(re.findall(r'"(megalite(?:\.\w+)*)"', (ROOT / "setup.py").read_text()))
    found = {"megalite.kernels"} | {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "megalite").rglob("__init__.py")
    }
    assert found - listed == set()
