"""RoPE tables and the scalings that stretch them to longer contexts.

`rotary_tables(cfg)` gives the cos and sin tables every attention layer rotates q and k by;
`RotaryTables` holds them once per model chunk, shared by its layers.
`--rope-scaling` picks one of `SCALINGS`, each a function (cfg, base frequencies) ->
(frequencies, attention factor) written after the formulas Hugging Face transformers uses for
its `rope_type` of the same name, in the same fp32 operations, so that converted models give
the same logits. The attention factor multiplies cos and sin (yarn's mscale; 1 elsewhere).
"""

import math

import torch
import torch.nn as nn

from megalite.config import ModelConfig


def _powers(cfg: ModelConfig) -> torch.Tensor:
    """base^(2i/d) for i < d/2, fp32: the wavelengths' divisors of unscaled RoPE."""
    d = cfg.head_dim
    return cfg.rotary_base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)


def _none(cfg: ModelConfig, inv_freq: torch.Tensor):
    return inv_freq, 1.0


def _linear(cfg: ModelConfig, inv_freq: torch.Tensor):
    """Position interpolation: every frequency divided by the factor."""
    return inv_freq / cfg.rope_scaling_factor, 1.0


def _llama3(cfg: ModelConfig, inv_freq: torch.Tensor):
    """Llama 3.1: wavelengths beyond the pretraining context / low_freq_factor are divided by
    the factor, those under context / high_freq_factor kept, a linear ramp between."""
    factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    context = cfg.rope_original_max_position_embeddings
    low_wavelen, high_wavelen = context / low, context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled), 1.0


def yarn_attention_factor(cfg: ModelConfig) -> float:
    """yarn's cos/sin multiplier: given, else 0.1 ln(factor) + 1 (with mscales, their ratio)."""
    if cfg.yarn_attention_factor is not None:
        return cfg.yarn_attention_factor

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    f, m, m_all = cfg.rope_scaling_factor, cfg.yarn_mscale, cfg.yarn_mscale_all_dim
    if m and m_all:
        return float(mscale(f, m) / mscale(f, m_all))
    return mscale(f)


def _yarn(cfg: ModelConfig, inv_freq: torch.Tensor):
    """NTK-by-parts (arXiv 2309.00071): dimensions that rotate fewer than beta_slow times over
    the pretraining context are interpolated (/ factor), more than beta_fast times kept, a ramp
    between; cos and sin are scaled by the attention factor."""
    d, base, factor = cfg.head_dim, cfg.rotary_base, cfg.rope_scaling_factor
    context = cfg.rope_original_max_position_embeddings

    def dim_of(rotations):  # the dimension that turns `rotations` times over the context
        return (d * math.log(context / (rotations * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = dim_of(cfg.yarn_beta_fast), dim_of(cfg.yarn_beta_slow)
    if cfg.yarn_truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    if lo == hi:
        hi += 0.001  # no zero-width ramp
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    powers = _powers(cfg)
    keep = 1 - ramp  # 1: extrapolate (the frequency as it is), 0: interpolate
    inv = (1.0 / (factor * powers)) * (1 - keep) + (1.0 / powers) * keep
    return inv, yarn_attention_factor(cfg)


# --rope-scaling -> (cfg, unscaled frequencies (d/2,)) -> (frequencies, attention factor)
SCALINGS = {"none": _none, "linear": _linear, "llama3": _llama3, "yarn": _yarn}


def rotary_tables(cfg: ModelConfig, device=None, length: int | None = None):
    """cos, sin (length, head_dim/2) in fp32, as Hugging Face computes them (default length:
    seq_length)."""
    length = cfg.seq_length if length is None else length
    inv_freq, factor = SCALINGS[cfg.rope_scaling](cfg, 1.0 / _powers(cfg))
    freqs = torch.outer(torch.arange(length, dtype=torch.int64).float(), inv_freq)
    return (freqs.cos() * factor).to(device), (freqs.sin() * factor).to(device)


class RotaryTable(nn.Module):
    """The cos and sin tables of one model's frequencies (buffers: they follow the chunk's
    `.to()`), shared by all its attention layers: one table per model, not one per layer.
    Built at `length` rows (training: the sequence length) and grown when a longer position is
    asked for (generation: the KV cache's slots), never sized by `max_position_embeddings`.
    A row's values do not depend on the table's length (elementwise fp32), so a grown table
    agrees bit for bit with one built at that length."""

    def __init__(self, cfg: ModelConfig, length: int, device=None):
        super().__init__()
        self.cfg = cfg
        self.build(length, device)

    def build(self, length: int, device=None):
        if torch.device(device or "cpu").type == "meta":  # shapes only: nothing computed
            cos = sin = torch.empty(length, self.cfg.head_dim // 2, device="meta")
        else:
            cos, sin = rotary_tables(self.cfg, device, length)
        self.register_buffer("cos", cos, persistent=False)  # (length, head_dim/2) fp32
        self.register_buffer("sin", sin, persistent=False)

    def tables(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin with at least n rows (a host int: nothing is read from the device)."""
        if n > self.cos.shape[0]:
            self.build(max(n, 2 * self.cos.shape[0]), self.cos.device)
        return self.cos, self.sin


class RotaryTables(nn.Module):
    """A model chunk's rotary tables, one per head dim (latent attention rotates only its
    qk_rope_head_dim dims): layers ask `get(cfg)` for theirs."""

    def __init__(self, length: int, device=None):
        super().__init__()
        self.length, self.device = length, device
        self.by_dim = nn.ModuleDict()

    def get(self, cfg: ModelConfig) -> RotaryTable:
        key = f"d{cfg.head_dim}"
        if key not in self.by_dim:
            self.by_dim[key] = RotaryTable(cfg, self.length, self.device)
        return self.by_dim[key]
