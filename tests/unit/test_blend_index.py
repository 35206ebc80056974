"""The blend index (which dataset, and which of its samples, each blend sample is) equals
megatron-core's compiled helper element for element: compiled (blend_native, specialised loops
for 1-16 datasets and the general one past them), in blocks, and in the Python fallback."""

import numpy as np
import pytest

from megalite.data import blend_native
from megalite.data import sample_order as order

helpers = pytest.importorskip("megatron.core.datasets.helpers")


def megatron(weights, size):
    ds, local = np.zeros(size, np.int16), np.zeros(size, np.int64)
    helpers.build_blending_indices(ds, local, list(weights), len(weights), size, False)
    return ds, local


def weight_sets():
    """Ties (equal weights, exact halves and quarters), shares that round (thirds, sevenths,
    normalised integers), a share far below the others, one dataset, and random ones of every
    size the compiled loop specialises and a few past it."""
    rng = np.random.default_rng(0)
    fixed = [[1.0], [0.5, 0.5], [0.5, 0.25, 0.25], [0.25] * 4, order.normalise([1, 1, 1]),
             order.normalise([5, 1, 1]), order.normalise([1] * 7), order.normalise([3, 1e-6, 2]),
             [0.1, 0.2, 0.3, 0.4], order.normalise([2, 1] * 9)]  # fmt: skip
    randoms = [order.normalise(rng.dirichlet(np.ones(n))) for n in [*range(2, 25), 40, 100]]
    # integers normalised: the shares' float rounding ties some deficits and not others
    ints = [order.normalise(rng.integers(1, 5, n)) for n in (3, 6, 12, 20)]
    return fixed + randoms + ints


def test_the_compiled_loop_is_used():
    fn, why = blend_native.load()
    assert fn is not None, why  # a C compiler is part of the image; without one, say so here


@pytest.mark.parametrize("size", [1, 2, 3, 1000, 200_003])
def test_equals_megatrons_helper(size):
    for weights in weight_sets():
        want = megatron(weights, size)
        got = order.blending_indices(weights, size)
        assert got[0].dtype == np.int16 and got[1].dtype == np.int64
        assert np.array_equal(got[0], want[0]), (weights, size)
        assert np.array_equal(got[1], want[1]), (weights, size)


def test_the_plain_scan_equals_megatrons_helper():
    """The loop a CPU without AVX2 runs past 20 datasets (here, any number of them)."""
    scan = blend_native.scan_function()
    for weights in weight_sets()[::3]:
        want = megatron(weights, 20_000)
        ds, local = np.empty(20_000, np.int16), np.empty(20_000, np.int64)
        w = np.asarray(weights, np.float64)
        blend_native.blend_into(scan, w, np.zeros(len(w)), 0, ds, local)
        assert np.array_equal(ds, want[0]) and np.array_equal(local, want[1]), weights


def test_blocks_join_into_the_index():
    for weights in weight_sets()[::4]:
        want = megatron(weights, 20_000)
        for size, block in ((300, 1), (20_000, 7), (20_000, 4096), (20_000, 1 << 20)):
            ds, local = map(np.concatenate, zip(*order.blending_blocks(weights, size, block)))
            assert np.array_equal(ds, want[0][:size]), block
            assert np.array_equal(local, want[1][:size]), block


def test_without_a_compiler_the_python_loop_gives_the_same(monkeypatch, capsys):
    monkeypatch.setenv("CC", "no-such-cc")
    monkeypatch.setenv("MEGALITE_CACHE", "/nonexistent-megalite-cache")
    monkeypatch.setattr(blend_native, "_loaded", [])
    monkeypatch.setattr(order, "SLOW_NOTICE", 100)
    monkeypatch.setattr(order, "_told", [])
    assert blend_native.load() == (None, "no C compiler (no-such-cc) found")
    for weights in weight_sets()[:12]:
        want = megatron(weights, 3000)
        got = order.blending_indices(weights, 3000)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), weights
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and "no C compiler (no-such-cc) found: the blend index is built" in err
    )


def test_compiled_once_into_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("MEGALITE_CACHE", str(tmp_path))
    monkeypatch.setattr(blend_native, "_loaded", [])
    fn, why = blend_native.load()
    assert fn is not None and why is None
    assert [p.name for p in (tmp_path / "native").iterdir()] == [blend_native.library_path().name]
    monkeypatch.setattr(blend_native, "_loaded", [])
    monkeypatch.setattr(blend_native, "_compile", lambda out: pytest.fail("compiled again"))
    assert blend_native.load()[0] is not None  # the cached library, loaded as it is
