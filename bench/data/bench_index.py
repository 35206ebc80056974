"""The sample-order index build (document, sample and shuffle indices) beside megatron-core's.

    python bench/data/bench_index.py --dir DIR \\
        [--samples 100000000] [--seq 2048] [--docs 2000000] [--rounds 3]

One dataset in Megatron's format (`--docs` documents of 1..2*`--mean` tokens, lengths from a
fixed seed; the .bin is a sparse file, the build reads only the lengths) is indexed for
`--samples` training samples by megatron-core's GPTDataset (its C++ helper for the sample index,
numpy for the shuffles, np.save) and by megalite's GPTDataset, each in its own process, into a
fresh cache directory, the two sides alternating which goes first each round. Per side: the
build's wall time (the dataset's construction, files written) and its peak RSS (VmHWM, reset
once the data is open, so imports are not counted: megatron-core brings torch). The arrays of
the last round are compared element for element, so the samples are equal. Targets (issue 44):
megalite's time (the median of the rounds' ratios) and peak <= 1.0x megatron-core's. Needs
megatron-core (a dev dependency); without it only megalite's side runs. The directory is removed afterwards unless --keep.

    python bench/data/bench_index.py --blend [--samples 100000000] [--datasets 2,4,10,32] [--rounds 3]

The blend index instead (which dataset, and which of its samples, each blend sample is), for
blends of each --datasets count (fixed weights: 0.3/0.7, 0.1..0.4, else Dirichlet draws of a
fixed seed): megatron-core's compiled helper (`build_blending_indices` into the two arrays its
BlendedDataset allocates) against megalite's `blending_indices` (blend_native's compiled loop),
each in its own process, sides alternating, VmHWM reset after the imports and one tiny warm-up
call (the helpers loaded, megalite's compiled once into its cache beforehand). Then the same
into the cache: Megatron's arrays + np.save (its BlendedDataset with a cache path) against
megalite's BlendedDataset build (blocks straight to the .npy files). The arrays of the last
round are compared by digest. Targets (issue 54): time (median of the rounds' ratios) and peak
<= 1.0x megatron-core's, arrays equal.
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench._common import figure, machine, memory, reset_peak, timed, write_summary  # noqa: E402

NAMES = ("document_index", "sample_index", "shuffle_index")
WARM = 1 << 20  # --blend: the warm-up call's samples (the large-array paths taken once)


def make_dataset(prefix: Path, docs: int, mean: int) -> int:
    """Megatron's .idx for `docs` documents (one sequence each) and a sparse .bin; tokens."""
    from megalite.data.megatron_index import write_index

    lengths = np.random.default_rng(0).integers(1, 2 * mean, docs).astype(np.int32)
    with open(f"{prefix}.idx", "wb") as fh:
        write_index(fh, np.dtype(np.uint16), lengths, np.arange(docs + 1))
    tokens = int(lengths.sum(dtype=np.int64))
    with open(f"{prefix}.bin", "wb") as fh:
        fh.truncate(2 * tokens)  # uint16 tokens; never read by an index build
    return tokens


