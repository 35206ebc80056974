"""FP8 numerics: formats, scaling recipes, the quantise steps and the scaled GEMM that the FP8
linear layers (kernels/fp8_linear.py: an `ops.linear` whose three GEMMs run on FP8 operands)
are made of.

y = x w^T runs on e4m3 x and w; backward's grad_x = g w and grad_w = g^T x run on the output
gradient g in e5m2 (format `hybrid`) or e4m3 (format `e4m3`) and the operands in e4m3. A recipe
says how each operand is scaled into the FP8 range before the cast (`RECIPES`):

- `tensorwise`: one scale per tensor from its current amax (torchao's "tensorwise"), rounded
  down to a power of two unless `pow2=False` (torchao's `round_scales_to_power_of_2`).
- `rowwise`: one scale per row of each GEMM operand along the contracted dim, rounded down to a
  power of two (torchao's "rowwise"); backward re-scales the saved high-precision tensors
  along the other dim.
- `delayed`: one scale per tensor from an amax history of past steps (Transformer Engine's
  delayed scaling), a power of two as tensorwise's; the first step, with no history, scales by
  the current amax. The histories are saved in checkpoints (`restore` reads them back).
- `mxfp8`: blocks of 32 along the contracted dim, each with a power-of-two (e8m0) scale; the
  GEMM is emulated (dequantised, exact, summed in fp32): these are MXFP8's numerics, not its
  speed.

Every layout quantises like one process: a `Fp8Linear` knows which group shards each logical
dim of its GEMMs ("tokens", "in", "out") and max-reduces an amax over the groups that shard the
dims it was taken over before the scale is computed (`reduce_max`, injected by the layer: this
file imports nothing from megalite.parallel). Delayed scaling records each step's amax locally
and `end_step` reduces them all at once after the optimizer step.

The amax and cast steps are a linear's `casts` (`TorchCasts`; on CUDA the fused Triton kernels
of kernels/fp8_cast.py, through `ops.fp8_casts`). With `--fp8-param-gather` ZeRO-3 hands a
linear its weight already in FP8 (`Fp8Linear.gathered`, parallel/fp8_gather.py).
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-12  # amax floor: an all-zero tensor gets a finite scale
MX_BLOCK = 32
_EMAX = {E4M3: 8, E5M2: 15}  # the largest exponent of each format's normal numbers


@dataclass(frozen=True)
class Fp8Format:
    """The FP8 dtypes of the forward operands and of the output gradient."""

    name: str
    forward: torch.dtype
    backward: torch.dtype


FORMATS = {"e4m3": Fp8Format("e4m3", E4M3, E4M3), "hybrid": Fp8Format("hybrid", E4M3, E5M2)}


class Quantised(NamedTuple):
    """FP8 `data` (rows, k) and the fp32 `scale` that dequantises it (data * scale ~ tensor):
    () for a tensor, (rows, 1) per row, (rows, ceil(k/32)) per MX block."""

    data: torch.Tensor
    scale: torch.Tensor

    def t(self) -> "Quantised":  # a per-tensor scale survives a transpose
        return Quantised(self.data.t().contiguous(), self.scale)


def amax_to_scale(amax, dtype, margin=0, pow2=False) -> torch.Tensor:
    """The factor that maps amax to the format's largest value (divided by 2^margin), in fp64
    for a result that does not depend on the device's fp32 division."""
    scale = (torch.finfo(dtype).max / amax.double().clamp(min=EPS) / 2.0**margin).float()
    return torch.exp2(torch.floor(torch.log2(scale))) if pow2 else scale


