"""The kernels stay small: one set of attention kernels, and no kernel file past ~400 lines."""

from pathlib import Path

import megalite.kernels.attention_core as core

KERNELS = Path(__file__).resolve().parents[2] / "kernels"


def test_every_kernel_file_is_under_400_lines():
    long = {p.name: n for p in KERNELS.glob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"kernel files over 400 lines: {long}"


def test_one_set_of_attention_kernels():
    # Causal, document-masked and ring-block attention all launch attention_core's kernels:
    # no other kernel file defines a @triton.jit function of attention.
    jitted = {p.name for p in KERNELS.glob("attention*.py") if "@triton.jit" in p.read_text()}
    assert jitted == {"attention_core.py"}
    assert {"attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq", "attn_bwd_delta"} <= set(vars(core))
