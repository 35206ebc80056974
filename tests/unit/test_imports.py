"""megalite's import graph, read from the source with ast (nothing is imported): imports run one
way through the layers of docs/architecture.md, no two files import each other (directly or in a
circle), and nothing in megalite/ or kernels/ imports tests/ or bench/."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The layers, lowest first. A module may import its own package and anything in a lower layer;
# two packages of one layer (data and model, say) do not import each other.
LAYERS = [
    ["errors", "clock"],
    ["model_config"],
    ["config", "megatron_flags"],
    ["megatron_translate"],
    ["config_read"],
    ["lr_schedule"],
    ["kernels"],
    ["parallel"],
    ["pipeline"],
    ["shape", "data", "model", "generation"],
    ["optim"],
    ["checkpoint"],
    ["plan"],
    ["training"],
    ["cli", "testing"],  # testing: what tests and bench share (spawned ranks, tiny runs)
    ["train"],
]
LEVEL = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module's dotted name -> its file (kernels/ is installed as megalite.kernels)."""
    out = {}
    for folder, package in (("megalite", "megalite"), ("kernels", "megalite.kernels")):
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def imports(name: str, path: Path, known: dict) -> set[str]:
    """The megalite modules `name` imports (at any depth of the file: lazy imports count)."""
    out = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            if t.startswith(("tests", "bench")):
                out.add(t)
            # `from megalite.x import y` names module megalite.x.y where y is one, else megalite.x
            while t and t not in known and "." in t:
                t = t.rsplit(".", 1)[0]
            if t in known and t != name and t != "megalite":
                out.add(t)
    return out


def unit(module: str) -> str:
    """The layer unit of a module: its first name below megalite (a package or a file)."""
    return module.split(".")[1]


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def violations(edges: dict[str, set[str]]) -> list[str]:
    """Every import that goes up a layer, sideways between two units of one layer, or into
    tests/ or bench/."""
    out = []
    for a, targets in sorted(edges.items()):
        for b in sorted(targets):
            if b.startswith(("tests", "bench")):
                out.append(f"{a} imports {b}")
                continue
            ua, ub = unit(a), unit(b)
            if ua == ub:
                continue
            if ua not in LEVEL or ub not in LEVEL:
                out.append(f"{a} -> {b}: {ua if ua not in LEVEL else ub} has no layer in LAYERS")
            elif LEVEL[ub] >= LEVEL[ua]:
                out.append(f"{a} imports {b} ({ub} is not below {ua})")
    return out


def test_no_import_cycle():
    assert cycles(graph()) == []


def test_imports_run_down_the_layers():
    assert violations(graph()) == []


def test_the_checks_can_fail():
    """The checks see a circle, an upward import and a test import when there is one."""
    edges = {
        "megalite.optim.zero": {"megalite.parallel.comm", "tests.spawn"},
        "megalite.parallel.comm": {"megalite.optim.zero"},
    }
    assert cycles(edges) == [["megalite.optim.zero", "megalite.parallel.comm"]]
    assert violations(edges) == [
        "megalite.optim.zero imports tests.spawn",
        "megalite.parallel.comm imports megalite.optim.zero (optim is not below parallel)",
    ]


def test_graph_reads_relative_and_lazy_imports(tmp_path):
    (tmp_path / "megalite" / "pkg").mkdir(parents=True)
    (tmp_path / "kernels").mkdir()
    (tmp_path / "megalite" / "__init__.py").write_text("")
    (tmp_path / "megalite" / "pkg" / "__init__.py").write_text("from . import a\n")
    (tmp_path / "megalite" / "pkg" / "a.py").write_text(
        "def f():\n    from megalite.pkg.b import g\n    from ..errors import E\n"
    )
    (tmp_path / "megalite" / "pkg" / "b.py").write_text("from megalite.kernels import k\n")
    (tmp_path / "megalite" / "errors.py").write_text("")
    (tmp_path / "kernels" / "__init__.py").write_text("")
    assert graph(tmp_path) == {
        "megalite": set(),
        "megalite.errors": set(),
        "megalite.pkg": {"megalite.pkg.a"},
        "megalite.pkg.a": {"megalite.pkg.b", "megalite.errors"},
        "megalite.pkg.b": {"megalite.kernels"},
        "megalite.kernels": set(),
    }


def test_architecture_doc_states_these_layers():
    """docs/architecture.md writes the same order as LAYERS (`a`, `b` < `c` < ...)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    start = text.index("Imports run one way")
    order = text[start:].split("\n\n")[1].replace("\n", " ")
    written = [[u.strip().strip("`") for u in layer.split(",")] for layer in order.split("<")]
    assert written == LAYERS
