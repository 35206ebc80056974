"""Ahead-of-time kernel check: every Triton kernel compiled for real GPUs, without one.

For each architecture (aot_capture.ARCHS) the launchers run on fake CUDA tensors with that
device's properties (aot_cases), their launches are recorded, and each distinct launch is
compiled as the JIT would compile it there: triton's own binder types and specializes the
recorded arguments, `triton.compile` builds PTX, and the wheel's `ptxas-blackwell -v` (the
older bundled ptxas refuses Triton's PTX) reports registers and spills. Shared memory is the
compiled kernel's own figure (Triton allocates it dynamically). A compile error, or shared
memory over the architecture's per-block limit, is a failure; spills are reported.

    python tools/check_kernels.py [--full] [--arch sm_80 ...] [--write docs/kernels.md]

Runs in a process without TRITON_INTERPRET (main() re-runs itself in one when it is set).
Compiled kernels are cached by triton, ptxas reports under triton's cache dir, so a second
run takes seconds.
"""

import argparse
import hashlib
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from megalite.kernels.aot_capture import ARCHS, Arch, Launch, capture

DEFAULT_ARCHS = ("sm_80", "sm_90a", "sm_100a")


@dataclass
class Result:
    kernel: str
    config: str  # constexprs and options that distinguish this compile
    case: str  # first scenario that launched it
    arch: str
    regs: int = 0
    spill: int = 0  # bytes of spill stores
    smem: int = 0  # bytes of shared memory per block
    error: str = ""

    def failure(self, limit: int) -> str | None:
        if self.error:
            return f"{self.arch} {self.kernel} [{self.config}] ({self.case}): {self.error}"
        if self.smem > limit:
            return (f"{self.arch} {self.kernel} [{self.config}] ({self.case}): {self.smem} bytes "
                    f"of shared memory > {limit}")  # fmt: skip
        return None


def _target(arch: Arch):
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", arch.capability, 32)


def _ptxas() -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas-blackwell")


def _cache_dir() -> Path:
    base = os.environ.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache")
    path = Path(base) / "megalite-ptxas"
    path.mkdir(parents=True, exist_ok=True)
    return path


def ptxas_report(ptx: str, arch: str) -> tuple[int, int]:
    """(registers, spill-store bytes) of the PTX's kernel, from `ptxas -v` (cached by hash)."""
    key = hashlib.sha256(f"{arch}\n{ptx}".encode()).hexdigest()[:32]
    cached = _cache_dir() / f"{key}.txt"
    if cached.exists():
        log = cached.read_text()
    else:
        src = _cache_dir() / f"{key}.ptx"
        src.write_text(ptx)
        run = subprocess.run(
            [_ptxas(), f"-arch={arch}", "-v", str(src), "-o", os.devnull],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        src.unlink()
        log = run.stdout + run.stderr
        if run.returncode:
            raise RuntimeError(f"ptxas: {log.strip().splitlines()[-1] if log.strip() else '?'}")
        cached.write_text(log)
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores", log)
    return int(regs.group(1)) if regs else 0, int(spill.group(1)) if spill else 0


def _bind(launch: Launch, backend):
    """What the JIT would compile for these arguments on `backend`: (signature, constexprs,
    attrs, options), through triton's binder."""
    from triton.runtime.jit import create_function_from_signature

    fn = launch.fn
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, opts = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, launch.kwargs, bound, spec, opts)
    return signature, constexprs, attrs, options


def _config(fn, signature: dict, constexprs: dict, options) -> str:
    names = [p.name for p in fn.params]
    # The pointer arguments' types, run-length coded: "bf16x3 fp32x2 i64x4 i32x2".
    runs: list[list] = []
    for t in (str(t)[1:] for t in signature.values() if str(t).startswith("*")):
        if runs and runs[-1][0] == t:
            runs[-1][1] += 1
        else:
            runs.append([t, 1])
    ptrs = " ".join(f"{t}x{n}" if n > 1 else t for t, n in runs)
    consts = ", ".join(
        f"{names[path[0]]}={val}" for path, val in constexprs.items()
        if len(path) == 1 and not isinstance(val, type(None))
    )  # fmt: skip
    return f"{ptrs}; {consts}; warps={options.num_warps} stages={options.num_stages}"


