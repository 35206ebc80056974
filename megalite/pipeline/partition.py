"""Which layers live on which (pipeline rank, virtual chunk).

With `pp` ranks and `vpp` chunks per rank the layers are cut into pp*vpp equal contiguous
blocks, the *virtual stages*. Which (rank, chunk) holds which virtual stage is the schedule's
placement (actions.py); Megatron's interleaving puts virtual stage c*pp + r on chunk c of rank
r, so a micro-batch visits rank 0, 1, ..., pp-1, then rank 0 again for chunk 1, and so on. The
embedding lives on virtual stage 0, the final norm, head and loss on the last.
"""

from megalite.errors import MegaliteError
from megalite.pipeline.actions import interleaved_placement, owner


def virtual_stage(pp: int, rank: int, chunk: int, placement=interleaved_placement) -> int:
    """Position of (rank, chunk) along the whole pipeline, 0 .. pp*vpp-1 (vpp is not needed by
    the interleaved placement)."""
    return placement(pp, None, rank, chunk)


def stage_of(pp: int, vstage: int, vpp: int = 1, placement=interleaved_placement):
    """(rank, chunk) holding a virtual stage: the inverse of `virtual_stage`."""
    if placement is interleaved_placement:
        return vstage % pp, vstage // pp
    return owner(placement, pp, vpp, vstage)


def chunk_layers(num_layers: int, pp: int, vpp: int, rank: int, chunk: int,
                 placement=interleaved_placement) -> range:  # fmt: skip
    """Global indices of the layers held by chunk `chunk` of pipeline rank `rank`."""
    blocks = pp * vpp
    if num_layers % blocks:
        raise MegaliteError(
            f"num_layers={num_layers} is not divisible by pp*vpp={pp}*{vpp}; "
            f"use a multiple of {blocks} layers"
        )
    if not (0 <= rank < pp and 0 <= chunk < vpp):
        raise ValueError(f"rank {rank}, chunk {chunk} outside pp={pp}, vpp={vpp}")
    per = num_layers // blocks
    start = placement(pp, vpp, rank, chunk) * per
    return range(start, start + per)


def chunk_has_embedding(pp: int, vpp: int, rank: int, chunk: int, placement=interleaved_placement):
    return placement(pp, vpp, rank, chunk) == 0


def chunk_has_head(pp: int, vpp: int, rank: int, chunk: int, placement=interleaved_placement):
    return placement(pp, vpp, rank, chunk) == pp * vpp - 1


def rank_chunks(num_layers: int, pp: int, vpp: int, rank: int,
                placement=interleaved_placement) -> list[dict]:  # fmt: skip
    """Keyword arguments for each chunk of a rank, e.g. `GPTChunk(cfg, tp, **kw)`:
    {"layers": range, "has_embedding": bool, "has_head": bool}, in chunk order."""
    return [
        {
            "layers": chunk_layers(num_layers, pp, vpp, rank, c, placement),
            "has_embedding": chunk_has_embedding(pp, vpp, rank, c, placement),
            "has_head": chunk_has_head(pp, vpp, rank, c, placement),
        }
        for c in range(vpp)
    ]


def end_stages(pp: int, vpp: int, placement=interleaved_placement) -> list[int]:
    """The pipeline ranks holding the embedding and the head (the tied-embedding group)."""
    return sorted({owner(placement, pp, vpp, 0)[0], owner(placement, pp, vpp, pp * vpp - 1)[0]})