def child(side: str, prefix: str, cache: str, samples: int, seq: int, seed: int) -> dict:
    """Build one side's indices into `cache`; its time and memory as a dict."""
    if side == "megatron":
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
        from megatron.core.datasets.indexed_dataset import IndexedDataset
        from megatron.core.datasets.utils import Split

        class Tok:  # what the builder asks of a tokenizer; no text is read
            vocab_size, eod, unique_identifiers = 50257, 0, {"kind": "bench"}

        indexed = IndexedDataset(prefix)
        cfg = GPTDatasetConfig(random_seed=seed, sequence_length=seq, tokenizer=Tok(),
                               reset_position_ids=False, reset_attention_mask=False,
                               eod_mask_loss=False, path_to_cache=cache, split="100,0,0",
                               blend=([prefix], None))  # fmt: skip
        docs = np.arange(len(indexed.document_indices) - 1, dtype=np.int32)

        def build():
            return GPTDataset(indexed, prefix, docs, samples, Split.train, cfg)
    else:
        from megalite.data.gpt_dataset import GPTDataset, Sequences
        from megalite.data.indexed_dataset import IndexedDataset

        seqs = Sequences.of(IndexedDataset(prefix))

        def build():
            return GPTDataset(seqs, 0, len(seqs.lengths), seq, seed, samples, cache, "gpt-train")

    reset_peak()  # the peak from here on is the build's
    base = memory()["VmRSS"]
    with timed() as t:  # CPU seconds: all threads, user and system
        ds = build()
    return {"side": side, "seconds": t.wall, "cpu": t.cpu, "peak": memory()["VmHWM"] - base,
            "base": base, "samples": len(ds)}  # fmt: skip


def blend_weights(n: int) -> list[float]:
    from megalite.data.sample_order import normalise

    fixed = {2: [0.3, 0.7], 4: [0.1, 0.2, 0.3, 0.4]}
    return normalise(fixed.get(n, np.random.default_rng(n).dirichlet(np.ones(n))))


def blend_child(side: str, n: int, samples: int, out: str | None, digest: bool) -> dict:
    """One side's blend index of `samples` over n datasets (into `out` when given)."""
    import hashlib

    weights = blend_weights(n)
    if side == "megatron":
        from megatron.core.datasets import helpers

        def build():
            ds, local = np.zeros(samples, np.int16), np.zeros(samples, np.int64)
            helpers.build_blending_indices(ds, local, weights, n, samples, False)
            if out:  # what its BlendedDataset does with a cache path
                np.save(Path(out) / "dataset_index.npy", ds, allow_pickle=True)
                np.save(Path(out) / "dataset_sample_index.npy", local, allow_pickle=True)
            return ds, local

        build_small = lambda: helpers.build_blending_indices(  # noqa: E731
            np.zeros(WARM, np.int16), np.zeros(WARM, np.int64), weights, n, WARM, False)  # fmt: skip
    else:
        import torch  # noqa: F401  (as in a training process: the heap megatron-core's side has)

        from megalite.data import index_cache
        from megalite.data import sample_order as order

        def build():
            if not out:
                return order.blending_indices(weights, samples)
            names, dtypes = ("dataset_index", "dataset_sample_index"), (np.int16, np.int64)
            blocks = order.blending_blocks(weights, samples)
            index_cache.save_block_pairs(Path(out), names, samples, dtypes, blocks)
            return None

        build_small = lambda: order.blending_indices(weights, WARM)  # noqa: E731
    build_small()  # the compiled helpers loaded (megalite's compiled into its cache once)
    build_small()  # and twice: the first large arrays leave a page more (both sides alike)
    reset_peak()
    base = memory()["VmRSS"]
    with timed() as t:
        arrays = build()
    seconds, cpu = t.wall, t.cpu
    peak = memory()["VmHWM"] - base
    if out and arrays is None or out and digest:
        arrays = [np.load(Path(out) / f"{a}.npy", mmap_mode="r")
                  for a in ("dataset_index", "dataset_sample_index")]  # fmt: skip
    sums = [hashlib.sha1(np.ascontiguousarray(a)).hexdigest() for a in arrays] if digest else None
    return {"side": side, "seconds": seconds, "cpu": cpu, "peak": peak, "base": base,
            "digest": sums}  # fmt: skip


