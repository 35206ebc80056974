"""Which layers live on which (pipeline rank, virtual chunk).

With `pp` ranks and `vpp` chunks per rank the pipeline is cut into pp*vpp contiguous *virtual
stages*. A `Partition` is the number of transformer layers of each virtual stage, in the order a
micro-batch visits them; the embedding lives on virtual stage 0, the final norm, head, loss (and
MTP) on the last. Which (rank, chunk) holds which virtual stage is the schedule's placement
(actions.py); Megatron's interleaving puts virtual stage c*pp + r on chunk c of rank r, so a
micro-batch visits rank 0, 1, ..., pp-1, then rank 0 again for chunk 1, and so on.

The stages are even by default. Production runs make them uneven (the first and last stage carry
the embedding and the 128k-vocabulary head, about a layer each), with Megatron's flags, read by
`Partition.from_flags`:

  --decoder-first-pipeline-num-layers F / --decoder-last-pipeline-num-layers L
      layers on the first / last pipeline rank (all its chunks); the rest split evenly over the
      other ranks; each rank's layers split evenly over its vpp chunks
  --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split
      count the embedding / the loss as one layer: num_layers + 1 (+ 1) split evenly over the
      virtual stages, the first / last virtual stage one transformer layer short
  --pipeline-model-parallel-layout "Et*3|(tt|)*29,m|L"
      the layout string (`parse_layout`): every virtual stage spelled out

Each is checked here, with one sentence naming what does not add up, before any process exists.
"""

import re

from megalite.errors import MegaliteError
from megalite.pipeline.actions import interleaved_placement, owner


