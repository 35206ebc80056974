"""Turning a command line's Megatron-LM flags into megalite's (`translate`, called by
config_read.parse_args before parsing): each flag handled as megatron_flags.MEGATRON says; the
architecture flags' features resolved to the one flavour of model_config.FLAVOURS that has them
(from Megatron's defaults: LayerNorm, learned positions, GELU, biases, tied embeddings)."""

import os
import sys

from megalite.errors import MegaliteError
from megalite.megatron_flags import MEGATRON
from megalite.model_config import FLAVOURS

# Megatron's defaults, the features compared with each flavour's
MEGATRON_ARCH = {"norm": "layernorm", "position": "learned", "mlp": "gelu", "linear_bias": True,
                 "qkv_bias": None, "qk_layernorm": False, "latent_attention": False,
                 "attention_sinks": False}  # fmt: skip


def flavour_arch(f) -> dict:
    """A flavour's features in Megatron's terms."""
    mlp = "quick_geglu" if f.clamped_swiglu else "swiglu" if f.gated_mlp else "gelu"
    if not f.rms_norm and not f.norm_bias:
        mlp = "gelu without LayerNorm biases"  # nanogpt: no Megatron flags say this
    return {"norm": f.norm, "position": f.position, "mlp": mlp, "linear_bias": f.linear_bias,
            "qkv_bias": f.qkv_bias, "qk_layernorm": f.qk_norm or f.latent_attention,
            "latent_attention": f.latent_attention, "attention_sinks": f.attention_sinks}  # fmt: skip


def resolve_flavour(asked: dict, who: str = "Megatron's architecture flags ask for") -> str:
    """The first flavour whose features are Megatron's defaults updated by `asked` (a command
    line's architecture flags, or a Megatron checkpoint's args: checkpoint/megatron_args.py);
    none: one line naming the nearest and how it differs."""
    want = {**MEGATRON_ARCH, **asked}
    if want["qkv_bias"] is None:  # Megatron's --add-qkv-bias defaults to --add-bias-linear
        want["qkv_bias"] = want["linear_bias"]
    rows = {name: flavour_arch(f) for name, f in FLAVOURS.items()}
    for name, row in rows.items():
        if row == want:
            return name
    name, row = min(rows.items(), key=lambda kv: sum(kv[1][k] != want[k] for k in want))
    diff = ", ".join(f"{k}={want[k]} ({name}: {row[k]})" for k in want if row[k] != want[k])
    raise MegaliteError(
        f"{who} a model no megalite flavour is: nearest is "
        f"--flavour {name}, which differs in {diff}"
    )


# FP8 flags that only delayed scaling reads: given without --fp8-recipe, they ask for it
DELAYED_ONLY = ("--fp8-amax-history-len", "--fp8-amax-compute-algo")


class Translation:
    """One command line's Megatron flags turned into megalite's, with their notes."""

    def __init__(self, argv, collect: bool = False):
        self.argv = list(argv)
        self.collect = collect  # refusals gathered in .refused (the flag dropped), not raised
        self.refused: list[str] = []
        self.fp8_param_gather = False
        self.arch: dict = {}
        self.zero: str | None = None  # from --data-parallel-sharding-strategy
        self.zero_from: str | None = None  # "1" (distributed optimizer) or "fsdp"
        self.notes: list[str] = []

    def set_zero(self, how):
        if self.zero_from != "fsdp":
            self.zero_from = how
        return []

    def run(self) -> list[str]:
        out, i, argv = [], 0, self.argv
        while i < len(argv):
            flag, eq, inline = argv[i].partition("=")
            h = MEGATRON.get(flag) if flag.startswith("--") else None
            if h is None:
                out.append(argv[i])
                i += 1
                continue
            if eq:
                values, i = [inline], i + 1
            else:
                n = h.nargs
                j = i + 1
                while n == "+" and j < len(argv) and not argv[j].startswith("--"):
                    j += 1
                j = j if n == "+" else i + 1 + n
                values, i = argv[i + 1 : j], j
                if len(values) < (1 if n == "+" else n):
                    raise MegaliteError(f"{flag} expects a value")
            try:
                if h.kind == "refused":
                    raise MegaliteError(h.doc)
                if h.kind == "note":
                    self.notes.append(f"{flag}: {h.doc}")
                else:
                    out += h.to(values, self)
            except MegaliteError as e:
                self._refuse(e)
        try:
            return out + self._finish(out)
        except MegaliteError as e:
            self._refuse(e)
            return out

    def _refuse(self, e: MegaliteError):
        if not self.collect:
            raise e
        self.refused.append(str(e))

    def _finish(self, out) -> list[str]:
        extra = []
        zero = out[out.index("--zero-stage") + 1] if "--zero-stage" in out else None
        if self.zero_from == "fsdp":
            zero = self.zero or "3"
        elif self.zero_from:
            zero = self.zero_from
        extra += ["--zero-stage", zero] if self.zero_from else []
        delayed = [f for f in DELAYED_ONLY if f in out]
        if delayed and "--fp8-format" in out and "--fp8-recipe" not in out:
            extra += ["--fp8-recipe", "delayed"]  # Megatron's default recipe, which they tune
            self.notes.append(f"{delayed[0]}: delayed scaling, Megatron's default recipe "
                              "(megalite's default without these flags: tensorwise)")  # fmt: skip
        if self.fp8_param_gather and (zero == "3" or not self.zero_from):  # megalite's own
            extra.append("--fp8-param-gather")
        elif self.fp8_param_gather:
            self.notes.append(
                "--fp8-param-gather: below ZeRO-3 megalite gathers the updated parameters in "
                "their own precision; each FP8 linear casts its weight in its forward"
            )
        if self.arch:
            name = resolve_flavour(self.arch)
            if "--flavour" in out and out[out.index("--flavour") + 1] != name:
                raise MegaliteError(f"Megatron's architecture flags describe --flavour {name}, "
                                    f"not the --flavour given")  # fmt: skip
            extra += ["--flavour", name]
            if FLAVOURS[name].latent_attention and "--kv-channels" in out:  # Megatron ignores it
                i = out.index("--kv-channels")
                del out[i : i + 2]
                self.notes.append("--kv-channels: multi-latent attention's head dims are "
                                  "--qk-head-dim, --qk-pos-emb-head-dim and --v-head-dim")  # fmt: skip
            if "--untie-embeddings-and-output-weights" not in out:
                extra.append("--no-untie-embeddings-and-output-weights")  # Megatron: tied
            if self.arch.get("mlp") == "swiglu" and "--ffn-hidden-size" not in out:
                h = out[out.index("--hidden-size") + 1] if "--hidden-size" in out else None
                if h is not None:  # Megatron's SwiGLU width: 8h/3 rounded down to 64
                    extra += ["--ffn-hidden-size", str(int(4 * int(h) * 2 / 3 / 64) * 64)]
        return extra


def translate(argv) -> list[str]:
    """argv with Megatron's flags of MEGATRON turned into megalite's; the notes printed on rank 0
    (one line each), a refused flag raised as MegaliteError."""
    tr = Translation(argv)
    out = tr.run()
    if tr.notes and int(os.environ.get("RANK", 0)) == 0:
        for line in tr.notes:
            print(f"megalite: note: {line}", file=sys.stderr)
    return out