def blend_main(a) -> None:
    sides = ["megalite", "megatron"] if _megatron_version() else ["megalite"]
    print(f"{machine()}\nmegatron-core {_megatron_version()}; blend index of {a.samples:,} samples")
    work = Path(a.dir or tempfile.mkdtemp(prefix="bench-blend-"))
    figures, lines = [], []
    try:
        for mode in ("memory", "cache"):
            for n in map(int, a.datasets.split(",")):
                res = {s: [] for s in sides}
                for r in range(a.rounds):
                    for side in sides if r % 2 == 0 else sides[::-1]:
                        out = work / f"{side}-{n}"
                        shutil.rmtree(out, ignore_errors=True)
                        out.mkdir(parents=True)
                        cmd = [sys.executable, __file__, "--samples", str(a.samples),
                               "--blend-child", side, str(n), str(out) if mode == "cache" else "",
                               str(int(r == a.rounds - 1))]  # fmt: skip
                        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
                        if p.returncode:
                            sys.exit(f"{side}'s blend failed:\n{p.stderr[-3000:]}")
                        res[side].append(json.loads(p.stdout.strip().splitlines()[-1]))
                        shutil.rmtree(out, ignore_errors=True)
                        x = res[side][-1]
                        print(f"{mode:6s} n={n:<3d} round {r} {side:9s} {x['seconds']:6.2f} s "
                              f"({x['cpu']:.2f} CPU-s) peak {x['peak'] / 2**20:8.1f} MiB", flush=True)  # fmt: skip
                if len(sides) < 2:
                    continue
                rounds = list(zip(res["megalite"], res["megatron"]))
                t = float(np.median([x["seconds"] / y["seconds"] for x, y in rounds]))
                c = float(np.median([x["cpu"] / y["cpu"] for x, y in rounds]))
                m = _mean(res["megalite"], "peak") / max(_mean(res["megatron"], "peak"), 1)
                same = rounds[-1][0]["digest"] == rounds[-1][1]["digest"]
                lines.append(f"{mode:6s} n={n:<3d} time {t:.2f}x (CPU {c:.2f}x; megalite "
                             f"{_mean(res['megalite'], 'seconds'):.2f} s, megatron-core "
                             f"{_mean(res['megatron'], 'seconds'):.2f} s), peak {m:.3f}x "
                             f"({_mean(res['megalite'], 'peak') / 2**20:.0f} vs "
                             f"{_mean(res['megatron'], 'peak') / 2**20:.0f} MiB), arrays "
                             f"{'equal' if same else 'DIFFER'}")  # fmt: skip
                what = f"blend index ({mode}), {n} datasets, vs megatron-core"
                figures += [figure(f"{what}: time", round(t, 2), "x", "<= 1.0", t <= 1.0),
                            figure(f"{what}: peak RSS", round(m, 3), "x", "<= 1.0", m <= 1.0),
                            figure(f"{what}: equal", same, "", "True", same)]  # fmt: skip
        print("megalite / megatron-core (median of the rounds' time ratios):")
        print("\n".join(lines))
        write_summary(a.summary, "bench_index", figures, " ".join(sys.argv))
        if not all(f["met"] for f in figures if "equal" in f["what"]):
            sys.exit("the blend indices differ from megatron-core's")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def arrays(side: str, cache: Path) -> dict[str, Path]:
    if side == "megatron":
        return {n: next(cache.glob(f"*-GPTDataset-train-{n}.npy")) for n in NAMES}
    return {n: next(cache.glob(f"gpt-train-*/{n}.npy")) for n in NAMES}


def equal(a: Path, b: Path, rows: int = 1 << 24) -> bool:
    """The two .npy files hold the same values (memory-mapped, compared a block at a time)."""
    x, y = np.load(a, mmap_mode="r"), np.load(b, mmap_mode="r")
    if x.shape != y.shape:
        return False
    return all(np.array_equal(x[i : i + rows], y[i : i + rows]) for i in range(0, len(x), rows))


