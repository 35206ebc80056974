"""The blend index's greedy loop in C, compiled on first use and cached.

Each pick of Megatron's blending rule depends on every count before it, so no numpy expression
computes it; a Python loop takes 0.4-0.8 µs a sample. The loop below takes a few ns: it is
compiled once per machine with the system's C compiler (`$CC`, else `cc`) into the megalite
cache (`$MEGALITE_CACHE`, else `$XDG_CACHE_HOME/megalite`, else ~/.cache/megalite), keyed by
its source, and called through ctypes: no Python headers, pybind11 or build step at install.
Without a compiler the caller falls back to the Python loop (`load()` returns None and says why).

Exactness: the pick is argmax_k (w_k * x - c_k) in IEEE double, x = max(i, 1), the first on a
tie, as megatron-core's helpers.cpp computes it: compiled with -ffp-contract=off (no fused
multiply-subtract, which would round differently) and without -ffast-math. The counts are kept
as doubles, which hold every integer below 2**53 exactly. For 2 to 8 datasets the loop is
specialised so the counts stay in registers and the argmax has no branch to mispredict.
"""

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
from hashlib import sha256
from pathlib import Path

import numpy as np

from megalite.data.gpt2_bpe import cache_dir

_HEAD = r"""
#include <stdint.h>

/* Samples [start, end) of the blend: the dataset of each (ds) and its sample id there (local),
   written from index 0 of the outputs; counts[n] in/out, the samples taken so far. */

/* Any n: four interleaved scans (k = j mod 4), each keeping its first largest, merged with
   the lower index kept on a tie, so the chain of dependent compares is n/4 long. */
static void blend_any(const double *w, int n, int64_t start, int64_t end, double *c,
                      int16_t *ds, int64_t *local)
{
    for (int64_t i = start; i < end; ++i) {
        const double x = i > 0 ? (double)i : 1.0;
        double m[4];
        int id[4];
        for (int j = 0; j < 4; ++j) { m[j] = w[j] * x - c[j]; id[j] = j; }
        int k = 4;
        for (; k + 4 <= n; k += 4) {
            for (int j = 0; j < 4; ++j) {
                const double e = w[k + j] * x - c[k + j];
                const int gt = e > m[j];
                m[j] = gt ? e : m[j];
                id[j] = gt ? k + j : id[j];
            }
        }
        for (; k < n; ++k) {
            const double e = w[k] * x - c[k];
            const int j = k & 3, gt = e > m[j];
            m[j] = gt ? e : m[j];
            id[j] = gt ? k : id[j];
        }
        double best_e = m[0];
        int best = id[0];
        for (int j = 1; j < 4; ++j) {
            const int better = m[j] > best_e || (m[j] == best_e && id[j] < best);
            best_e = better ? m[j] : best_e;
            best = better ? id[j] : best;
        }
        ds[i - start] = (int16_t)best;
        local[i - start] = (int64_t)c[best];
        c[best] += 1.0;
    }
}
"""


def _blend_n(n: int) -> str:
    """C of the loop for n datasets, every weight and count a local (a register), no branch:
    the argmax is a tree of pairwise picks, the lower indices always on the left and kept on a
    tie (the first of the largest, as a scan keeps it), log2(n) steps deep instead of n - 1;
    each pick an integer select on one compare and the larger value (maxsd: which of two equal
    values it keeps does not matter, a later compare sees them alike)."""
    ks = range(n)
    body = [f"const double w{k} = w[{k}]; int64_t c{k} = (int64_t)c[{k}];" for k in ks]
    loop = ["const double x = i > 0 ? (double)i : 1.0;"]
    loop += [f"const double e_{k} = w{k} * x - (double)c{k}; const int64_t v_{k} = c{k}, d_{k} = {k};"
             for k in ks]  # fmt: skip
    nodes = [str(k) for k in ks]
    while len(nodes) > 1:
        nxt = []
        for a, b in zip(nodes[::2], nodes[1::2]):
            t = f"{a}_{b}"
            loop.append(f"const int64_t g{t} = -(int64_t)(e_{b} > e_{a});")
            loop.append(f"const double e_{t} = e_{a} > e_{b} ? e_{a} : e_{b};")
            loop.append(f"const int64_t v_{t} = v_{a} ^ ((v_{a} ^ v_{b}) & g{t});")
            loop.append(f"const int64_t d_{t} = d_{a} ^ ((d_{a} ^ d_{b}) & g{t});")
            nxt.append(t)
        nodes = nxt + ([nodes[-1]] if len(nodes) % 2 else [])
    r = nodes[0]
    loop += [f"ds[i - start] = (int16_t)d_{r};", f"local[i - start] = v_{r};"]
    loop += [f"c{k} += d_{r} == {k};" for k in ks]
    return "\n".join(
        [f"static void blend_{n}(const double *w, int64_t start, int64_t end, double *c,",
         "                       int16_t *ds, int64_t *local)", "{", *body,
         "for (int64_t i = start; i < end; ++i) {", *loop, "}",
         *[f"c[{k}] = (double)c{k};" for k in ks], "}", ""]
    )  # fmt: skip


