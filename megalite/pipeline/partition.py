"""Which layers live on which (pipeline rank, virtual chunk).

With `pp` ranks and `vpp` chunks per rank the layers are cut into pp*vpp equal contiguous
blocks, the *virtual stages*. Chunk c of rank r holds virtual stage c*pp + r (Megatron's
interleaving), so a micro-batch visits rank 0, 1, ..., pp-1, then rank 0 again for chunk 1,
and so on. The embedding lives on virtual stage 0, the final norm, head and loss on the last.
"""

from megalite.errors import MegaliteError


def virtual_stage(pp: int, rank: int, chunk: int) -> int:
    """Position of (rank, chunk) along the whole pipeline, 0 .. pp*vpp-1."""
    return chunk * pp + rank


def stage_of(pp: int, vstage: int) -> tuple[int, int]:
    """(rank, chunk) holding a virtual stage: the inverse of `virtual_stage`."""
    return vstage % pp, vstage // pp


def chunk_layers(num_layers: int, pp: int, vpp: int, rank: int, chunk: int) -> range:
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
    start = virtual_stage(pp, rank, chunk) * per
    return range(start, start + per)


def chunk_has_embedding(pp: int, vpp: int, rank: int, chunk: int) -> bool:
    return virtual_stage(pp, rank, chunk) == 0


def chunk_has_head(pp: int, vpp: int, rank: int, chunk: int) -> bool:
    return virtual_stage(pp, rank, chunk) == pp * vpp - 1


def rank_chunks(num_layers: int, pp: int, vpp: int, rank: int) -> list[dict]:
    """Keyword arguments for each chunk of a rank, e.g. `GPTChunk(cfg, tp, **kw)`:
    {"layers": range, "has_embedding": bool, "has_head": bool}, in chunk order."""
    return [
        {
            "layers": chunk_layers(num_layers, pp, vpp, rank, c),
            "has_embedding": chunk_has_embedding(pp, vpp, rank, c),
            "has_head": chunk_has_head(pp, vpp, rank, c),
        }
        for c in range(vpp)
    ]
