"""--data-cache-path: built order arrays saved once (atomically, one builder when ranks race)
and loaded back; build_datasets gives the same samples from the cache."""

import subprocess
import sys
from subprocess import PIPE

import numpy as np
import pytest

from megalite.data import index_cache
from megalite.data import sample_order as order
from megalite.errors import MegaliteError
from tests.unit.test_data_megatron_order import data, megalite_datasets, training  # noqa: F401


def test_built_once_then_loaded(tmp_path):
    calls = []

    def build(directory):
        calls.append(1)
        index_cache.save(directory, "x", np.arange(5))
        index_cache.save_blocks(directory, "y", (4, 2), np.int32, [np.ones((2, 2), np.int32)] * 2)

    first = index_cache.cached(tmp_path, "gpt-train", {"seed": 1}, build)
    again = index_cache.cached(tmp_path, "gpt-train", {"seed": 1}, build)
    assert len(calls) == 1 and isinstance(again["x"], np.memmap)
    assert all(np.array_equal(first[k], again[k]) for k in ("x", "y"))
    assert again["y"].shape == (4, 2) and again["y"].dtype == np.int32 and again["y"].all()
    index_cache.cached(tmp_path, "gpt-train", {"seed": 2}, build)  # another key: built anew
    assert len(calls) == 2
    entries = sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock"))
    assert len(entries) == 2 and all(e.startswith("gpt-train-") for e in entries)
    plain = index_cache.cached(None, "gpt-train", {"seed": 1}, build)  # no cache: always built
    assert len(calls) == 3 and not isinstance(plain["x"], np.memmap)
    assert np.array_equal(plain["x"], first["x"])


def test_unwritable_cache_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(MegaliteError, match="--data-cache-path"):
        index_cache.cached(tmp_path / "file" / "sub", "x", {}, lambda d: None)


def test_racing_ranks_build_once(tmp_path):
    code = (
        "import sys, time, numpy as np; from megalite.data.index_cache import cached, save\n"
        "def build(d):\n"
        "    print('building', file=sys.stderr); time.sleep(0.5)\n"
        "    save(d, 'a', np.arange(1000) * 3)\n"
        f"print(int(cached({str(tmp_path)!r}, 'gpt-train', {{'k': 1}}, build)['a'].sum()))"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=PIPE, stderr=PIPE, text=True)
             for _ in range(3)]  # fmt: skip
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert {o.strip() for o, _ in outs} == {str(3 * 999 * 1000 // 2)}
    assert sum("building" in e for _, e in outs) == 1
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]  # nothing half-written


def test_build_datasets_from_the_cache(data, monkeypatch, tmp_path):  # noqa: F811
    spec = dict(data_path=["0.3", "a", "0.7", "b"], split="80,15,5")
    plain = megalite_datasets(data, monkeypatch, training(20), **spec)
    built = megalite_datasets(data, monkeypatch, training(20), cache=str(tmp_path), **spec)
    names = sorted(p.name.rsplit("-", 1)[0] for p in tmp_path.iterdir() if p.is_dir())
    splits = ("test", "train", "valid")
    assert names == sorted([f"blend-{s}" for s in splits] + [f"gpt-{s}" for s in splits] * 2)

    def no_rebuild(*a, **k):
        raise AssertionError("rebuilt a cached index")

    monkeypatch.setattr(order, "gpt_indices", no_rebuild)
    monkeypatch.setattr(order, "blending_blocks", no_rebuild)
    loaded = megalite_datasets(data, monkeypatch, training(20), cache=str(tmp_path), **spec)
    for split in splits:
        a, b, c = (getattr(x, split) for x in (plain, built, loaded))
        assert len(a) == len(b) == len(c) > 0
        for i in range(len(a)):
            assert np.array_equal(a[i], b[i]) and np.array_equal(a[i], c[i]), (split, i)
    with pytest.raises(AssertionError, match="rebuilt"):  # another seed is another entry
        megalite_datasets(data, monkeypatch, training(20, seed=9), cache=str(tmp_path), **spec)