def compile_launches(launches: list[Launch], arch: Arch) -> list[Result]:
    """Compile each distinct launch for `arch`; one Result per distinct compile."""
    import triton
    from triton.compiler import ASTSource, make_backend

    target = _target(arch)
    backend = make_backend(target)
    seen, results = set(), []
    for launch in launches:
        name = launch.fn.fn.__name__
        try:
            signature, constexprs, attrs, options = _bind(launch, backend)
        except Exception as e:  # noqa: BLE001 - a launch the binder refuses is a failure too
            results.append(Result(name, "?", launch.case, arch.name, error=_short(e)))
            continue
        key = (name, repr(sorted(signature.items())), repr(constexprs), repr(attrs),
               repr(sorted(options.__dict__.items())))  # fmt: skip
        if key in seen:
            continue
        seen.add(key)
        res = Result(
            name, _config(launch.fn, signature, constexprs, options), launch.case, arch.name
        )
        try:
            src = ASTSource(launch.fn, signature, constexprs, attrs)
            compiled = triton.compile(src, target=target, options=options.__dict__)
            res.smem = compiled.metadata.shared
            res.regs, res.spill = ptxas_report(compiled.asm["ptx"], arch.name)
        except Exception as e:  # noqa: BLE001 - report every kernel's failure, not the first
            res.error = _short(e)
        results.append(res)
    return results


def _short(e: Exception) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[-1][:300] if lines else ''}"


def check(cases, archs) -> tuple[list[Result], list[str]]:
    """Capture `cases` ((name, thunk) pairs) on each arch, compile; (results, failures)."""
    results, failures = [], []
    for name in archs:
        arch = ARCHS[name]
        with capture(arch) as rec:
            for case, thunk in cases:
                rec.case = case
                try:
                    thunk()
                except Exception as e:  # noqa: BLE001 - a launcher that fails is a failure
                    failures.append(f"{name} {case}: the launcher raised {_short(e)}")
        for res in compile_launches(rec.launches, arch):
            results.append(res)
            if (msg := res.failure(arch.smem)) is not None:
                failures.append(msg)
    return results, failures


def table(results: list[Result], archs) -> str:
    """Markdown: one row per kernel configuration, one column per architecture."""
    rows: dict[tuple, dict] = {}
    for r in results:
        rows.setdefault((r.kernel, r.config), {"case": r.case})[r.arch] = r
    head = "| kernel | pointers; constexprs; options | first case | " + " | ".join(archs) + " |"
    out = [head, "|" + " --- |" * (3 + len(archs))]
    for (kernel, config), cells in sorted(rows.items()):
        line = f"| {kernel} | {config} | {cells['case']} |"
        for a in archs:
            r = cells.get(a)
            if r is None:
                line += " - |"
            elif r.error:
                line += " **error** |"
            else:
                spill = f", **{r.spill} B spill**" if r.spill else ""
                line += f" {r.regs} regs{spill}, {r.smem / 1024:.1f} KiB |"
        out.append(line)
    return "\n".join(out) + "\n"


def summary(results: list[Result], archs) -> str:
    lines = []
    for a in archs:
        mine = [r for r in results if r.arch == a and not r.error]
        if not mine:
            continue
        spills = [r for r in mine if r.spill]
        top = max(mine, key=lambda r: r.smem)
        lines.append(
            f"- {a}: {len(mine)} compiles, {len(spills)} with spills"
            + (f" (max {max(r.spill for r in spills)} B)" if spills else "")
            + f"; most shared memory {top.smem / 1024:.1f} KiB ({top.kernel}) of"
            f" {ARCHS[a].smem // 1024} KiB; most registers {max(r.regs for r in mine)}"
        )
    return "\n".join(lines) + "\n"


def write_doc(path: Path, results, archs, full: bool) -> None:
    """Replace the generated part of docs/kernels.md (between the markers), keep the rest."""
    begin, end = "<!-- aot-table begin -->", "<!-- aot-table end -->"
    body = (f"{begin}\n\nGenerated by `python tools/check_kernels.py{' --full' if full else ''}"
            f" --write {path}`.\n\n{summary(results, archs)}\n{table(results, archs)}\n{end}")  # fmt: skip
    text = path.read_text() if path.exists() else ""
    if begin in text and end in text:
        text = text[: text.index(begin)] + body + text[text.index(end) + len(end) :]
    else:
        text = text + ("\n" if text else "") + body + "\n"
    path.write_text(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="the whole sweep (default: quick set)")
    p.add_argument("--arch", nargs="+", default=list(DEFAULT_ARCHS), choices=sorted(ARCHS))
    p.add_argument("--write", type=Path, help="update this markdown file's table")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        cmd = [sys.executable, "-m", "megalite.kernels.aot", *(argv or sys.argv[1:])]
        return subprocess.run(cmd, env=env).returncode
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # today's default, without a warning
    from megalite.kernels.aot_cases import cases

    results, failures = check(cases(args.full), args.arch)
    print(summary(results, args.arch), end="")
    if args.write:
        write_doc(args.write, results, args.arch, args.full)
    for f in failures:
        print("FAIL", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