def main():
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    p.add_argument("--samples", type=int, default=100_000_000)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--docs", type=int, default=2_000_000, help="documents in the dataset")
    p.add_argument("--mean", type=int, default=2000, help="mean document length in tokens")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    p.add_argument("--summary", default=None)
    p.add_argument("--child", nargs=2, metavar=("SIDE", "CACHE"), help=argparse.SUPPRESS)
    p.add_argument("--blend", action="store_true", help="the blend index instead (see above)")
    p.add_argument("--datasets", default="2,4,10,32", help="--blend: dataset counts")
    p.add_argument("--blend-child", nargs=4, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.blend_child:
        side, n, out, digest = a.blend_child
        print(json.dumps(blend_child(side, int(n), a.samples, out or None, digest == "1")))
        return
    if a.blend:
        return blend_main(a)
    if a.child:
        side, cache = a.child
        print(json.dumps(child(side, a.dir, cache, a.samples, a.seq, a.seed)))
        return

    sides, peer = ["megalite", "megatron"], _megatron_version()
    if peer is None:
        sides = ["megalite"]
        print("megatron-core is not installed: megalite's side only")
    work = Path(a.dir or tempfile.mkdtemp(prefix="bench-index-"))
    work.mkdir(parents=True, exist_ok=True)
    prefix = work / "data_text_document"
    results = {s: [] for s in sides}
    try:
        tokens = make_dataset(prefix, a.docs, a.mean)
        print(f"{machine()}\nmegatron-core {peer}; {a.docs:,} documents, {tokens:,} tokens, "
              f"{a.samples:,} samples at seq {a.seq}")  # fmt: skip
        for r in range(a.rounds):
            order = sides if r % 2 == 0 else sides[::-1]
            for side in order:
                cache = work / f"cache-{side}"
                shutil.rmtree(cache, ignore_errors=True)
                cmd = [sys.executable, __file__, "--dir", str(prefix), "--samples", str(a.samples),
                       "--seq", str(a.seq), "--seed", str(a.seed), "--child", side, str(cache)]  # fmt: skip
                out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
                if out.returncode:
                    sys.exit(f"{side}'s build failed:\n{out.stderr[-3000:]}")
                res = json.loads(out.stdout.strip().splitlines()[-1])
                results[side].append(res)
                print(f"round {r} {side:9s} {res['seconds']:7.1f} s ({res['cpu']:.1f} CPU-s)  peak "
                      f"{res['peak'] / 2**30:6.2f} GiB above {res['base'] / 2**20:.0f} MiB "
                      f"({res['samples']:,} samples)")  # fmt: skip
        figures = [figure("megalite build time", _mean(results["megalite"], "seconds"), "s")]
        if peer:
            same = all(equal(x, y) for x, y in zip(*(arrays(s, work / f"cache-{s}").values()
                                                      for s in sides)))  # fmt: skip
            rounds = list(zip(*results.values()))
            per_round = [a["seconds"] / b["seconds"] for a, b in rounds]
            # the median: one disturbed round on a shared machine moves it least
            t = float(np.median(per_round))
            cpu = float(np.median([a["cpu"] / b["cpu"] for a, b in rounds]))
            m = _mean(results["megalite"], "peak") / _mean(results["megatron"], "peak")
            print(f"megalite / megatron-core: time {t:.2f}x, the median of the rounds' "
                  f"{', '.join(f'{x:.2f}' for x in per_round)} (CPU time {cpu:.2f}x); peak RSS "
                  f"{m:.2f}x; arrays {'equal' if same else 'DIFFER'}")  # fmt: skip
            figures = [
                figure("index build time vs megatron-core", round(t, 2), "x", "<= 1.0", t <= 1.0),
                figure(
                    "index build peak RSS vs megatron-core", round(m, 2), "x", "<= 1.0", m <= 1.0
                ),  # fmt: skip
                figure("indices equal megatron-core's", same, "", "True", same),
            ]
            if not same:
                sys.exit("the indices differ from megatron-core's")
        write_summary(a.summary, "bench_index", figures, " ".join(sys.argv))
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


def _mean(results: list[dict], key: str) -> float:
    return sum(r[key] for r in results) / len(results)


def _megatron_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-core")
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