class Partition:
    """Layers per virtual stage (`counts`, pipeline order) over pp ranks of vpp chunks, and the
    schedule's placement of virtual stages on (rank, chunk)."""

    def __init__(self, counts, pp: int, vpp: int = 1, placement=interleaved_placement):
        counts = tuple(counts)
        if len(counts) != pp * vpp:
            raise MegaliteError(
                f"a pipeline layout of {len(counts)} stages does not fit pp*vpp={pp}*{vpp}="
                f"{pp * vpp} virtual stages"
            )
        if any(n < 0 for n in counts):
            raise MegaliteError(
                f"the pipeline layout {list(counts)} gives a stage fewer than 0 layers"
            )
        self.counts, self.pp, self.vpp, self.placement = counts, pp, vpp, placement
        self.starts = tuple(sum(counts[:i]) for i in range(len(counts)))

    @classmethod
    def even(cls, num_layers: int, pp: int, vpp: int = 1, placement=interleaved_placement):
        blocks = pp * vpp
        if num_layers % blocks:
            raise MegaliteError(
                f"num_layers={num_layers} is not divisible by pp*vpp={pp}*{vpp}; use a multiple "
                f"of {blocks} layers, or uneven stages (--decoder-first-pipeline-num-layers, "
                "--decoder-last-pipeline-num-layers or --pipeline-model-parallel-layout)"
            )
        return cls([num_layers // blocks] * blocks, pp, vpp, placement)

    @classmethod
    def from_flags(cls, num_layers: int, pp: int, vpp: int = 1, placement=interleaved_placement, *,
                   first: int | None = None, last: int | None = None, embedding: bool = False,
                   loss: bool = False, layout: str | None = None, mtp_layers: int = 0):  # fmt: skip
        """The partition Megatron's flags describe (see the module docstring); even without."""
        if layout is not None:
            if first is not None or last is not None or embedding or loss:
                raise MegaliteError(
                    "--pipeline-model-parallel-layout spells out every stage; drop "
                    "--decoder-first/last-pipeline-num-layers and --account-for-* beside it"
                )
            counts = parse_layout(layout, pp * vpp, num_layers, mtp_layers)
            return cls(counts, pp, vpp, placement)
        if (first is not None or last is not None) and (embedding or loss):
            raise MegaliteError(
                "--decoder-first/last-pipeline-num-layers and --account-for-*-in-pipeline-split "
                "both set the end stages; use one of them"
            )
        if embedding or loss:
            total = num_layers + embedding + loss
            if total % (pp * vpp):
                raise MegaliteError(
                    f"num_layers={num_layers} plus the embedding/loss counted as layers ({total}) "
                    f"is not divisible by pp*vpp={pp}*{vpp}"
                )
            counts = [total // (pp * vpp)] * (pp * vpp)
            counts[0] -= embedding
            counts[-1] -= loss
            return cls(counts, pp, vpp, placement)
        if first is None and last is None:
            return cls.even(num_layers, pp, vpp, placement)
        return cls(_first_last(num_layers, pp, vpp, first, last), pp, vpp, placement)

    # ---- questions ---------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return sum(self.counts)

    @property
    def even_split(self) -> bool:
        return len(set(self.counts)) == 1

    def virtual_stage(self, rank: int, chunk: int) -> int:
        """Position of (rank, chunk) along the pipeline, 0 .. pp*vpp-1."""
        if not (0 <= rank < self.pp and 0 <= chunk < self.vpp):
            raise ValueError(f"rank {rank}, chunk {chunk} outside pp={self.pp}, vpp={self.vpp}")
        return self.placement(self.pp, self.vpp, rank, chunk)

    def stage_of(self, vstage: int) -> tuple[int, int]:
        """(rank, chunk) holding a virtual stage: the inverse of `virtual_stage`."""
        return owner(self.placement, self.pp, self.vpp, vstage)

    def layers(self, rank: int, chunk: int) -> range:
        """Global indices of the layers held by chunk `chunk` of pipeline rank `rank`."""
        vs = self.virtual_stage(rank, chunk)
        return range(self.starts[vs], self.starts[vs] + self.counts[vs])

    def rank_chunks(self, rank: int) -> list[dict]:
        """Keyword arguments for each chunk of a rank, e.g. `GPTChunk(cfg, env, **kw)`:
        {"layers": range, "has_embedding": bool, "has_head": bool}, in chunk order."""
        last = self.pp * self.vpp - 1
        return [
            {
                "layers": self.layers(rank, c),
                "has_embedding": self.virtual_stage(rank, c) == 0,
                "has_head": self.virtual_stage(rank, c) == last,
            }
            for c in range(self.vpp)
        ]

    def rank_layers(self, rank: int) -> int:
        """Transformer layers held by a pipeline rank (all its chunks)."""
        return sum(len(kw["layers"]) for kw in self.rank_chunks(rank))

    def end_stages(self) -> list[int]:
        """The pipeline ranks holding the embedding and the head (the tied-embedding group)."""
        return sorted({self.stage_of(0)[0], self.stage_of(self.pp * self.vpp - 1)[0]})

    def check_every_rank_holds_something(self):
        """A training run's pipeline ranks each hold a layer, the embedding or the head: a rank
        holding nothing would have no parameters to train (a chunk of 0 layers is fine)."""
        for r in range(self.pp):
            if not any(kw["layers"] or kw["has_embedding"] or kw["has_head"]
                       for kw in self.rank_chunks(r)):  # fmt: skip
                raise MegaliteError(
                    f"pipeline rank {r} would hold no layer, embedding or head (layers per "
                    f"virtual stage {self}); give it a layer or use a smaller --pp"
                )

    def __str__(self) -> str:  # "5|4|4|3": layers per virtual stage, as plans print it
        return "|".join(map(str, self.counts))


def _first_last(num_layers: int, pp: int, vpp: int, first: int | None, last: int | None):
    """Layers per virtual stage when the first and/or last pipeline rank hold a given number."""
    if pp == 1:
        raise MegaliteError("--decoder-first/last-pipeline-num-layers need pp > 1")
    per_rank = [None] * pp
    if first is not None:
        per_rank[0] = first
    if last is not None:
        per_rank[-1] = last
    given = [n for n in per_rank if n is not None]
    if any(n < 0 for n in given):
        raise MegaliteError("--decoder-first/last-pipeline-num-layers must be >= 0")
    rest, middle = num_layers - sum(given), per_rank.count(None)
    if rest < 0 or (middle == 0 and rest) or (middle and rest % middle):
        raise MegaliteError(
            f"num_layers={num_layers} less the first/last stages' {sum(given)} leaves {rest} "
            f"layers, which do not split evenly over the other {middle} pipeline ranks"
        )
    per_rank = [rest // middle if n is None else n for n in per_rank]
    bad = [r for r, n in enumerate(per_rank) if n % vpp]
    if bad:
        raise MegaliteError(
            f"pipeline rank {bad[0]} would hold {per_rank[bad[0]]} layers, not divisible by its "
            f"vpp={vpp} chunks; use --pipeline-model-parallel-layout to place each chunk"
        )
    # virtual stage c*pp + r is chunk c of rank r in Megatron's (and the layout string's) order
    return [per_rank[v % pp] // vpp for v in range(pp * vpp)]


# ---- Megatron's layout string ---------------------------------------------------------------

_REPEAT = re.compile(r"\(([^()]*)\)\*(\d+)|([A-Za-z|])\*(\d+)")


def expand_layout(text: str) -> str:
    """The layout string with its repetitions written out and commas dropped: its virtual
    stages are `expand_layout(text).split("|")`."""
    flat, prev = text.replace(",", "").replace(" ", ""), None
    while prev != flat:  # innermost repetitions first
        prev = flat
        flat = _REPEAT.sub(lambda m: (m[1] if m[1] is not None else m[3]) * int(m[2] or m[4]), flat)
    return flat


def parse_layout(text: str, stages: int, num_layers: int, mtp_layers: int = 0) -> list[int]:
    """Transformer layers per virtual stage from Megatron's layout string: `E` embedding, `t` a
    transformer layer, `m` an MTP layer, `L` the loss (and head), `|` between stages, `x*n` or
    `(...)*n` repeated n times, commas cosmetic. E must open the first stage and L end the last;
    megalite runs MTP with the head, so the `m`s belong in L's stage."""
    flat = expand_layout(text)
    if set(flat) - set("EtmL|"):
        bad = sorted(set(flat) - set("EtmL|"))
        raise MegaliteError(
            f"the pipeline layout {text!r} has {bad}: use E (embedding), t (layer), m (MTP), "
            "L (loss), | between stages, (...)*n to repeat"
        )
    parts = flat.split("|")
    if len(parts) != stages:
        raise MegaliteError(
            f"the pipeline layout {text!r} has {len(parts)} stages; pp*vpp is {stages}"
        )
    if flat.count("E") != 1 or not parts[0].startswith("E"):
        raise MegaliteError(f"the pipeline layout {text!r} must open with E (the embedding), once")
    if flat.count("L") != 1 or not parts[-1].endswith("L"):
        raise MegaliteError(f"the pipeline layout {text!r} must end with L (the loss), once")
    counts = [p.count("t") for p in parts]
    if sum(counts) != num_layers:
        raise MegaliteError(
            f"the pipeline layout {text!r} places {sum(counts)} transformer layers; the model has "
            f"{num_layers}"
        )
    if flat.count("m") != mtp_layers or "m" in "".join(parts[:-1]):
        raise MegaliteError(
            f"the pipeline layout {text!r} places {flat.count('m')} MTP layers; the model has "
            f"{mtp_layers}, and megalite runs them with the head (put them in L's stage)"
        )
    return counts


# ---- even stages, for callers without a run shape (tests, benchmarks) -----------------------


def rank_chunks(num_layers: int, pp: int, vpp: int, rank: int, placement=interleaved_placement):
    """`Partition.even(...).rank_chunks(rank)`."""
    return Partition.even(num_layers, pp, vpp, placement).rank_chunks(rank)


def end_stages(pp: int, vpp: int, placement=interleaved_placement) -> list[int]:
    """The pipeline ranks holding the embedding and the head, whatever the layers per stage."""
    return Partition([0] * (pp * vpp), pp, vpp, placement).end_stages()
