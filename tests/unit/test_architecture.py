"""docs/architecture.md's checkable claims stay true, read from the source with ast (nothing is
imported but the dataclasses and protocols the claims name): the files under ~400 lines, the
step's table of hops, `RankParts`'s fields, the buffers' interface, the process groups' names and
the observers' hooks. (The import layers are test_imports.py's; one host read per step is
tests/distributed/test_host_syncs.py's.)"""

import ast
import dataclasses
import re
from pathlib import Path
from typing import get_type_hints

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "architecture.md").read_text()
MAX_LINES = 400  # "a file past ~400 lines wants splitting"


def _section(title: str) -> str:
    return DOC.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def _defined(path: Path) -> set[str]:
    """Every function and class of a module, methods as Class.method."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef):
            names.add(node.name)
            names |= {f"{node.name}.{f.name}" for f in node.body if isinstance(f, ast.FunctionDef)}
        elif isinstance(node, ast.FunctionDef):
            names.add(node.name)
    return names


def test_every_file_is_under_400_lines():
    long = {}
    for folder in ("megalite", "kernels", "bench", "tools"):
        for path in (ROOT / folder).rglob("*.py"):
            n = len(path.read_text().splitlines())
            if n > MAX_LINES:
                long[str(path.relative_to(ROOT))] = n
    assert long == {}  # split along a seam: one concept per file


def test_the_steps_hops_exist_where_the_table_says():
    rows = re.findall(r"^\| (\d+) \| `([\w/]+\.py)` `([\w.]+)` \|", _section("Step"), re.M)
    assert [int(n) for n, _, _ in rows] == list(range(1, len(rows) + 1))
    assert len(rows) <= 12 and len({f for _, f, _ in rows}) <= 8  # the bound
    assert rows[0][2] == "Trainer.train" and rows[-1][2] == "adamw"
    missing = [(f, name) for _, f, name in rows if name not in _defined(ROOT / "megalite" / f)]
    assert missing == []


def test_rank_parts_fields_are_the_documented_ones():
    from megalite.training.build import RankParts

    text = _section("Model chunks (the pipeline's unit)")
    listed = re.search(r"a `RankParts` of (.*?); `run\(batch, m\)`", text, re.S).group(1)
    named = set(re.findall(r"`(\w+)`", listed))
    fields = {f.name for f in dataclasses.fields(RankParts) if not f.name.startswith("_")}
    assert named == fields


def test_the_buffers_interface_table_is_the_protocol():
    from megalite.parallel.buffers import Buffers

    table = re.findall(r"^\| (`.*?) \| ", _section("Step"), re.M)
    named = {n for row in table for n in re.findall(r"`(\w+)(?:\(|`)", row)}
    members = set(get_type_hints(Buffers)) | {
        n for n, v in vars(Buffers).items() if callable(v) and not n.startswith("_")
    }
    assert named == members


def test_the_group_names_are_process_groups_members():
    """The groups the doc names are ProcessGroups' (an axis's group, `groups.tp`, is any
    registered axis or an expert one); the old, easily confused names are gone."""
    from megalite.parallel.axes import AXES

    text = _section("Axes, shape and process groups")
    named = set(re.findall(r"`groups\.(\w+)`", text)) - set(AXES) - {"ep", "edp"}
    assert {"replica", "zero_shard", "shard_copies", "batch"} <= named
    src = ROOT / "megalite" / "parallel" / "groups.py"
    defined = {n.split(".")[1] for n in _defined(src) if n.startswith("ProcessGroups.")}
    for node in ast.walk(ast.parse(src.read_text())):  # attributes set in the class's methods
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            defined.add(node.attr)
    assert named - defined == set()
    assert {"replicas", "replicate", "shard", "data"} & (named | defined) == set()


def test_the_observer_hooks_are_the_documented_ones():
    from megalite.training.observers import Observer

    text = _section("Step")
    listed = re.search(r"Each observer has no-op hooks \((.*?)\) and the trainer", text, re.S)[1]
    named = set(re.findall(r"`(\w+)", listed))
    hooks = {n for n, v in vars(Observer).items() if callable(v) and not n.startswith("_")}
    assert named == hooks
