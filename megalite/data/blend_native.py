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
as doubles, which hold every integer below 2**53 exactly. Up to 20 datasets each count has a
loop of its own (the counts in registers, the argmax a tree of branch-free picks); past 20, 8
AVX2 lanes where the CPU has AVX2 (x86-64), else the plain scan. All of them equal megatron-core's
helper element for element (tests/unit/test_blend_index.py); 0.2-0.6x its time at 10^8 samples
(docs/bench_data.md). The library is keyed by the source, the flags and the machine's
architecture, so a home directory shared by x86 and ARM nodes keeps one for each.
"""

import ctypes
import os
import platform
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
#include <stdlib.h>

/* Samples [start, end) of the blend: the dataset of each (ds) and its sample id there (local),
   written from index 0 of the outputs; c[n] in/out, the samples taken so far (as doubles). */

/* Any n: Megatron's scan with the counts kept as doubles. */
static void blend_scan(const double *restrict w, int n, int64_t start, int64_t end,
                       double *restrict c, int16_t *restrict ds, int64_t *restrict local)
{
    for (int64_t i = start; i < end; ++i) {
        const double x = i > 0 ? (double)i : 1.0;
        double best_e = w[0] * x - c[0];
        int best = 0;
        for (int k = 1; k < n; ++k) {
            const double e = w[k] * x - c[k];
            if (e > best_e) { best_e = e; best = k; }
        }
        ds[i - start] = (int16_t)best;
        local[i - start] = (int64_t)c[best];
        c[best] += 1.0;
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#define HAVE_AVX2_PATH 1
typedef double v4d __attribute__((vector_size(32)));
typedef int64_t v4i __attribute__((vector_size(32)));

/* Many datasets on a CPU with AVX2: eight lanes (two vectors of four), lane j keeping the
   first largest of the k = j mod 8, the lanes merged with the lower index kept on a tie.
   Padding datasets have weight 0 and count +inf: a deficit of -inf, never picked. */
__attribute__((target("avx2"))) static int blend_lanes(
    const double *w_in, int n, int64_t start, int64_t end, double *c_io, int16_t *ds,
    int64_t *local)
{
    const int groups = (n + 7) / 8, m = groups * 8;
    v4d *w = aligned_alloc(32, m * sizeof(double)), *c = aligned_alloc(32, m * sizeof(double));
    if (!w || !c) { free(w); free(c); return 0; }
    double *wd = (double *)w, *cd = (double *)c;
    for (int k = 0; k < m; ++k) {
        wd[k] = k < n ? w_in[k] : 0.0;
        cd[k] = k < n ? c_io[k] : __builtin_inf();
    }
    const v4i lane0 = {0, 1, 2, 3}, lane1 = {4, 5, 6, 7};
    for (int64_t i = start; i < end; ++i) {
        const double xs = i > 0 ? (double)i : 1.0;
        const v4d x = {xs, xs, xs, xs};
        v4d m0 = w[0] * x - c[0], m1 = w[1] * x - c[1];
        v4i i0 = lane0, i1 = lane1;
        for (int g = 1; g < groups; ++g) {
            const v4d e0 = w[2 * g] * x - c[2 * g], e1 = w[2 * g + 1] * x - c[2 * g + 1];
            const v4i g0 = e0 > m0, g1 = e1 > m1, k0 = lane0 + 8 * g, k1 = lane1 + 8 * g;
            m0 = (v4d)(((v4i)e0 & g0) | ((v4i)m0 & ~g0));
            m1 = (v4d)(((v4i)e1 & g1) | ((v4i)m1 & ~g1));
            i0 = (k0 & g0) | (i0 & ~g0);
            i1 = (k1 & g1) | (i1 & ~g1);
        }
        double best_e = m0[0];
        int64_t best = i0[0];
        for (int j = 1; j < 8; ++j) {
            const double e = j < 4 ? m0[j] : m1[j - 4];
            const int64_t id = j < 4 ? i0[j] : i1[j - 4];
            const int better = (e > best_e) | ((e == best_e) & (id < best));
            best_e = better ? e : best_e;
            best = better ? id : best;
        }
        ds[i - start] = (int16_t)best;
        local[i - start] = (int64_t)cd[best];
        cd[best] += 1.0;
    }
    for (int k = 0; k < n; ++k) c_io[k] = cd[k];
    free(w);
    free(c);
    return 1;
}
#endif

/* Two datasets: every count an integer in a register, the pick a select on one compare. */
static void blend_2(const double *restrict w, int64_t start, int64_t end, double *restrict c,
                    int16_t *restrict ds, int64_t *restrict local)
{
    const double w0 = w[0], w1 = w[1];
    int64_t c0 = (int64_t)c[0], c1 = (int64_t)c[1];
    for (int64_t i = start; i < end; ++i) {
        const double x = i > 0 ? (double)i : 1.0;
        const double e0 = w0 * x - (double)c0, e1 = w1 * x - (double)c1;
        const int64_t g = -(int64_t)(e1 > e0);
        ds[i - start] = (int16_t)(g & 1);
        local[i - start] = c0 ^ ((c0 ^ c1) & g);
        c0 += !g;
        c1 += g & 1;
    }
    c[0] = (double)c0;
    c[1] = (double)c1;
}
"""