SPECIALISED = 16  # n up to this gets its own loop


def source() -> str:
    cases = "".join(f"case {n}: blend_{n}(w, start, end, c, ds, local); break;\n"
                    for n in range(1, SPECIALISED + 1))  # fmt: skip
    return "".join([
        _HEAD, *map(_blend_n, range(1, SPECIALISED + 1)),
        "void megalite_blend(const double *w, int32_t n, int64_t start, int64_t end, double *c,\n"
        "                    int16_t *ds, int64_t *local)\n{\nswitch (n) {\n", cases,
        "default: blend_any(w, n, start, end, c, ds, local);\n}\n}\n",
    ])  # fmt: skip


SOURCE = source()
FLAGS = ["-O3", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math", "-std=c99"]
_loaded: list = []  # [the function, or None and why not], once per process


def library_path() -> Path:
    key = sha256((SOURCE + " ".join(FLAGS) + sys.platform).encode()).hexdigest()[:16]
    return cache_dir() / "native" / f"blend-{key}.so"


def _compile(out: Path) -> str | None:
    """Compile SOURCE to `out` (written aside, renamed into place); None, or why it failed."""
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        return f"no C compiler ({cc}) found"
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".blend-", dir=out.parent) as tmp:
        src, so = Path(tmp) / "blend.c", Path(tmp) / "blend.so"
        src.write_text(SOURCE)
        try:
            r = subprocess.run([cc, *FLAGS, "-o", str(so), str(src)], capture_output=True,
                               text=True, timeout=120)  # fmt: skip
        except (OSError, subprocess.SubprocessError) as e:
            return f"{cc} failed ({e})"
        if r.returncode:
            return f"{cc} failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}"
        os.replace(so, out)  # atomic: a concurrent process loads a whole file or compiles too
    return None


def _load():
    path = library_path()
    why = None
    if not path.is_file():
        try:
            why = _compile(path)
        except OSError:  # the cache cannot be written: compile for this process only
            path = Path(tempfile.mkdtemp(prefix="megalite-native-")) / path.name
            why = _compile(path)
    if why:
        return None, why
    try:
        fn = ctypes.CDLL(str(path)).megalite_blend
    except OSError as e:
        return None, f"cannot load {path} ({e})"
    fn.restype = None
    dbl, i64 = ctypes.POINTER(ctypes.c_double), ctypes.c_int64
    fn.argtypes = [dbl, ctypes.c_int32, i64, i64, dbl, ctypes.POINTER(ctypes.c_int16),
                   ctypes.POINTER(ctypes.c_int64)]  # fmt: skip
    return fn, None


def load():
    """(the compiled function, None), or (None, why not): tried once per process."""
    if not _loaded:
        _loaded.extend(_load())
    return tuple(_loaded)


def blend_into(fn, weights: np.ndarray, counts: np.ndarray, start: int, ds: np.ndarray,
               local: np.ndarray) -> None:  # fmt: skip
    """Samples [start, start + len(ds)) into ds (int16) and local (int64), counts (float64, the
    samples of each dataset taken before `start`) advanced past them."""
    assert weights.dtype == counts.dtype == np.float64 and ds.dtype == np.int16
    assert local.dtype == np.int64 and len(ds) == len(local)
    assert weights.flags.c_contiguous and ds.flags.c_contiguous and local.flags.c_contiguous
    as_ptr = np.ctypeslib.as_ctypes_type
    fn(weights.ctypes.data_as(ctypes.POINTER(as_ptr(np.float64))), len(weights), start,
       start + len(ds), counts.ctypes.data_as(ctypes.POINTER(as_ptr(np.float64))),
       ds.ctypes.data_as(ctypes.POINTER(ctypes.c_int16)),
       local.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)))  # fmt: skip
