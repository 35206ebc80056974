"""What every kernel file shares: a guarded `import triton`, support checks, warn-once fallback.

Importing megalite must never depend on Triton working, so when `import triton` fails the names
`triton` and `tl` become a stub that lets the `@triton.jit` definitions execute (and do nothing);
`unsupported()` then reports the failure and every op falls back to its torch reference.
"""

import os
import warnings

import torch


class _Missing:
    """Stands in for `triton` / `triton.language`: any attribute or call yields the stub itself."""

    def __getattr__(self, name):
        return self

    def __call__(self, *args, **kwargs):
        return self


try:
    import triton
    import triton.language as tl

    TRITON_ERROR = None
except Exception as e:  # noqa: BLE001 - a broken install can raise anything, not just ImportError
    triton = tl = _Missing()
    TRITON_ERROR = f"{type(e).__name__}: {e}"

# Triton reads TRITON_INTERPRET when a kernel is decorated (i.e. when our modules are imported),
# so this is the mode every kernel in this process runs in.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# Elements per tile that the interpreter's row kernels aim for (see rows_per_program).
INTERPRET_TILE = 2**14

_warned: set[tuple[str, str]] = set()


@triton.jit
def program_rows(n_rows, ROWS: tl.constexpr):
    """This program's ROWS rows of a row kernel (1 on a GPU, see rows_per_program): their
    indices clamped to the last row for loads (rows past the end re-read it and are never
    stored), as int64 since row * stride passes 2^31 at large tokens x width (4 x 8192 x 128256
    logits), and which of them are real rows."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    return tl.minimum(r, n_rows - 1).to(tl.int64), r < n_rows


def warn_once(op: str, reason: str) -> None:
    if (op, reason) not in _warned:
        _warned.add((op, reason))
        warnings.warn(f"megalite.kernels.{op}: {reason}; using the torch reference", stacklevel=3)


def unsupported(*tensors: torch.Tensor) -> str | None:
    """Why these tensors cannot go through a Triton kernel here, or None if they can."""
    if TRITON_ERROR is not None:
        return f"triton is unavailable ({TRITON_ERROR})"
    for t in tensors:
        if t.dim() == 0 or t.numel() == 0:
            return "empty or 0-dim tensors are not supported"
        if t.device.type == "cpu" and not INTERPRET:
            return "CPU tensors need TRITON_INTERPRET=1 set before triton is imported"
        if t.device.type not in ("cpu", "cuda"):
            return f"device {t.device.type} is not supported"
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return f"dtype {t.dtype} is not supported"
        if t.dtype == torch.bfloat16 and t.device.type == "cpu":
            # The interpreter's tl.dot and fp32->bf16 stores are not faithful for bf16.
            return "bf16 is not supported by the Triton CPU interpreter"
    return None


def rows(x: torch.Tensor) -> torch.Tensor:
    """(..., n) -> (rows, n) with unit stride along n; a view when strides allow, else a copy."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 or x2.shape[-1] == 1 else x2.contiguous()


def row_block(n: int) -> tuple[int, int]:
    """Block size holding a whole row of n elements, and warps to spread it over."""
    block = triton.next_power_of_2(n)
    return block, min(max(block // 256, 1), 16)


def rows_per_program(n_rows: int, block: int) -> int:
    """Rows one program of a row kernel takes, given its block of columns.

    Compiled: 1, the GPU choice (thousands of programs run at once). Under the interpreter: as
    many as fill a tile of about 2**14 elements, since the interpreter's cost is per program and
    per op, not per element (one row per program made the tiny preset take minutes a step).
    """
    if not INTERPRET:
        return 1
    return min(triton.next_power_of_2(n_rows), max(1, INTERPRET_TILE // block))


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """Upcast for the references: fp16/bf16 -> fp32, while fp64 (the tests' exact path) stays."""
    return x.to(torch.promote_types(x.dtype, torch.float32))