def _blend_n(n: int) -> str:
    """C of the loop for n datasets, every weight and count a local (a register): the argmax is
    a tree of pairwise picks, the lower indices always on the left and kept on a tie (the first
    of the largest, as a scan keeps it), log2(n) steps deep instead of n - 1, each an integer
    select on one compare beside the larger value (maxsd: which of two equal values it keeps
    does not matter, a later compare sees them alike). A count grows by a table's 0.0 or 1.0."""
    ks = range(n)
    out = [f"static void blend_{n}(const double *restrict w, int64_t start, int64_t end,",
           "    double *restrict c, int16_t *restrict ds, int64_t *restrict local)", "{",
           "static const double step[2] = {0.0, 1.0};", f"int64_t taken[{n}];"]  # fmt: skip
    out += [f"const double w{k} = w[{k}]; double c{k} = c[{k}]; taken[{k}] = (int64_t)c{k};"
            for k in ks]  # fmt: skip
    out += ["for (int64_t i = start; i < end; ++i) {", "const double x = i > 0 ? (double)i : 1.0;"]
    out += [f"const double e_{k} = w{k} * x - c{k}; const int d_{k} = {k};" for k in ks]
    nodes = [str(k) for k in ks]
    while len(nodes) > 1:
        pairs = list(zip(nodes[::2], nodes[1::2]))
        for a, b in pairs:
            out.append(f"const int d_{a}_{b} = e_{b} > e_{a} ? d_{b} : d_{a};")
            out.append(f"const double e_{a}_{b} = e_{a} > e_{b} ? e_{a} : e_{b};")
        nodes = [f"{a}_{b}" for a, b in pairs] + ([nodes[-1]] if len(nodes) % 2 else [])
    r = nodes[0]
    out += [f"ds[i - start] = (int16_t)d_{r};", f"local[i - start] = taken[d_{r}]++;"]
    out += [f"c{k} += step[d_{r} == {k}];" for k in ks]
    out += ["}", *[f"c[{k}] = c{k};" for k in ks], "}", ""]
    return "\n".join(out)


SPECIALISED = (1, *range(3, 21))  # n with a loop of its own (2: blend_2; past 20: lanes/scan)


def source() -> str:
    cases = "".join(f"case {n}: blend_{n}(w, start, end, c, ds, local); return;\n"
                    for n in SPECIALISED)  # fmt: skip
    return "".join([
        _HEAD, *map(_blend_n, SPECIALISED),
        "void megalite_blend(const double *w, int32_t n, int64_t start, int64_t end, double *c,\n"
        "                    int16_t *ds, int64_t *local)\n{\nswitch (n) {\n", cases,
        "case 2: blend_2(w, start, end, c, ds, local); return;\n}\n",
        "#ifdef HAVE_AVX2_PATH\n",
        "__builtin_cpu_init();\n"
        "if (__builtin_cpu_supports(\"avx2\") && blend_lanes(w, n, start, end, c, ds, local))\n"
        "    return;\n#endif\n",
        "blend_scan(w, n, start, end, c, ds, local);\n}\n",
        "void megalite_blend_scan(const double *w, int32_t n, int64_t start, int64_t end,\n"
        "                         double *c, int16_t *ds, int64_t *local)\n"
        "{\nblend_scan(w, n, start, end, c, ds, local);\n}\n",  # for the tests: the plain scan
    ])  # fmt: skip


SOURCE = source()
FLAGS = ["-O2", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math", "-std=gnu11"]
_loaded: list = []  # [the function, or None and why not], once per process


def library_path() -> Path:
    arch = f"{sys.platform} {platform.machine()}"
    key = sha256((SOURCE + " ".join(FLAGS) + arch).encode()).hexdigest()[:16]
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
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return None, f"cannot load {path} ({e})"
    dbl, i64 = ctypes.POINTER(ctypes.c_double), ctypes.c_int64
    for fn in (lib.megalite_blend, lib.megalite_blend_scan):
        fn.restype = None
        fn.argtypes = [dbl, ctypes.c_int32, i64, i64, dbl, ctypes.POINTER(ctypes.c_int16),
                       ctypes.POINTER(ctypes.c_int64)]  # fmt: skip
    return lib, None


def load():
    """(the compiled function, None), or (None, why not): tried once per process."""
    if not _loaded:
        _loaded.extend(_load())
    lib, why = _loaded
    return (lib.megalite_blend if lib else None), why


def scan_function():
    """The compiled plain scan (what CPUs without AVX2 run past 20 datasets), for the tests."""
    lib = load()[0] and _loaded[0]
    return lib.megalite_blend_scan if lib else None


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