def cast(t: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    """t * scale saturated to the format's range, rounded to nearest into `dtype`."""
    m = torch.finfo(dtype).max
    return (t.float() * scale).clamp(-m, m).to(dtype)


def quantise_mx_torch(t: torch.Tensor, dtype) -> Quantised:
    """MXFP8 along the last dim of t (rows, k): per block of 32 the OCP MX scale
    2^(floor(log2 amax) - emax), clamped to e8m0's range, and the block cast with it."""
    rows, k = t.shape
    pad = -k % MX_BLOCK
    blocks = torch.nn.functional.pad(t.float(), (0, pad)).view(rows, -1, MX_BLOCK)
    amax = blocks.detach().abs().amax(-1, keepdim=True)  # (rows, k/32, 1)
    exp = (torch.floor(torch.log2(amax.clamp(min=2.0**-127))) - _EMAX[dtype]).clamp(-127, 127)
    scale = torch.exp2(exp)
    data = cast(blocks, scale.reciprocal(), dtype).view(rows, -1)[:, :k]
    return Quantised(data, scale.squeeze(-1))


class TorchCasts:
    """The quantise steps the recipes take, in torch: the CPU path, and the reference of the
    fused Triton kernels (kernels/fp8_cast.py `TRITON_CASTS`, which the ops namespace hands
    an `Fp8Maker` on CUDA: `ops.fp8_casts`)."""

    def __call__(self, t: torch.Tensor, dtype) -> Quantised:
        """t quantised with one scale from its own amax (the steps below, nothing reduced)."""
        scale = amax_to_scale(self.amax(t), dtype)
        return Quantised(self.cast(t, scale, dtype), scale.reciprocal())

    def amax(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().abs().amax().float()

    def cast(self, t: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
        return cast(t, scale, dtype)

    def mx(self, t: torch.Tensor, dtype) -> Quantised:
        return quantise_mx_torch(t, dtype)


TORCH_CASTS = TorchCasts()


def scaled_gemm(a: Quantised, b: Quantised, out_dtype) -> torch.Tensor:
    """a (m, k) @ b (n, k)^T with per-tensor or per-row scales -> (m, n): torch._scaled_mm on
    CUDA (cuBLAS: FP8 products summed in fp32); elsewhere, and for fp64 models, the same FP8
    values times their scales summed in fp64 (each product is exact there) and rounded once."""
    sa = a.scale.reshape(-1, 1) if a.scale.numel() > 1 else a.scale.reshape(())
    sb = b.scale.reshape(1, -1) if b.scale.numel() > 1 else b.scale.reshape(())
    if out_dtype == torch.float64 or a.data.device.type != "cuda":
        # not CPU _scaled_mm: torch 2.13's is a reference loop, ~2000x slower than this GEMM,
        # and the layouts agree as closely with either (docs/fp8.md has the figures)
        y = (a.data.double() * sa.double()) @ (b.data.double() * sb.t().double()).t()
        return y.to(out_dtype)
    return torch._scaled_mm(a.data, b.data.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)


class Recipe:
    """How each GEMM operand is scaled. `transposable`: a quantised operand can be reused,
    transposed, by backward (one scale per tensor), else backward quantises the saved
    high-precision tensor again along its other dim."""

    name = ""
    transposable = True
    multiple = 16  # each rank's GEMM dims must be multiples of this (cuBLAS FP8: 16)

    def __init__(self, fmt: Fp8Format, pow2=True, **options):  # options: delayed scaling's
        # pow2: per-tensor scales rounded down to a power of two (tensorwise, delayed): the cast
        # x * scale is exact, and a last-bit change of the amax (another layout's fp32 sums)
        # leaves the scale as it was unless the amax crosses a power of two
        self.format, self.pow2 = fmt, pow2

    def new_state(self, role: str, dtype) -> object | None:
        return None

    def quantise(self, op, t, role, dtype, dims) -> Quantised:
        """t (rows, k), its logical dims `dims` (rows', k's): FP8 data and its scale."""
        raise NotImplementedError

    def scale(self, op, amax, role, dtype, dims, record=False) -> torch.Tensor:
        """A per-tensor recipe's scale for a tensor whose local amax is `amax` (reduced over the
        groups sharding `dims` here), as `quantise` computes it: ZeRO-3's FP8 parameter gather
        (parallel/fp8_gather.py) casts the weight's shards itself. `record`: the amax counts
        for delayed scaling's history."""
        raise NotImplementedError(f"the {self.name} recipe has no per-tensor scale")

    def gemm(self, a: Quantised, b: Quantised, out_dtype) -> torch.Tensor:
        return scaled_gemm(a, b, out_dtype)


class Tensorwise(Recipe):
    name = "tensorwise"

    def scale(self, op, amax, role, dtype, dims, record=False):
        op.reduce(amax, dims)  # the whole tensor's amax: every group that shards it
        return amax_to_scale(amax, dtype, pow2=self.pow2)

    def quantise(self, op, t, role, dtype, dims):
        scale = self.scale(op, op.casts.amax(t), role, dtype, dims)
        return Quantised(op.casts.cast(t, scale, dtype), scale.reciprocal())


class Rowwise(Recipe):
    name = "rowwise"
    transposable = False

    def quantise(self, op, t, role, dtype, dims):
        amax = t.detach().abs().amax(dim=-1, keepdim=True).float()  # (rows, 1)
        op.reduce(amax, dims[1:])  # along k only: the group that shards k
        scale = amax_to_scale(amax, dtype, pow2=True)
        return Quantised(cast(t, scale, dtype), scale.reciprocal())


@dataclass
class AmaxHistory:
    """One tensor's delayed scaling: the amaxes of the last `len` steps (newest first), this
    step's running amax (`pending`, local until `end_step` reduces it) and the scale in use."""

    history: torch.Tensor
    pending: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype
    steps: int = 0  # host-side: how many steps filled the history (no device read)


class Delayed(Recipe):
    name = "delayed"

    def __init__(self, fmt, pow2=True, history_len=1024, algo="max", margin=0):
        super().__init__(fmt, pow2)
        if algo not in ("max", "most_recent"):
            raise ValueError(f"fp8 amax compute algo {algo!r}: choose max or most_recent")
        self.history_len, self.algo, self.margin = history_len, algo, margin

    def new_state(self, role, dtype):
        z = torch.zeros(())
        return AmaxHistory(torch.zeros(self.history_len), z.clone(), z + 1.0, dtype)

    def scale(self, op, amax, role, dtype, dims, record=False):
        st = op.state[role]
        if record:  # a training forward or a backward (an evaluation's does not count)
            st.pending = torch.maximum(st.pending.to(amax.device), amax)
        if st.steps == 0:  # no history yet: this tensor's own (reduced) amax
            amax = amax.clone()
            op.reduce(amax, dims)
            return amax_to_scale(amax, dtype, self.margin, self.pow2)
        return st.scale.to(amax.device)

    def quantise(self, op, t, role, dtype, dims):
        scale = self.scale(op, op.casts.amax(t), role, dtype, dims, op.recording)
        return Quantised(op.casts.cast(t, scale, dtype), scale.reciprocal())

    def push(self, st: AmaxHistory, amax: torch.Tensor):
        """Append a step's reduced amax and compute the next step's scale from the history."""
        h = torch.roll(st.history.to(amax.device), 1)
        h[0] = amax
        st.history, st.steps = h, st.steps + 1
        self._rescale(st)

    def _rescale(self, st: AmaxHistory):
        use = st.history.amax() if self.algo == "max" else st.history[0]
        st.scale = amax_to_scale(use, st.dtype, self.margin, self.pow2)
        st.pending = torch.zeros_like(st.pending)

    def restore(self, st: AmaxHistory, history: torch.Tensor, steps: int, device=None):
        """A checkpoint's history (newest first; its newest `history_len` kept, zeros after
        a shorter one) and step count, and the scale `push` computed from them: a resumed
        run scales its next step as the saved one would have."""
        h = torch.zeros(self.history_len, device=device)
        n = min(self.history_len, history.numel())
        h[:n] = history[:n].to(h)
        st.history, st.steps = h, steps
        self._rescale(st)


class MXFP8(Recipe):
    name = "mxfp8"
    transposable = False
    multiple = MX_BLOCK  # blocks must not straddle the tp shards

    def quantise(self, op, t, role, dtype, dims):
        # blocks never straddle shards when each shard's k is a multiple of 32 (validate()):
        # no reduction (and no layer: `op` may be None)
        return getattr(op, "casts", TORCH_CASTS).mx(t, dtype)

    def gemm(self, a, b, out_dtype):
        acc = torch.float64 if out_dtype == torch.float64 else torch.float32
        return (dequantise_mx(a, acc) @ dequantise_mx(b, acc).t()).to(out_dtype)


def dequantise_mx(q: Quantised, dtype=torch.float32) -> torch.Tensor:
    """MX data (rows, k) times its block scales (exact: the scales are powers of 2)."""
    k = q.data.shape[1]
    return q.data.to(dtype) * q.scale.to(dtype).repeat_interleave(MX_BLOCK, 1)[:, :k]


def device_problem() -> str | None:
    """Why this machine's device cannot run FP8 GEMMs, or None: a CUDA GPU needs FP8 tensor
    cores (compute capability 8.9: Ada, Hopper, Blackwell); the CPU computes the same numerics
    (slowly: no FP8 hardware)."""
    if not torch.cuda.is_available():
        return None
    cap = torch.cuda.get_device_capability()
    if cap < (8, 9):
        name = torch.cuda.get_device_name()
        return (f"--fp8-format needs FP8 tensor cores (compute capability 8.9+: H100, H200, "
                f"B200); {name} has {cap[0]}.{cap[1]}")  # fmt: skip
    return None


RECIPES = {"tensorwise": Tensorwise, "rowwise": Rowwise, "delayed": Delayed, "mxfp8": MXFP8}


def make_recipe(name: str, fmt: str = "hybrid", **options) -> Recipe:
    """The recipe `name` in format `fmt`; `options`: pow2 (tensorwise and delayed: power-of-two
    scales, the default), history_len, algo, margin (read by delayed scaling only)."""
    if name not in RECIPES:
        raise ValueError(f"fp8 recipe {name!r}: choose one of {', '.join(RECIPES)}")
    if fmt not in FORMATS:
        raise ValueError(f"fp8 format {fmt!r}: choose one of {', '.join(FORMATS)}")
    return RECIPES[name](FORMATS[fmt], **options)
